"""Load a checkpoint of any layout (or a Hugging Face directory) into a running engine.

The trainer's own checkpoints of the *same* layout are restored by DeepSpeed (exact resume,
exact.py). Everything else comes here as whole logical tensors (logical.py, hf.py) and
each rank copies its part into:

* the model's parameters (its TP shard; ZeRO-3 partitions through GatheredParameters), and
* the tensors the optimizer steps: DeepSpeed's fp32 master partitions (ZeRO-1/2/3, bf16) and
  the optimizer's exp_avg / exp_avg_sq / step, located with the same DeepSpeed bookkeeping
  LAMB uses (optim/layout.py), so any DP size and ZeRO stage can take any checkpoint.
"""
from __future__ import annotations

import logging

import os

import torch

from ..distributed.internals import client_optimizer, set_position
from ..model.names import logical_parameters
from ..model.rng import seed_streams
from ..optim import Lamb, StableAdamW, layout_for_deepspeed
from . import exact
from .format import (CONFIG_JSON, LATEST, MOMENTS, CheckpointError, latest_tag, layout_differences, model_shape_of,
                     read_meta, resolve_tag_dir, restores_exactly, shape_differences)
from .logical import LogicalCheckpoint, read_native
from .sharding import load_hf_state_dict, local_value

logger = logging.getLogger(__name__)


def inference_model(ckpt: LogicalCheckpoint, parallel):
    """`ckpt`'s whole pretraining model (encoder and heads) on this rank's device, its TP shard of
    the weights loaded, in eval mode: what the tools that only run a checkpoint use (fill-mask,
    embeddings, position accuracy), its rows split over the CP group where the ranks have one."""
    from ..model.bert import build_model
    from ..model.context_split import ContextGroup
    from ..model.rng import RngTracker

    m = ckpt.config.model
    tracker = RngTracker(parallel.device)
    seed_streams(tracker, 0, parallel.tp_rank, 0, parallel.dp_rank)
    padded = m.padded_vocab_size(parallel.tp_size)
    context = ContextGroup(parallel.cp_rank, parallel.cp_size, parallel.cp_group)
    model = build_model(m, padded, torch.float32, tracker, parallel.tp_group, context=context).to(parallel.device)
    load_hf_state_dict(model, ckpt.weights, padded, parallel.tp_rank, parallel.tp_size)
    return model.eval()


def is_hf_directory(path: str) -> bool:
    return os.path.exists(os.path.join(path, CONFIG_JSON)) and not os.path.exists(os.path.join(path, LATEST))


def read_any(path: str, with_optimizer: bool) -> LogicalCheckpoint:
    """A native checkpoint (any layout) or a Hugging Face BERT directory."""
    if is_hf_directory(path):
        from .hf import read_hf

        return read_hf(path)
    return read_native(path, with_optimizer=with_optimizer)


def native_meta(path: str) -> tuple[str, dict] | None:
    """(tag directory, meta.json) of a native checkpoint, None for a Hugging Face directory."""
    if is_hf_directory(path):
        return None
    tag_dir = resolve_tag_dir(path)
    return tag_dir, read_meta(tag_dir)


def check_model_matches(ckpt: LogicalCheckpoint, cfg, path: str, new_run: bool = False) -> None:
    """Shapes must agree; the vocabulary padding (a layout matter) may differ, and a new run
    (checkpoint.init_from) may add or drop the binary head (a checkpoint without one carries an
    initialised pooler and classifier, logical.read_native)."""
    ignore = ("make_vocab_size_divisible_by", "binary_head") if new_run else ("make_vocab_size_divisible_by",)
    if new_run and cfg.checkpoint.new_phase and cfg.model.modern:
        ignore += ("max_position_embeddings",)  # no position table: a phase extends the context (phases.py)
    differences = shape_differences(model_shape_of(ckpt.config), cfg, ignore)
    if differences:
        raise CheckpointError(f"checkpoint {path} does not fit this run's model:\n  " + "\n  ".join(differences))


def _fresh_state(optimizer, tensor: torch.Tensor, step: int) -> dict:
    # Lamb and StableAdamW count steps in an int; torch's AdamW in a float32 scalar tensor on the
    # parameter's device.
    count = step if isinstance(optimizer, (Lamb, StableAdamW)) else torch.tensor(float(step), dtype=torch.float32,
                                                                    device=tensor.device)
    return {"step": count, "exp_avg": torch.zeros_like(tensor), "exp_avg_sq": torch.zeros_like(tensor)}


