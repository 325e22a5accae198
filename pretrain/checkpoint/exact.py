"""Exact save and resume: DeepSpeed's model/optimizer files plus what DeepSpeed does not keep
(RNG states, data position, the file list), in the layout of format.py.

A save writes into <tag>.partial; once every rank has written its files, rank 0 lists them in
meta.json, renames the directory to <tag> and only then moves `latest`. So an iter_* directory
is always complete, and a resume checks every listed file (present, recorded size) before it
loads anything. With checkpoint.async_save (save_checkpoint_async, async_save.py) the files are
written by a thread of every rank from a host snapshot taken at the save step, and rank 0's thread
takes the same publishing steps (_finish) once every rank's files are durable.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import pickle
import random
import shutil
import uuid

import numpy as np
import torch

from ..common.atomic import honour_umask, replace_durably
from ..common.diskspace import disk_full_named
from ..config import Config
from ..distributed import internals
from ..distributed.device import all_gather_object, barrier
from ..model.rng import seed_streams
from .format import (LATEST, META, PARTIAL, REPLACED, TAG_PATTERN, CheckpointError, check_compatible, checkpoint_files,
                     content_problems, damaged, fingerprints, latest_tag, layout_of, model_shape_of,
                     read_meta, rng_file, tag_for, verify_checkpoint, with_older_checkpoints)
from .async_save import BackgroundSave, FileWrite, SaveStore, Snapshot, SnapshotEngine, fsync_path
from .series import SERIES_KEY, own_tags
from .tokenizer_files import save_vocab

logger = logging.getLogger(__name__)


def _fsync_dir(path: str) -> None:
    """Make renames inside `path` durable (best effort: some file systems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state(tracker) -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "streams": tracker.state_dict(),
        # The dropout streams are states of the model device's generator: CUDA's Philox states
        # mean nothing to the CPU's Mersenne Twister and the other way round.
        "device_type": tracker.device.type,
    }
    if tracker.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(tracker.device)
    return state


def _saved_device_type(state: dict) -> str:
    if "device_type" in state:
        return state["device_type"]
    # Written before the device type was recorded: a stream of the CPU generator's state size
    # was a CPU (or CPU-generator) run; anything else came from a GPU.
    sizes = {s.numel() for s in state["streams"].values()}
    return "cpu" if sizes <= {torch.get_rng_state().numel()} else "cuda"


