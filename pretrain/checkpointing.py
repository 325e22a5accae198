"""Checkpoints: DeepSpeed's model/optimizer files plus what DeepSpeed does not keep.

Layout of `save_dir`:
  latest                      tag of the newest *complete* checkpoint (moved last, atomically)
  <tag>/meta.json             step, consumed samples, parallel layout, model shape, config, and
                              the name and size of every other file of the checkpoint
  <tag>/rng_rank<R>.pt        per-rank Python/NumPy/torch RNG states and the dropout streams
  <tag>/...                   DeepSpeed's mp_rank_*/layer_*/zero_pp_rank_* files
  <tag>.partial/              a save in progress, or one that was killed: never loaded; removed
                              by the next save of that step and by pruning

A save writes into <tag>.partial; once every rank has written its files, rank 0 lists them in
meta.json, renames the directory to <tag> and only then moves `latest`. So an iter_* directory
is always complete, and a resume checks every listed file (present, recorded size) before it
loads anything.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil

import numpy as np
import torch

from .config import Config
from .device import barrier
from .model.rng import seed_streams

LATEST = "latest"
META = "meta.json"
PARTIAL = ".partial"  # suffix of a tag directory being written
REPLACED = ".replaced"  # suffix of a complete checkpoint while a new save of its step replaces it
TAG_PATTERN = re.compile(r"iter_(\d+)")
# Model fields that change parameter shapes: a checkpoint only loads into the same values.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_size",
                "max_position_embeddings", "type_vocab_size", "make_vocab_size_divisible_by")


class CheckpointError(RuntimeError):
    pass


def tag_for(step: int) -> str:
    return f"iter_{step:07d}"


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def layout_of(cfg: Config, parallel) -> dict:
    return {
        "tensor_parallel": parallel.tp_size,
        "pipeline_parallel": parallel.pp_size,
        "data_parallel": parallel.dp_size,
        "zero_stage": cfg.parallel.zero_stage,
        "precision": cfg.train.precision,
        "optimizer": cfg.optimizer.name,
    }


def model_shape_of(cfg: Config) -> dict:
    return {name: getattr(cfg.model, name) for name in SHAPE_FIELDS}


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
                    keep_last: int) -> str:
    """Save on every rank into <tag>.partial; `latest` moves only after every rank finished
    writing and the directory was renamed to <tag> with its file list in meta.json."""
    tag = tag_for(step)
    staging_tag = tag + PARTIAL
    staging = os.path.join(save_dir, staging_tag)
    if parallel.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save of this step left
    barrier()  # nobody writes into the directory while rank 0 removes it
    client_state = {"step": step, "consumed_samples": consumed_samples}
    engine.save_checkpoint(save_dir, tag=staging_tag, client_state=client_state, save_latest=False)
    rng_path = os.path.join(staging, f"rng_rank{parallel.rank:05d}.pt")
    torch.save(rng_state(tracker), rng_path + ".tmp")
    os.replace(rng_path + ".tmp", rng_path)
    if parallel.rank == 0 and cfg.data.vocab_file:
        save_vocab(cfg.data.vocab_file, staging)
    barrier()  # every rank's files are written
    if parallel.rank == 0:
        meta = {
            "step": step,
            "consumed_samples": consumed_samples,
            "world_size": parallel.world_size,
            "layout": layout_of(cfg, parallel),
            "model_shape": model_shape_of(cfg),
            "config": cfg.to_dict(),
            "files": _file_sizes(staging),
        }
        _atomic_write(os.path.join(staging, META), json.dumps(meta, indent=2))
        _publish(staging, os.path.join(save_dir, tag))
        _atomic_write(os.path.join(save_dir, LATEST), tag)
        _fsync_dir(save_dir)
        _prune(save_dir, keep_last, keep=tag)
    barrier()
    return tag


def _file_sizes(tag_dir: str) -> dict[str, int]:
    """Every file under tag_dir (relative path -> size in bytes): what a resume checks."""
    sizes = {}
    for root, _, files in os.walk(tag_dir):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, tag_dir)] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


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


def save_vocab(vocab_file: str, tag_dir: str) -> None:
    """Keep the tokenizer with the weights (conversion to Hugging Face format needs it): a
    vocab.txt as is; a tokenizer.json as is plus the vocab.txt it implies."""
    if not vocab_file.endswith(".json"):
        shutil.copyfile(vocab_file, os.path.join(tag_dir, "vocab.txt"))
        return
    from .data.tokenizer import load_tokenizer, tokenizer_vocab, write_vocab_file

    shutil.copyfile(vocab_file, os.path.join(tag_dir, "tokenizer.json"))
    # written into the unpublished tag directory: no temp-then-rename needed
    write_vocab_file(tokenizer_vocab(load_tokenizer(tokenizer_json=vocab_file).tokenizer),
                     os.path.join(tag_dir, "vocab.txt"), vocab_file)


def _prune(save_dir: str, keep_last: int, keep: str) -> None:
    """Remove the complete checkpoints older than the newest keep_last (by step, not by name) and
    what killed saves left (<tag>.partial; <tag>.replaced, needed only until `latest` names a
    complete directory, which it does when this runs). Nothing else in save_dir is touched."""
    complete = _complete_tags(save_dir)
    old = complete[:-keep_last] if keep_last > 0 else []
    leftovers = [name for name in os.listdir(save_dir) if name.endswith((PARTIAL, REPLACED))
                 and TAG_PATTERN.fullmatch(name.rsplit(".", 1)[0]) and os.path.isdir(os.path.join(save_dir, name))]
    for name in old + leftovers:
        if name != keep:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def latest_tag(load_dir: str) -> str | None:
    """The tag `latest` names, after checking that checkpoint is whole (verify_checkpoint): a
    damaged one raises CheckpointError naming the file, before anything is loaded. None when
    load_dir holds no `latest` yet."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    tag_dir = os.path.join(load_dir, tag)
    if not tag or not os.path.isdir(tag_dir):
        aside = tag_dir + REPLACED
        if tag and os.path.isdir(aside) and os.path.exists(os.path.join(aside, META)):
            try:  # a save replacing this step's checkpoint was killed between its two renames
                os.rename(aside, tag_dir)
            except OSError:
                pass  # another rank took it back first
        if not tag or not os.path.isdir(tag_dir):
            raise CheckpointError(f"{path} names {tag!r}, which is not a directory in {load_dir}")
    try:
        verify_checkpoint(tag_dir)
    except CheckpointError as e:
        older = [name for name in _complete_tags(load_dir) if name != tag][-3:]
        hint = f"; older checkpoints: {', '.join(older)} (write one's name into {path} to resume from it)"
        raise CheckpointError(f"{e}{hint if older else ''}") from None
    return tag