@torch.no_grad()
def load_into_engine(engine, model, ckpt: LogicalCheckpoint, cfg, parallel, with_optimizer: bool,
                     with_schedule: bool) -> None:
    """Copy `ckpt` into this rank's parameters, fp32 masters and (optionally) optimizer state."""
    padded, tp_rank, tp_size = cfg.model.padded_vocab_size(parallel.tp_size), parallel.tp_rank, parallel.tp_size
    weights = load_hf_state_dict(model, ckpt.weights, padded, tp_rank, tp_size)
    values: dict[int, dict[str, torch.Tensor]] = {}
    for lp in logical_parameters(model):
        entry = values[id(lp.param)] = {"weight": weights[id(lp.param)].flatten()}
        if with_optimizer and ckpt.moments is not None:
            for k in MOMENTS:
                entry[k] = local_value(lp.hf_name, ckpt.moments[lp.hf_name][k], padded, lp.tp_partition_dim,
                                       tp_rank, tp_size).flatten()

    layout = layout_for_deepspeed(engine)
    optimizer = client_optimizer(engine)
    for tensor, segments in layout.entries():
        flat = tensor.data.view(-1)
        state = None
        if with_optimizer and ckpt.moments is not None:
            state = optimizer.state[tensor] = _fresh_state(optimizer, tensor, ckpt.optimizer_step)
        for seg in segments:
            entry = values[id(layout.params[seg.logical_index])]
            span = slice(seg.param_offset, seg.param_offset + seg.numel)
            flat[seg.start:seg.start + seg.numel].copy_(entry["weight"][span])
            if state is not None:
                for k in MOMENTS:
                    state[k].view(-1)[seg.start:seg.start + seg.numel].copy_(entry[k][span])
    if with_schedule:
        steps = ckpt.scheduler_steps
        engine.lr_scheduler.load_state_dict({"last_epoch": steps, "_step_count": steps + 1})
        set_position(engine, ckpt.step, ckpt.consumed_samples)


def resume(engine, model, load_dir: str, cfg, parallel, tracker) -> tuple[int, int] | None:
    """Continue the run saved in load_dir: exactly (DeepSpeed) when it was written in this
    layout, otherwise layout-free with weights, optimizer state, step, samples and LR schedule.
    Returns (step, consumed_samples), or None when load_dir holds no checkpoint yet."""
    tag = latest_tag(load_dir)
    if tag is None:
        return None
    tag_dir = os.path.join(load_dir, tag)
    meta = read_meta(tag_dir)
    if restores_exactly(meta, cfg, parallel):
        return exact.load_checkpoint(engine, load_dir, cfg, parallel, tracker)
    ckpt = read_native(tag_dir, with_optimizer=True)
    check_model_matches(ckpt, cfg, tag_dir)
    if ckpt.moments is not None and ckpt.config.optimizer.name != cfg.optimizer.name:
        raise CheckpointError(f"checkpoint {tag_dir} was trained with {ckpt.config.optimizer.name}, this run uses "
                              f"{cfg.optimizer.name}: resume with the same optimizer, or start a new run from its "
                              "weights with checkpoint.init_from")
    load_into_engine(engine, model, ckpt, cfg, parallel, with_optimizer=True, with_schedule=True)
    # The dropout streams of another layout cannot be carried over: new ones, distinct per step.
    seed_streams(tracker, cfg.train.seed + ckpt.step, parallel.tp_rank, parallel.pp_rank, parallel.dp_rank)
    differences = layout_differences(meta, cfg, parallel)
    state = "optimizer state" if ckpt.moments is not None else "no optimizer state (fresh moments)"
    logger.info(f"{tag_dir}: {'; '.join(differences) or 'a converted checkpoint'}: loaded layout-free (weights, "
                f"{state}, step, samples, LR schedule; new dropout RNG streams)")
    return ckpt.step, ckpt.consumed_samples


def init_from(engine, model, path: str, cfg, parallel, optimizer_states: bool) -> str:
    """Start a new run (step 0) from the weights, and optionally the optimizer moments, of a
    native checkpoint of any layout or a Hugging Face directory. Returns what was loaded."""
    found = native_meta(path)
    if found is not None:
        tag_dir, meta = found
        if restores_exactly(meta, cfg, parallel):
            saved_at = exact.init_from_checkpoint(engine, tag_dir, cfg, parallel,
                                                          optimizer_states)
            return f"{tag_dir} (its step {saved_at})"
    ckpt = read_any(path, with_optimizer=optimizer_states)
    check_model_matches(ckpt, cfg, path, new_run=True)
    if optimizer_states and ckpt.moments is None:
        raise CheckpointError(f"checkpoint.init_optimizer_states: {path} holds no optimizer state")
    if optimizer_states and ckpt.config.binary_head != cfg.binary_head:
        raise CheckpointError(f"checkpoint.init_optimizer_states: {path} was trained "
                              f"{'with' if ckpt.config.binary_head else 'without'} the binary head, this run "
                              f"{'has' if cfg.binary_head else 'has not'} one: its optimizer state does not fit; "
                              "start from its weights only")
    load_into_engine(engine, model, ckpt, cfg, parallel, with_optimizer=optimizer_states, with_schedule=False)
    return f"{ckpt.source} (its step {ckpt.step}, loaded layout-free)" + "".join(f"\n  {n}" for n in ckpt.notes)
