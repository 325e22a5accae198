"""Asynchronous checkpoint saves (checkpoint.async_save): the save step only copies the state to host
memory; a thread of each rank writes, fsyncs and fingerprints that rank's files while training goes
on, and the checkpoint is published (meta.json, <tag>.partial renamed to <tag>, `latest`, retention:
exact.py's steps, in its order) only once every rank's files are durable.

The parts (exact.save_checkpoint_async puts them together):

- Snapshot: one file's content as torch.save would write it now. The object is pickled the way
  torch.save pickles it, each tensor storage copied to host memory (CPU: a copy; CUDA: into pinned
  memory, non-blocking, then one synchronize), so that a later torch.save of the restored object
  writes the same bytes whatever training changes meanwhile (storage sharing, views, non-tensor
  state such as step counters and param groups included). Files say the tensors are on the CPU;
  every reader maps them there anyway.
- SnapshotEngine: a DeepSpeed checkpoint engine (the methods DeepSpeed calls on one) whose save()
  takes a Snapshot and returns; the rest is DeepSpeed's own engine. Installed for one
  engine.save_checkpoint call (internals.checkpoint_engine_replaced), which otherwise runs as
  always on the main thread, with its collectives.
- BackgroundSave: the thread. No collective ever runs on it (it would interleave with training's on
  the same process groups: a deadlock or corrupted reductions on NCCL). The ranks agree through the
  job's TCPStore instead (SaveStore): each rank's thread sets bert-save/<id>/<rank> once its files
  are written and fsync'd (their CRC32s, or its error); rank 0's thread waits for every rank's key
  (resilience.save_timeout_minutes), publishes, and sets bert-save/<id>/published (done, or the
  error) that the other ranks' threads wait for. <id> names the series, the tag and a draw of rank
  0 shared at the save step: a key left by an earlier attempt (torchrun's agent keeps its store
  across restarts) never counts.
- A failure on any rank reaches every rank through rank 0's published outcome, with the step at
  which all raise it (two steps after rank 0's current one: the ranks are within a step of each
  other), so that they stop together at a step boundary; a wait raises it at once.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import threading
import time
from datetime import timedelta
from typing import Callable, NamedTuple

import torch
from torch.serialization import DEFAULT_PROTOCOL

from ..common.diskspace import DiskFullError, disk_full_named
from .errors import CheckpointError
from .format import crc32s

logger = logging.getLogger(__name__)

KEY_PREFIX = "bert-save/"
# ranks may be this many steps apart when rank 0 publishes a failure (see the module's docstring)
RAISE_MARGIN_STEPS = 2


# ----------------------------------------------------------------------------- the snapshot
def _host_copy(storage: torch.UntypedStorage) -> tuple[torch.UntypedStorage, torch.device | None]:
    """A host copy of `storage`; the device to synchronize before it may be read (None: none)."""
    if storage.device.type == "cpu":
        return storage.clone(), None
    if storage.device.type == "cuda":
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
        host.copy_(storage, non_blocking=True)
        return host, storage.device
    return storage.cpu(), None  # another accelerator: a blocking copy


class _SnapshotPickler(pickle.Pickler):
    """torch.save's pickling, with every storage replaced by a reference to a host copy of it (each
    storage copied once, however many tensors view it)."""

    def __init__(self, file, storages: dict[str, torch.UntypedStorage], devices: set):
        super().__init__(file, protocol=DEFAULT_PROTOCOL)
        self.storages, self.devices = storages, devices
        self._keys: dict[int, str] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            untyped, dtype = obj._untyped_storage, obj.dtype  # as torch.serialization reads a TypedStorage
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        key = self._keys.get(untyped._cdata)
        if key is None:
            key = self._keys[untyped._cdata] = str(len(self._keys))
            self.storages[key], device = _host_copy(untyped)
            if device is not None:
                self.devices.add(device)
        return ("storage", key, dtype)


class _SnapshotUnpickler(pickle.Unpickler):
    def __init__(self, file, storages: dict[str, torch.UntypedStorage]):
        super().__init__(file)
        self.storages = storages

    def persistent_load(self, pid):
        _, key, dtype = pid
        storage = self.storages[key]
        return storage if dtype is None else torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype,
                                                                        _internal=True)


class Snapshot:
    """`obj` as it is now, in host memory: restore() gives an equal object whose tensors are CPU
    copies made at construction."""

    def __init__(self, obj):
        self.storages: dict[str, torch.UntypedStorage] = {}
        devices: set = set()
        buffer = io.BytesIO()
        _SnapshotPickler(buffer, self.storages, devices).dump(obj)
        self.pickled = buffer.getvalue()
        for device in devices:  # the non-blocking copies into pinned memory are done
            torch.cuda.synchronize(device)

    @property
    def nbytes(self) -> int:
        return len(self.pickled) + sum(s.nbytes() for s in self.storages.values())

    def restore(self):
        return _SnapshotUnpickler(io.BytesIO(self.pickled), self.storages).load()


class FileWrite(NamedTuple):
    path: str
    snapshot: Snapshot
    write: Callable[[object, str], None]  # writes the restored object to the path (torch.save, DeepSpeed's engine)


class SnapshotEngine:
    """DeepSpeed's checkpoint engine with save() deferred: each file it is asked to write becomes a
    FileWrite of a Snapshot (`writes`), written later by the engine wrapped. Every other call
    (makedirs, create, commit, load, ...) is the wrapped engine's, at once."""

    def __init__(self, wrapped):
        if getattr(wrapped, "name", None) != "TorchCheckpointEngine":
            raise CheckpointError(f"checkpoint.async_save writes through DeepSpeed's TorchCheckpointEngine; the "
                                  f"DeepSpeed config selects {getattr(wrapped, 'name', None) or type(wrapped).__name__} "
                                  "(its \"checkpoint\" section): remove that, or set checkpoint.async_save=false")
        self.wrapped = wrapped
        self.name = wrapped.name
        self.writes: list[FileWrite] = []

    def save(self, state_dict, path: str) -> None:
        self.writes.append(FileWrite(path, Snapshot(state_dict), self.wrapped.save))

    def __getattr__(self, name):
        return getattr(self.wrapped, name)