def restore_rng_state(state: dict, tracker) -> bool:
    """Restore every generator; False when the dropout streams were written on another kind
    of device, in which case they are left for the caller to reseed."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])  # the CPU generator: the same on every device type
    if _generator_kind(_saved_device_type(state)) != _generator_kind(tracker.device.type):
        return False
    if "cuda" in state and tracker.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], tracker.device)
    tracker.load_state_dict(state["streams"])
    return True


def _generator_kind(device_type: str) -> str:
    """Dropout on any device but CUDA draws from the CPU generator (see model/rng.py)."""
    return "cuda" if device_type == "cuda" else "cpu"


def save_checkpoint(engine, save_dir: str, step: int, consumed_samples: int, cfg: Config, parallel, tracker,
                    keep_last: int, series: str | None, trainer_state: dict | None = None) -> str:
    """Save on every rank into <tag>.partial; `latest` moves only after every rank finished
    writing and the directory was renamed to <tag> with its file list in meta.json. `series`: the
    run's (series.py), recorded in meta.json; retention removes only that series' checkpoints.
    `trainer_state`: what the trainer's parts keep besides (its skipped sample ranges, the spike
    detector's window), meta.json's "trainer_state"."""
    tag = tag_for(step)
    staging_tag = tag + PARTIAL
    staging = os.path.join(save_dir, staging_tag)
    _clear_staging(save_dir, staging, parallel)
    barrier()  # nobody writes into the directory while rank 0 removes it
    # A full disk: one line naming the directory and the space left (DeepSpeed's torch.save says
    # `unexpected pos` or `iostream error`, not ENOSPC)
    with disk_full_named(staging, f"the checkpoint of step {step}", f"this save is never loaded; `{LATEST}` is unchanged"):
        client_state = {"step": step, "consumed_samples": consumed_samples}
        scripts = _recovery_scripts(save_dir) if parallel.rank == 0 else set()
        engine.save_checkpoint(save_dir, tag=staging_tag, client_state=client_state, save_latest=False)
        _write_rng(rng_state(tracker), rng_file(staging, parallel.rank))
        if parallel.rank == 0 and cfg.data.vocab_file:
            save_vocab(cfg.data.vocab_file, staging)
        barrier()  # every rank's files are written
        if parallel.rank == 0:
            _drop_recovery_scripts(save_dir, scripts)
            honour_umask(staging)  # whatever a writer made private, as the user's other files
        # Rank 0 lists the files, every rank fingerprints its share of them (a save's whole size is
        # read once, in parallel), rank 0 records all in meta.json.
        share = (parallel.rank, parallel.world_size)
        names = all_gather_object(checkpoint_files(staging) if parallel.rank == 0 else None)[0]
        sums = {name: crc for part in all_gather_object(fingerprints(staging, names, share)) for name, crc in part.items()}
        if parallel.rank == 0:
            meta = _meta(step, consumed_samples, series, trainer_state, cfg, parallel)
            _finish(save_dir, tag, staging, meta, names, sums, keep_last, series)
    barrier()
    return tag


def save_checkpoint_async(engine, save_dir: str, step: int, consumed_samples: int, cfg: Config, parallel, tracker,
                          keep_last: int, series: str | None, trainer_state: dict | None, store: SaveStore | None,
                          timeout_seconds: float, now) -> BackgroundSave:
    """checkpoint.async_save: what save_checkpoint writes, snapshot to host memory now (DeepSpeed's
    files through async_save.SnapshotEngine, the RNG states; the small vocabulary files are copied
    at once) and written on a thread of every rank while training goes on; rank 0's thread publishes
    it as save_checkpoint does (_finish: meta.json, rename, `latest`, retention) once every rank's
    files are fsync'd (async_save.py says how the ranks agree without a collective). Returns the
    started thread's BackgroundSave; the caller waits for it (`join`) before the next save."""
    tag = tag_for(step)
    staging_tag = tag + PARTIAL
    staging = os.path.join(save_dir, staging_tag)
    _clear_staging(save_dir, staging, parallel)
    # every rank waits for rank 0's removal here, and learns this save's id (its store keys')
    save_id = all_gather_object(f"{series}/{tag}/{uuid.uuid4().hex}" if parallel.rank == 0 else None)[0]
    with disk_full_named(staging, f"the checkpoint of step {step}", f"this save is never loaded; `{LATEST}` is unchanged"):
        client_state = {"step": step, "consumed_samples": consumed_samples}
        scripts = _recovery_scripts(save_dir) if parallel.rank == 0 else set()
        with internals.checkpoint_engine_replaced(engine, SnapshotEngine) as snapshots:
            engine.save_checkpoint(save_dir, tag=staging_tag, client_state=client_state, save_latest=False)
        writes = snapshots.writes + [FileWrite(rng_file(staging, parallel.rank), Snapshot(rng_state(tracker)),
                                               _write_rng)]
        extra = []
        if parallel.rank == 0:
            if cfg.data.vocab_file:
                before = set(checkpoint_files(staging))
                save_vocab(cfg.data.vocab_file, staging)
                extra = [os.path.join(staging, name) for name in checkpoint_files(staging) if name not in before]
            _drop_recovery_scripts(save_dir, scripts)  # DeepSpeed copied them on this thread, in its save
    publish = None
    if parallel.rank == 0:
        meta = _meta(step, consumed_samples, series, trainer_state, cfg, parallel)  # the config as it is now

        def publish(reported: dict[str, str]) -> None:
            with disk_full_named(staging, f"the checkpoint of step {step}",
                                 f"this save is never loaded; `{LATEST}` is unchanged"):
                honour_umask(staging)
                names = checkpoint_files(staging)
                gone = sorted(set(reported) - set(names))
                if gone:
                    raise CheckpointError(f"{os.path.join(staging, gone[0])} is missing although its rank wrote it: "
                                          f"this save is never loaded; `{LATEST}` is unchanged")
                unreported = [name for name in names if name not in reported]  # none that we know of
                for name in unreported:
                    fsync_path(os.path.join(staging, name))
                sums = {**{name: reported[name] for name in names if name in reported},
                        **fingerprints(staging, unreported)}
                _finish(save_dir, tag, staging, meta, names, sums, keep_last, series)

    return BackgroundSave(staging, step, writes, extra, parallel.rank, parallel.world_size, store, save_id,
                          timeout_seconds, publish, now).start()