def _complete_tags(save_dir: str) -> list[str]:
    """The iter_* directories holding a meta.json, by step."""
    found = [name for name in os.listdir(save_dir) if TAG_PATTERN.fullmatch(name)
             and os.path.exists(os.path.join(save_dir, name, META))]
    return sorted(found, key=lambda name: int(name[len("iter_"):]))


def read_meta(load_dir: str, tag: str) -> dict:
    return _read_meta_file(os.path.join(load_dir, tag))


def _read_meta_file(tag_dir: str) -> dict:
    path = os.path.join(tag_dir, META)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {tag_dir} is not a complete checkpoint of this trainer")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSON syntax, or bytes that are not UTF-8
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if not isinstance(meta, dict) or any(key not in meta for key in ("layout", "config")):
        raise CheckpointError(f"{path}: not the meta.json of a checkpoint of this trainer (no layout or config)")
    return meta


def verify_checkpoint(tag_dir: str) -> dict:
    """Check a checkpoint before loading any of it: meta.json readable, and every file it lists
    present with the size it had when saved. Reads no tensor file. Returns the meta.
    (Checkpoints written before meta.json listed the files are checked for meta.json only.)"""
    meta = _read_meta_file(tag_dir)
    files = meta.get("files", {})
    for name, size in files.items():
        path = os.path.join(tag_dir, name)
        try:
            actual = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"{path} is missing: checkpoint {tag_dir} is damaged "
                                  f"(saved with {len(files)} files besides {META})") from None
        if actual != size:
            raise CheckpointError(f"{path} has {actual} bytes, {size} when saved (truncated or overwritten): "
                                  f"checkpoint {tag_dir} is damaged")
    return meta


def layout_differences(meta: dict, cfg: Config, parallel) -> list[str]:
    ours = layout_of(cfg, parallel)
    return [f"{key}: checkpoint {meta['layout'].get(key)} vs run {ours[key]}"
            for key in ("tensor_parallel", "pipeline_parallel", "data_parallel", "zero_stage", "precision", "optimizer")
            if meta["layout"].get(key) != ours[key]]


def shape_differences(meta: dict, cfg: Config) -> list[str]:
    return [f"model.{key}: checkpoint {meta['model_shape'].get(key)} vs run {value}"
            for key, value in model_shape_of(cfg).items() if meta["model_shape"].get(key) != value]


def restores_exactly(meta: dict, cfg: Config, parallel) -> bool:
    """A checkpoint the trainer wrote in this very layout: DeepSpeed restores it bit for bit."""
    return meta.get("exact_resume", True) and not layout_differences(meta, cfg, parallel) \
        and not shape_differences(meta, cfg)


def check_compatible(meta: dict, cfg: Config, parallel, path: str) -> None:
    """Refuse a checkpoint of another layout or model shape, listing every difference."""
    differences = layout_differences(meta, cfg, parallel) + shape_differences(meta, cfg)
    if differences:
        raise CheckpointError(f"checkpoint {path} does not match this run's layout:\n  " + "\n  ".join(differences))


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


def load_checkpoint(engine, load_dir: str, cfg: Config, parallel, tracker, log=print) -> tuple[int, int] | None:
    """Resume from `latest` in load_dir. Returns (step, consumed_samples), or None if there is none.
    Every file is checked, and this rank's RNG file read, before any state changes."""
    tag = latest_tag(load_dir)  # checks the files against meta.json
    if tag is None:
        return None
    path = os.path.join(load_dir, tag)
    check_compatible(read_meta(load_dir, tag), cfg, parallel, path)
    rng_path = os.path.join(path, f"rng_rank{parallel.rank:05d}.pt")
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
        log(f"{rng_path}: the dropout RNG streams were written on {_saved_device_type(state)}, this run is on "
            f"{tracker.device.type}: reseeded them from train.seed + step ({cfg.train.seed} + {step}); "
            "weights, optimizer, data position and schedule resume exactly")
    return step, client_state["consumed_samples"]


def init_from_checkpoint(engine, tag_dir: str, cfg: Config, parallel, optimizer_states: bool) -> int:
    """Load the weights (and optionally optimizer moments) of a checkpoint of this run's layout
    into a fresh run: no step, data position, LR schedule or RNG state. Returns the step it was
    saved at. (Other layouts and Hugging Face directories: pretrain.interop.apply.init_from.)"""
    tag_dir = os.path.normpath(tag_dir)
    check_compatible(verify_checkpoint(tag_dir), cfg, parallel, tag_dir)
    client_state = _engine_load(engine, tag_dir, load_module_only=not optimizer_states,
                                load_optimizer_states=optimizer_states, load_lr_scheduler_states=False)
    return int((client_state or {}).get("step", -1))