def fsync_path(path: str) -> None:
    """Flush a file (or a directory's entries) to the disk; a directory a file system will not
    fsync is skipped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- agreement
class SaveStore:
    """The job's TCPStore as the background saves use it: a client connection of their own (made by
    the first save's thread), used by one save's thread at a time."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self._store = None
        self.stale: list[str] = []  # the last save's `published` key, removed by rank 0 at the next save

    def client(self):
        if self._store is None:
            import torch.distributed as dist

            host, port = self.address
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(minutes=5),
                                        wait_for_workers=False)
        return self._store

    def set(self, key: str, value: dict) -> None:
        self.client().set(key, json.dumps(value))

    def wait(self, keys: list[str], seconds: float | None) -> list[dict]:
        """The values of `keys` once all are set (TimeoutError after `seconds`; None: no limit)."""
        store = self.client()
        limit = timedelta(seconds=seconds) if seconds else timedelta(days=365)
        try:
            store.wait(keys, limit)
        except Exception as error:  # torch's DistStoreError on a timeout
            if "timeout" not in str(error).lower() and "timed out" not in str(error).lower():
                raise
            missing = [key for key in keys if not store.check([key])]
            raise TimeoutError(", ".join(missing)) from None
        return [json.loads(value) for value in store.multi_get(keys)]

    def delete(self, keys: list[str]) -> None:
        store = self.client()
        for key in keys:
            store.delete_key(key)