def _clear_staging(save_dir: str, staging: str, parallel) -> None:
    if parallel.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save of this step left


def _write_rng(state: dict, path: str) -> None:
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def _meta(step: int, consumed_samples: int, series: str | None, trainer_state: dict | None, cfg: Config,
          parallel) -> dict:
    """meta.json but the file list and fingerprints."""
    return {
        "step": step,
        "consumed_samples": consumed_samples,
        SERIES_KEY: series,
        "trainer_state": trainer_state or {},
        "world_size": parallel.world_size,
        "layout": layout_of(cfg, parallel),
        "model_shape": model_shape_of(cfg),
        "config": cfg.to_dict(),
    }


def _finish(save_dir: str, tag: str, staging: str, meta: dict, names: list[str], sums: dict[str, str],
            keep_last: int, series: str | None) -> None:
    """Rank 0, once every rank's files are written: meta.json listing them, the rename to <tag>,
    then `latest`, then retention (in this order: `latest` never names an unfinished save)."""
    meta = dict(meta, files={name: os.path.getsize(os.path.join(staging, name)) for name in names},
                crc32=dict(sorted(sums.items())))
    replace_durably(os.path.join(staging, META), json.dumps(meta, indent=2))
    _publish(staging, os.path.join(save_dir, tag))
    replace_durably(os.path.join(save_dir, LATEST), tag)
    _fsync_dir(save_dir)
    _prune(save_dir, keep_last, keep=tag, series=series)


# What every ZeRO save of DeepSpeed copies into save_dir (engine._copy_recovery_script, no option to
# switch it off): its converters, zero_to_fp32.py and zero_to_torch.py, which join ZeRO partitions
# only, not tensor-parallel shards or pipeline stages, and write the engine's parameter names. The
# converter of our checkpoints is tools/convert_checkpoint.py.
RECOVERY_SCRIPTS = "zero_to_*.py"


def _recovery_scripts(save_dir: str) -> set[str]:
    return set(glob.glob(os.path.join(save_dir, RECOVERY_SCRIPTS)))


def _drop_recovery_scripts(save_dir: str, before: set[str]) -> None:
    """Remove the converter scripts this save's DeepSpeed call left in save_dir; any that were
    there before it (another program's) stay."""
    for path in _recovery_scripts(save_dir) - before:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _publish(staging: str, final: str) -> None:
    """Rename the finished staging directory to its tag. A complete checkpoint of the same step
    already there (a finished run launched again) is moved aside first and removed after; a
    crash between the two renames leaves it as <tag>.replaced, which latest_tag() takes back."""
    if not os.path.exists(final):
        os.rename(staging, final)
        return
    aside = final + REPLACED
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(final, aside)
    os.rename(staging, final)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(save_dir: str, keep_last: int, keep: str, series: str | None) -> None:
    """Remove the run's own complete checkpoints (its series) older than its newest keep_last (by
    step, not by name) and what killed saves left (_leftover). `keep`, the tag `latest` names, and
    every other series' checkpoint stay; nothing else in save_dir is touched."""
    complete = own_tags(save_dir, series)
    old = complete[:-keep_last] if keep_last > 0 else []
    leftovers = [name for name in os.listdir(save_dir) if _leftover(save_dir, name)]
    for name in old + leftovers:
        if name != keep:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def _leftover(save_dir: str, name: str) -> bool:
    """A killed save's directory: <tag>.partial (never loaded), or <tag>.replaced once <tag> is
    complete again (without it, <tag>.replaced is the complete checkpoint latest_tag() takes back)."""
    path = os.path.join(save_dir, name)
    if not os.path.isdir(path) or not name.endswith((PARTIAL, REPLACED)):
        return False
    tag = name.rsplit(".", 1)[0]
    if not TAG_PATTERN.fullmatch(tag):
        return False
    return name.endswith(PARTIAL) or os.path.exists(os.path.join(save_dir, tag, META))


