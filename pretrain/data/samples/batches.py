"""The interface between datasets and the trainer: one pretraining sample, and how batches of them
are cut for data-parallel ranks and micro-batches.

A dataset is anything with `__len__` and `__getitem__(index) -> dict` returning the SAMPLE_FIELDS
as NumPy arrays; every draw must be a pure function of (seed, index) so that the sample sequence
does not depend on the layout and a resumed run continues it exactly.
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import time
import weakref
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from .packing import PACKED_INPUTS, pack
from .skipped import Ranges, advance, skip_ahead

SAMPLE_FIELDS = {
    "input_ids": np.int64,        # [seq] token ids, [CLS] A [SEP] B [SEP] [PAD]...
    "token_type_ids": np.int64,   # [seq] 0 for segment A (and padding), 1 for segment B
    "padding_mask": np.int64,     # [seq] 1 for real tokens, 0 for padding
    "masked_positions": np.int64,  # [max_predictions] positions of predicted tokens (0 where unused)
    "masked_labels": np.int64,    # [max_predictions] original token ids at those positions
    "masked_weights": np.float32,  # [max_predictions] 1.0 for real predictions, 0.0 for unused slots
    "nsp_label": np.int64,        # [] 0: B follows A (IsNext), 1: B is random (NotNext) - BERT's convention
}


class PretrainingDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.stack([s[name] for s in samples]).astype(dtype)) for name, dtype in SAMPLE_FIELDS.items()}


def collate_packed(samples: list[dict[str, np.ndarray]], parts: int = 1) -> list[dict[str, torch.Tensor]]:
    """collate with data.packing: the samples (a rank's share of a step) share as few rows as
    they fit in, dealt out to `parts` micro-batches (packing.py)."""
    typed = [{name: s[name].astype(dtype, copy=False) for name, dtype in SAMPLE_FIELDS.items()} for s in samples]
    return [{name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in part.items()}
            for part in pack(typed, parts)]


def collate_packed_micro_batches(samples: list[dict[str, np.ndarray]], micro_batch_size: int):
    """collate_packed into as many micro-batches as the samples fill (a step's share, whatever the
    step's accumulation)."""
    return collate_packed(samples, len(samples) // micro_batch_size)


def split_inputs_labels(batch: dict[str, torch.Tensor], device: torch.device):
    """The (inputs, labels) pair the model and the pipeline engine take: inputs (input_ids,
    token_type_ids, padding_mask, masked_positions), or packed (input_ids, token_type_ids,
    sample_ids, masked_positions, position_ids, cls_positions) (see pretrain/model/layers.py)."""
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if "sample_ids" in b:
        inputs = tuple(b[name] for name in PACKED_INPUTS)
    else:
        inputs = (b["input_ids"], b["token_type_ids"], b["padding_mask"], b["masked_positions"])
    labels = (b["masked_labels"], b["masked_weights"], b["nsp_label"])
    return inputs, labels


def micro_batch_indices(consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Sample indices of this rank's next micro-batch (Megatron's pretraining sampler order).

    Each micro-step takes micro_batch_size * dp_size consecutive samples of the global sequence;
    DP rank r takes the r-th slice. The global sequence is thus the same for every layout.
    """
    start = consumed_samples + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


class _RankMicroBatches:
    """Index lists of this rank's micro-batches from a consumed-samples position (the batch
    sampler of the DataLoader): endlessly, or the first `count` of them. With `group` > 1 an
    index list is that many consecutive micro-batches' (packing: a step's share, packed together
    and cut into `group` micro-batches again by the collate function); `count` is in those.
    `group` may be a function of the list's number (a batch warmup's steps: batch_ramp.py)."""

    def __init__(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, dataset_size: int,
                 count: int | None = None, group: int | Callable[[int], int] = 1, skipped: Ranges = ()):
        self.consumed_samples = consumed_samples
        self.skipped = list(skipped)  # ranges of the sequence stepped over (skipped.py)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.dataset_size = dataset_size
        self.count = count
        self.group = group if callable(group) else _Constant(group)
        self._starts = [0]  # the micro-step each index list starts at, as far as computed

    def _start(self, item: int) -> int:
        while len(self._starts) <= item:
            self._starts.append(self._starts[-1] + self.group(len(self._starts) - 1))
        return self._starts[item]

    def __len__(self) -> int:
        if self.count is None:
            raise TypeError("an endless sampler has no length")
        return self.count

    def at(self, item: int) -> list[int]:
        """Sample indices of the item-th index list from the start position."""
        indices = []
        first = self._start(item)
        for micro_step in range(first, first + self.group(item)):
            consumed = advance(self.consumed_samples, micro_step * self.micro_batch_size * self.dp_size, self.skipped)
            indices += micro_batch_indices(consumed, self.micro_batch_size, self.dp_rank, self.dp_size)
        return [i % self.dataset_size for i in indices]

    def __iter__(self) -> Iterator[list[int]]:
        item = 0
        while self.count is None or item < self.count:
            yield self.at(item)
            item += 1


def packed_steps(pack_group) -> bool:
    """A packing group per step (a function of the step's number), not one size for all."""
    return callable(pack_group)


class _Constant:
    """A packing group of the same size for every index list (picklable, unlike a lambda)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, item: int) -> int:
        return self.size


class LoaderError(RuntimeError):
    """A loader process failed (raised, or died) building a micro-batch: names the samples."""


# Loader processes start from a fresh forkserver process, never forked from a rank: a rank runs
# communication threads (gloo's, NCCL's, DeepSpeed's) and os.fork() of a threaded process can
# deadlock in the child on a lock one of those threads held.
LOADER_START_METHOD = "forkserver"
# What the forkserver imports once, so that each loader process it forks starts with them loaded
# (a loader process importing torch itself takes seconds); and signals left to the rank. The
# dataset's own module is added: a corpus's (bert_dataset) brings megatron-core's indexed dataset,
# 3 s of imports a synthetic dataset does not need.
FORKSERVER_PRELOAD = ["pretrain.data.samples._forkserver_init", "torch", "torch.utils.data", "numpy"]


def _loader_context(num_workers: int, dataset):
    if not num_workers:
        return None
    context = multiprocessing.get_context(LOADER_START_METHOD)
    if LOADER_START_METHOD == "forkserver":
        # read when the server starts: once per process, by the first loader
        context.set_forkserver_preload(FORKSERVER_PRELOAD + [type(dataset).__module__])
    return context


def leave_signals_to_the_rank() -> None:
    """For the forkserver and every loader process: SIGTERM/SIGINT sent to the whole job must not
    kill a loader under a rank that is about to save (the rank stops its loaders when it is done,
    _stop_workers); and on Linux the process gets SIGKILL when its parent ends (prctl
    PR_SET_PDEATHSIG, which a fork does not inherit: each process sets it itself; elsewhere torch's
    loader processes watch their parent's pid)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _loader_process_init(worker_id: int) -> None:
    leave_signals_to_the_rank()
    sys.excepthook = functools.partial(quiet_when_the_rank_hangs_up, sys.excepthook)


_RESOURCE_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


def quiet_when_the_rank_hangs_up(previous, exc_type, value, traceback) -> None:
    """sys.excepthook of a loader process. The process hands each batch's tensors to its rank through
    multiprocessing's resource sharer, a thread the rank connects to for their file descriptors, which
    reports its errors through sys.excepthook. A rank interrupted in that handshake (Ctrl-C, SIGTERM:
    it stops its loaders then) leaves the thread a closed connection, whose traceback would land in
    the job's output; that batch is not wanted any more, so there is nothing to say. Anything else
    goes to `previous`."""
    if issubclass(exc_type, (ConnectionError, EOFError)):
        frame = traceback
        while frame is not None:
            if frame.tb_frame.f_code.co_filename.endswith(_RESOURCE_SHARER):
                return
            frame = frame.tb_next
    previous(exc_type, value, traceback)


def _stop_workers(state: dict) -> None:
    """Stop a loader's processes: torch's shutdown (a sentinel, then a join of a few seconds), then
    SIGKILL for any left (they ignore SIGTERM, which torch's shutdown and multiprocessing's exit
    handler would send and then wait for forever). Also run at interpreter exit (weakref.finalize),
    before multiprocessing's own exit handler."""
    iterator, state["iterator"] = state.get("iterator"), None
    workers = list(getattr(iterator, "_workers", None) or [])
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for worker in workers:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()


def _describe(dataset) -> str:
    return getattr(dataset, "description", type(dataset).__name__)


class _Batches:
    """One DataLoader over `sampler`'s micro-batches, in order, with loader processes started
    from the forkserver (or none: batches built inline). Packed (sampler.group micro-batches
    per index list), a loader item is that many micro-batches, handed out one by one."""

    def __init__(self, dataset: PretrainingDataset, sampler: _RankMicroBatches, device: torch.device,
                 num_workers: int, prefetch_factor: int, persistent: bool, packed: bool):
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.packed = packed
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers,
            collate_fn=functools.partial(collate_packed_micro_batches, micro_batch_size=sampler.micro_batch_size)
            if packed else collate,
            prefetch_factor=prefetch_factor if num_workers else None, pin_memory=device.type == "cuda",
            persistent_workers=persistent and num_workers > 0,
            multiprocessing_context=_loader_context(num_workers, dataset),
            worker_init_fn=_loader_process_init if num_workers else None,
            # The loader draws a base seed for its workers; from its own generator, not the global
            # one the dropout streams and exact resume depend on (our samples need no torch RNG).
            generator=torch.Generator(device="cpu").manual_seed(0),
        )
        self._state: dict = {"iterator": None}  # for _stop_workers, also at interpreter exit
        weakref.finalize(self, _stop_workers, self._state)
        self.drawn = 0  # loader items taken from the current pass
        self._pending: list = []  # micro-batches of the last item not handed out yet (packed)

    @property
    def iterator(self):
        return self._state["iterator"]

    def start_pass(self) -> None:
        self._state["iterator"] = iter(self.loader)
        self.drawn = 0
        self._pending = []

    def next(self):
        """The next micro-batch (inputs, labels) on the device; LoaderError naming its samples if
        a loader process raised or died building it."""
        if self.iterator is None:
            self.start_pass()
        if self._pending:
            return split_inputs_labels(self._pending.pop(0), self.device)
        try:
            batch = next(self.iterator)
        except StopIteration:
            raise
        except Exception as error:
            indices = self.sampler.at(self.drawn)
            raise LoaderError(f"loader failed building samples {indices[0]}..{indices[-1]} of {_describe(self.dataset)} "
                              f"({'packed step share' if self.packed else 'micro-batch'} {self.drawn} from sample "
                              f"{self.sampler.consumed_samples}): {type(error).__name__}: {error}") from error
        self.drawn += 1
        if self.packed:
            batch, *self._pending = batch
        return split_inputs_labels(batch, self.device)

    def worker_pids(self) -> list[int]:
        workers = getattr(self.iterator, "_workers", None) or []
        return [w.pid for w in workers if w.pid is not None]

    def close(self) -> None:
        """Stop the loader processes now (they also stop when this object is collected)."""
        _stop_workers(self._state)


class MicroBatchIterator:
    """Endless iterator over this rank's micro-batches, starting at a consumed-samples position.

    With num_workers > 0, that many loader processes build batches ahead of the trainer (torch's
    DataLoader, in order), started once at the first draw; `wait_seconds` accumulates the time the
    trainer spent waiting for one, the figure that shows whether data keeps up. `pack_group` k > 0
    (data.packing): the samples of each k micro-batches (a step's share) share rows, dealt out
    to k micro-batches again (packing.py); the position must then stay at multiples of k
    micro-batches (whole steps), as the trainer's does. A function of the step's number from the
    start position gives each step its own k (a batch warmup: batch_ramp.MicroBatchesPerStep).
    """

    def __init__(self, dataset: PretrainingDataset, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device, num_workers: int = 0, prefetch_factor: int = 4,
                 pack_group: int | Callable[[int], int] = 0, skipped: Ranges = ()):
        self.skipped = list(skipped)  # ranges of the sequence stepped over (data.skip_samples, rollbacks)
        self.consumed_samples = skip_ahead(consumed_samples, self.skipped)
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self.wait_seconds = 0.0
        self._dataset = dataset
        self.pack_group = pack_group
        packed = callable(pack_group) or pack_group > 0
        self._loader_options = dict(num_workers=num_workers, prefetch_factor=prefetch_factor, packed=packed)
        self._batches: _Batches | None = None  # the loader starts at the first draw, from the position then

    def skip(self, micro_batches: int) -> None:
        """Advance the position by one step's `micro_batches` without building batches (for ranks
        that never draw: the middle stages of a pipeline); a later draw starts from the new position."""
        self.consumed_samples = advance(self.consumed_samples, micro_batches * self.micro_batch_size * self.dp_size,
                                        self.skipped)
        if packed_steps(self.pack_group):
            self.pack_group = self.pack_group.after(1)
        self.close()

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        started = time.perf_counter()
        if self._batches is None:
            sampler = _RankMicroBatches(self.consumed_samples, self.micro_batch_size, self.dp_rank, self.dp_size,
                                        len(self._dataset), group=self.pack_group if packed_steps(self.pack_group)
                                        else max(self.pack_group, 1), skipped=self.skipped)
            self._batches = _Batches(self._dataset, sampler, self.device, persistent=False, **self._loader_options)
        batch = self._batches.next()
        self.wait_seconds += time.perf_counter() - started
        self.consumed_samples = advance(self.consumed_samples, self.micro_batch_size * self.dp_size, self.skipped)
        return batch

    def worker_pids(self) -> list[int]:
        return self._batches.worker_pids() if self._batches is not None else []

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        self._batches = None


class FixedMicroBatches:
    """This rank's first `count` micro-batches from sample 0, the same at every pass (evaluation:
    every evaluation sees the same samples). The loader processes start at the first pass and are
    kept for the next ones, not started again per evaluation. `pack_group`: as MicroBatchIterator's
    (`count` a multiple of it)."""

    def __init__(self, dataset: PretrainingDataset, count: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 device: torch.device, num_workers: int = 0, prefetch_factor: int = 4, pack_group: int = 0):
        group = max(pack_group, 1)
        if count % group:
            raise ValueError(f"{count} micro-batches are not whole packing groups of {group}")
        self.count = count
        sampler = _RankMicroBatches(0, micro_batch_size, dp_rank, dp_size, len(dataset), count=count // group,
                                    group=group)
        self._batches = _Batches(dataset, sampler, device, num_workers, prefetch_factor, persistent=True,
                                 packed=pack_group > 0)

    def one_pass(self) -> Iterator:
        """The `count` micro-batches, in order."""
        self._batches.start_pass()
        for _ in range(self.count):
            yield self._batches.next()

    def worker_pids(self) -> list[int]:
        return self._batches.worker_pids()

    def close(self) -> None:
        self._batches.close()