class BackgroundSave:
    """One save's writes on a thread of this rank, and its agreement with the other ranks.

    writes: this rank's files (their snapshots); extra: files of this rank already written on the
    main thread, to fsync and fingerprint too. publish (rank 0 only): called on the thread with
    every rank's {name: CRC32} once all are durable; it writes meta.json, renames, moves `latest`.
    now: the step the main thread is at (where a failure's raise step is counted from).
    """

    def __init__(self, staging: str, step: int, writes: list[FileWrite], extra: list[str], rank: int,
                 world_size: int, store: SaveStore | None, save_id: str, timeout_seconds: float,
                 publish: Callable[[dict[str, str]], None] | None, now: Callable[[], int]):
        if world_size > 1 and store is None:
            raise CheckpointError("checkpoint.async_save: this job has no store to agree on a save through "
                                  "(parallel.store_address); set checkpoint.async_save=false")
        self.staging, self.step, self.rank, self.world_size = staging, step, rank, world_size
        self._writes: list[FileWrite | None] = list(writes)
        self.extra, self.store, self.timeout, self.publish, self.now = extra, store, timeout_seconds, publish, now
        self.key = f"{KEY_PREFIX}{save_id}/"
        self.snapshot_bytes = sum(w.snapshot.nbytes for w in writes)
        self.error: BaseException | None = None
        self.raise_at: int | None = None  # the step boundary to raise `error` at (None: the next one)
        self.seconds = 0.0  # from start() to the outcome
        self.reported = False  # "saved checkpoint" logged
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bert-save-step-{step}", daemon=True)

    def start(self) -> "BackgroundSave":
        self._started = time.monotonic()
        self._thread.start()
        return self

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Until the outcome is known on this rank (bounded by the save's own timeouts), or `timeout`
        seconds; whether it is."""
        return self._finished.wait(timeout)

    def failure_due(self, step: int) -> BaseException | None:
        """The error to raise at the boundary of `step` (None: none, or not yet)."""
        if not self.finished or self.error is None:
            return None
        return self.error if self.raise_at is None or step >= self.raise_at else None

    # the thread
    def _run(self) -> None:
        try:
            report = self._write_own()
            if self.rank == 0:
                self._decide(report)
            else:
                self._follow(report)
        except BaseException as error:  # the store gone, a bug: still an outcome for the main thread
            self.error = self.error or self._named(error)
        finally:
            self.seconds = time.monotonic() - self._started
            self._finished.set()

    def _named(self, error: BaseException) -> BaseException:
        if isinstance(error, (DiskFullError, CheckpointError)):
            return error
        return CheckpointError(f"{self.staging}: the background save of step {self.step} failed on rank {self.rank} "
                               f"({type(error).__name__}: {error}); this save is never loaded; `latest` is unchanged")

    def _write_own(self) -> dict:
        """This rank's files written, fsync'd and fingerprinted: {"files": {name: CRC32}}, or {"error": ...}."""
        try:
            with disk_full_named(self.staging, f"the checkpoint of step {self.step}",
                                 "this save is never loaded; `latest` is unchanged"):
                paths = []
                for index, item in enumerate(self._writes):
                    item.write(item.snapshot.restore(), item.path)
                    self._writes[index] = None  # its host memory goes
                    fsync_path(item.path)
                    paths.append(item.path)
                for path in self.extra:
                    fsync_path(path)
                for directory in sorted({os.path.dirname(p) for p in paths + self.extra} | {self.staging}):
                    fsync_path(directory)
                sums = crc32s(paths + self.extra)
            return {"files": {os.path.relpath(path, self.staging): crc for path, crc in sums.items()}}
        except BaseException as error:
            self.error = self._named(error)
            return {"error": str(self.error), "disk_full": isinstance(self.error, DiskFullError)}

    def _decide(self, own: dict) -> None:
        """Rank 0: every rank's report, then the publication (or the first failure), told to all."""
        reports = {0: own}
        try:
            if self.world_size > 1 and "error" not in own:  # a failure of its own is told at once
                if self.store.stale:
                    self.store.delete(self.store.stale)
                keys = [f"{self.key}{rank}" for rank in range(1, self.world_size)]
                try:
                    found = self.store.wait(keys, self.timeout)
                except TimeoutError as missing:
                    raise CheckpointError(
                        f"{self.staging}: rank(s) {', '.join(k.rsplit('/', 1)[1] for k in str(missing).split(', '))} "
                        f"did not finish writing their files of the checkpoint of step {self.step} within "
                        f"resilience.save_timeout_minutes ({self.timeout / 60:g}); this save is never loaded; "
                        "`latest` is unchanged") from None
                reports.update(zip(range(1, self.world_size), found))
                self.store.delete(keys)
            failed = next((r for r in sorted(reports) if "error" in reports[r]), None)
            if failed is not None:
                if self.error is None:
                    self.error = _rebuilt(reports[failed])
            else:
                sums = {name: crc for report in reports.values() for name, crc in report["files"].items()}
                self.publish(sums)
        except BaseException as error:
            self.error = self.error or self._named(error)
        if self.error is not None:
            self.raise_at = self.now() + RAISE_MARGIN_STEPS if self.world_size > 1 else None
        if self.world_size > 1:
            outcome = {"done": True} if self.error is None else {
                "error": str(self.error), "disk_full": isinstance(self.error, DiskFullError), "raise_at": self.raise_at}
            self.store.set(f"{self.key}published", outcome)
            self.store.stale = [f"{self.key}published"]

    def _follow(self, own: dict) -> None:
        """Another rank: report, then wait for rank 0's outcome."""
        self.store.set(f"{self.key}{self.rank}", own)
        limit = self.timeout * 2 if self.timeout else None  # rank 0 waits `timeout` for the slowest rank first
        try:
            outcome, = self.store.wait([f"{self.key}published"], limit)
        except TimeoutError:
            raise CheckpointError(f"{self.staging}: rank 0 did not publish the checkpoint of step {self.step} within "
                                  f"twice resilience.save_timeout_minutes ({self.timeout / 60:g}); `latest` is "
                                  "unchanged") from None
        if "error" in outcome:
            mine = self.error is not None and str(self.error) == outcome["error"]
            self.error = self.error if mine else _rebuilt(outcome)
            self.raise_at = outcome.get("raise_at")


def _rebuilt(report: dict) -> BaseException:
    """Another rank's failure, as this rank raises it (one line, as the failing rank's)."""
    return (DiskFullError if report.get("disk_full") else CheckpointError)(report["error"])
