"""Checkpoints: DeepSpeed's model/optimizer files plus what DeepSpeed does not keep.

Layout of `save_dir`:
  latest                      tag of the newest *complete* checkpoint (moved last, atomically)
  <tag>/meta.json             step, consumed samples, parallel layout, model shape, config
  <tag>/rng_rank<R>.pt        per-rank Python/NumPy/torch RNG states and the dropout streams
  <tag>/...                   DeepSpeed's mp_rank_*/layer_*/zero_pp_rank_* files
"""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch

from .config import Config
from .device import barrier
from .model.rng import seed_streams

LATEST = "latest"
META = "meta.json"
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
    """Save on every rank; `latest` moves only after all ranks finished writing."""
    tag = tag_for(step)
    client_state = {"step": step, "consumed_samples": consumed_samples}
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    tag_dir = os.path.join(save_dir, tag)
    rng_path = os.path.join(tag_dir, f"rng_rank{parallel.rank:05d}.pt")
    torch.save(rng_state(tracker), rng_path + ".tmp")
    os.replace(rng_path + ".tmp", rng_path)
    if parallel.rank == 0:
        if cfg.data.vocab_file:
            save_vocab(cfg.data.vocab_file, tag_dir)
        meta = {
            "step": step,
            "consumed_samples": consumed_samples,
            "world_size": parallel.world_size,
            "layout": layout_of(cfg, parallel),
            "model_shape": model_shape_of(cfg),
            "config": cfg.to_dict(),
        }
        _atomic_write(os.path.join(tag_dir, META), json.dumps(meta, indent=2))
    barrier()
    if parallel.rank == 0:
        _atomic_write(os.path.join(save_dir, LATEST), tag)
        _prune(save_dir, keep_last, keep=tag)
    barrier()
    return tag


def save_vocab(vocab_file: str, tag_dir: str) -> None:
    """Keep the tokenizer with the weights (conversion to Hugging Face format needs it): a
    vocab.txt as is; a tokenizer.json as is plus the vocab.txt it implies."""
    if not vocab_file.endswith(".json"):
        shutil.copyfile(vocab_file, os.path.join(tag_dir, "vocab.txt"))
        return
    from .data.tokenizer import load_tokenizer, tokenizer_vocab

    shutil.copyfile(vocab_file, os.path.join(tag_dir, "tokenizer.json"))
    vocab = tokenizer_vocab(load_tokenizer(tokenizer_json=vocab_file).tokenizer)
    _atomic_write(os.path.join(tag_dir, "vocab.txt"), "".join(f"{token}\n" for token, _ in
                                                            sorted(vocab.items(), key=lambda item: item[1])))


def _prune(save_dir: str, keep_last: int, keep: str) -> None:
    if keep_last <= 0:
        return
    tags = sorted(d for d in os.listdir(save_dir) if d.startswith("iter_") and os.path.isdir(os.path.join(save_dir, d)))
    for old in tags[:-keep_last]:
        if old != keep:
            shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)


def latest_tag(load_dir: str) -> str | None:
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def read_meta(load_dir: str, tag: str) -> dict:
    path = os.path.join(load_dir, tag, META)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing: {load_dir}/{tag} is not a complete checkpoint of this trainer")
    with open(path) as f:
        return json.load(f)


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


def load_checkpoint(engine, load_dir: str, cfg: Config, parallel, tracker, log=print) -> tuple[int, int] | None:
    """Resume from `latest` in load_dir. Returns (step, consumed_samples), or None if there is none."""
    tag = latest_tag(load_dir)
    if tag is None:
        return None
    path = os.path.join(load_dir, tag)
    check_compatible(read_meta(load_dir, tag), cfg, parallel, path)
    loaded, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    rng_path = os.path.join(path, f"rng_rank{parallel.rank:05d}.pt")
    if not os.path.exists(rng_path):
        raise CheckpointError(f"{rng_path} is missing: the checkpoint was written by a different number of ranks")
    state = torch.load(rng_path, weights_only=False)
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
    load_dir, tag = os.path.split(os.path.normpath(tag_dir))
    check_compatible(read_meta(load_dir, tag), cfg, parallel, tag_dir)
    loaded, client_state = engine.load_checkpoint(load_dir, tag=tag, load_module_only=not optimizer_states,
                                                  load_optimizer_states=optimizer_states,
                                                  load_lr_scheduler_states=False)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {tag_dir}")
    return int((client_state or {}).get("step", -1))