# What a damaged file makes torch.load or DeepSpeed raise (a missing file: DeepSpeed's own asserts).
_LOAD_ERRORS = (OSError, EOFError, pickle.UnpicklingError, RuntimeError, AssertionError, KeyError, ValueError)


def _engine_load(engine, path: str, **kwargs):
    load_dir, tag = os.path.split(path)
    try:
        loaded, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    except _LOAD_ERRORS as e:
        raise CheckpointError(f"{path}: DeepSpeed could not load it ({type(e).__name__}: {e})") from e
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    return client_state


def load_checkpoint(engine, load_dir: str, cfg: Config, parallel, tracker) -> tuple[int, int] | None:
    """Resume from `latest` in load_dir. Returns (step, consumed_samples), or None if there is none.
    Every file is checked, and this rank's RNG file read, before any state changes."""
    tag = latest_tag(load_dir)  # checks the files against meta.json
    if tag is None:
        return None
    path = os.path.join(load_dir, tag)
    meta = read_meta(path)  # latest_tag verified the files' sizes; now their contents
    try:
        verify_contents(path, meta, parallel)
    except CheckpointError as e:
        raise with_older_checkpoints(e, load_dir, tag) from None
    check_compatible(meta, cfg, parallel, path)
    rng_path = rng_file(path, parallel.rank)
    if not os.path.exists(rng_path):
        raise CheckpointError(f"{rng_path} is missing: the checkpoint was written by a different number of ranks")
    try:
        state = torch.load(rng_path, weights_only=False)
    except _LOAD_ERRORS as e:
        raise CheckpointError(f"{rng_path}: cannot read ({type(e).__name__}: {e})") from None
    client_state = _engine_load(engine, path, load_optimizer_states=True, load_lr_scheduler_states=True)
    step = client_state["step"]
    if not restore_rng_state(state, tracker):
        # Not bit-exact (no RNG of one device type replays the other's), but deterministic.
        seed_streams(tracker, cfg.train.seed + step, parallel.tp_rank, parallel.pp_rank, parallel.dp_rank)
        logger.info(f"{rng_path}: the dropout RNG streams were written on {_saved_device_type(state)}, this run is "
                    f"on {tracker.device.type}: reseeded them from train.seed + step ({cfg.train.seed} + {step}); "
                    "weights, optimizer, data position and schedule resume exactly")
    return step, client_state["consumed_samples"]


def verify_contents(tag_dir: str, meta: dict, parallel) -> None:
    """Every file's CRC32 against meta.json, each rank reading its share; every rank raises the
    same error (one collective), so no rank goes on into a load the others refused."""
    found = content_problems(tag_dir, meta, (parallel.rank, parallel.world_size))
    problems = [problem for part in all_gather_object(found) for problem in part]
    if problems:
        raise damaged(problems)


def init_from_checkpoint(engine, tag_dir: str, cfg: Config, parallel, optimizer_states: bool) -> int:
    """Load the weights (and optionally optimizer moments) of a checkpoint of this run's layout
    into a fresh run: no step, data position, LR schedule or RNG state. Returns the step it was
    saved at. (Other layouts and Hugging Face directories: load.init_from.)"""
    tag_dir = os.path.normpath(tag_dir)
    meta = verify_checkpoint(tag_dir)
    verify_contents(tag_dir, meta, parallel)
    check_compatible(meta, cfg, parallel, tag_dir)
    client_state = _engine_load(engine, tag_dir, load_module_only=not optimizer_states,
                                load_optimizer_states=optimizer_states, load_lr_scheduler_states=False)
    return int((client_state or {}).get("step", -1))
