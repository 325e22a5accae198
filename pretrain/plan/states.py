"""Model states per rank: the parameters, gradients and optimizer state DeepSpeed 0.19 holds for a
rank's parameters under each optimizer wrapper the trainer gets, to the byte, and the buffers
around them.

The three figures are defined as pretrain/observability/device_memory.py's FirstStepMemory measures them (storages,
each once): parameters, the model's storages (ZeRO-1/2 and BF16_Optimizer: one flat buffer per
param group; ZeRO-3: the rank's partitions); gradients, every gradient the client optimizer
steps with in a step, over DeepSpeed's per-group (ZeRO-1/2) or per-sub-group (ZeRO-3) steps,
plus the model's own; optimizer state, the moments and the fp32 masters where they are tensors
of their own. The rules (DeepSpeed source, deepspeed/runtime/...):

- flat groups (ZeRO-1/2, BF16_Optimizer) are padded to a multiple of 2 x DP (the NCCL start
  alignment of 2 elements per rank); each rank's partition is 1/DP of that;
- ZeRO-3 splits each parameter into ceil(n / DP) elements; sub-groups close at sub_group_size;
- the wrapper: fp32 ZeRO-0 none; bf16 ZeRO-0 FP16_UnfusedOptimizer (masters and fp32 gradients
  per parameter); bf16 ZeRO-1 with fp32 accumulation (and a pipeline's bf16) BF16_Optimizer,
  which keeps a full-size gradient buffer in the accumulation dtype on every rank;
  otherwise DeepSpeedZeroOptimizer (ZeRO-1/2) or DeepSpeedZeroOptimizer_Stage3;
- ZeRO-1/2 hand the optimizer each group's gradient partition flattened to fp32: a copy,
  unless the partition is one piece of an fp32 model's gradient buffer (a view of the whole
  buffer); bf16 ZeRO-2 with fp32 accumulation keeps an fp32 accumulator per group instead;
- LAMB keeps two fp32 moments per stepped tensor (its step counter is a Python int); torch's
  fused AdamW also a 4-byte step tensor;
- fp32 ZeRO-3 keeps an fp32 copy of its partitions too (DeepSpeed compares a device with a
  string where it means to alias them).
Buffers outside the three figures: ZeRO-3's gradient partition buffer and its reduce bucket
(reduce_bucket_size elements in the communication dtype, for the whole run), ZeRO-1/2's reduce
bucket (model dtype; ZeRO-1 keeps it from the step's first backward to its last, ZeRO-2 within
each backward; a pipeline's ZeRO-1 two at the boundary), ZeRO-3's persistent parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

ITEM = {"fp32": 4, "bf16": 2, "fp16": 2}
# DeepSpeed 0.19's zero_optimization defaults (deepspeed/runtime/zero/config.py)
ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "sub_group_size": 1_000_000_000,
                 "stage3_param_persistence_threshold": 100_000, "stage3_model_persistence_threshold": 2**63 - 1}


def _ceil(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def wrapper_of(precision: str, zero: int, grad_accum: str, pipelined: bool) -> str:
    """DeepSpeed's optimizer wrapper (engine.py _do_optimizer_sanity_check) for the trainer's settings."""
    accumulation = grad_accum if precision == "bf16" else precision
    if zero == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if zero > 0:
        return "BF16_Optimizer" if (precision, accumulation, zero) == ("bf16", "fp32", 1) else "DeepSpeedZeroOptimizer"
    if precision == "fp32":
        return "none"
    return "BF16_Optimizer" if precision == "bf16" and pipelined else "FP16_UnfusedOptimizer"


@dataclass(frozen=True)
class ModelStates:
    wrapper: str
    parameters: int
    gradients: int
    optimizer_state: int
    persistent_buffers: int  # held for the whole run beyond the three (ZeRO-3's gradient partitions, bucket, ...)
    step_buffers: int  # held while the micro-batches of a step run (ZeRO-1/2 buckets, gradient accumulation)
    # the tensors of the rank's checkpoint files (checkpoint_bytes); an asynchronous save's host snapshot
    checkpoint: int = 0


def checkpoint_bytes(parameters: int, optimizer_state: int, zero: int, dp_rank: int, zero3_whole: int = 0) -> int:
    """The tensor bytes of one rank's checkpoint files, as DeepSpeed 0.19 writes them (engine.py
    _save_checkpoint, _save_zero_checkpoint): the model states (the model's storages: ZeRO-1/2 and
    BF16_Optimizer's flat buffers whole) by data-parallel rank 0 only, with the optimizer's state at
    ZeRO-0 (the moments, and FP16_UnfusedOptimizer's fp32 masters); from ZeRO-1 every rank's file of
    its masters and moments; at ZeRO-3 every rank's model file holds only the parameters kept whole
    (`zero3_whole`: those under stage3_param_persistence_threshold). RNG states and the vocabulary
    are a few KiB more."""
    if zero == 3:
        return zero3_whole + optimizer_state
    model = parameters if dp_rank == 0 else 0
    return model + (optimizer_state if zero > 0 or dp_rank == 0 else 0)


def _moments(numel: int, optimizer: str) -> int:
    return 8 * numel + (4 if optimizer == "adamw" else 0)


def _flat_partition(group: tuple[int, ...], dp: int, rank: int) -> tuple[int, int, list[int]]:
    """(padded flat size, partition size, whole sizes of the params overlapping `rank`'s partition)."""
    padded = _ceil(sum(group), 2 * dp)
    size = padded // dp
    start, end, offset, overlapping = rank * size, (rank + 1) * size, 0, []
    for numel in group:
        if start < offset + numel and offset < end:
            overlapping.append(numel)
        offset += numel
    return padded, size, overlapping


def _sub_groups(group: tuple[int, ...], dp: int, sub_group_size: int) -> list[list[int]]:
    parts = [-(-n // dp) for n in group]
    subs, current, total = [], [], 0
    for i, part in enumerate(parts):
        current.append(part)
        total += part
        if total >= sub_group_size or i == len(parts) - 1:
            subs.append(current)
            current, total = [], 0
    return subs


def model_states(groups: tuple[tuple[int, ...], ...], dp: int, dp_rank: int, precision: str, zero: int,
                 grad_accum: str, optimizer: str, pipelined: bool, zero_config: dict | None = None) -> ModelStates:
    """One rank's model states; `groups`: the element counts of its optimizer param groups' parameters."""
    z = dict(ZERO_DEFAULTS, **(zero_config or {}))
    b = ITEM[precision]
    accumulation = ITEM[grad_accum if precision == "bf16" else precision]
    kind = wrapper_of(precision, zero, grad_accum, pipelined)
    groups = tuple(g for g in groups if g)  # DeepSpeed drops empty groups
    numels = [n for g in groups for n in g]
    total = sum(numels)
    bucket = z["reduce_bucket_size"]

    if kind == "none":
        moments = sum(_moments(n, optimizer) for n in numels)
        return ModelStates(kind, 4 * total, 4 * total, moments, 0, 0, checkpoint_bytes(4 * total, moments, 0, dp_rank))
    if kind == "FP16_UnfusedOptimizer":
        moments = sum(_moments(n, optimizer) for n in numels)
        return ModelStates(kind, b * total, (b + 4) * total, moments + 4 * total, 0, 0,
                           checkpoint_bytes(b * total, moments + 4 * total, zero, dp_rank))
    if kind == "BF16_Optimizer":
        params = grads = state = flat_grads = 0
        for group in groups:
            padded, size, _ = _flat_partition(group, dp, dp_rank)
            params += 2 * padded
            flat_grads += accumulation * padded
            # the master's .grad is a view of the flat gradient buffer (fp32), or a copy of its partition
            grads += (accumulation * padded if accumulation == 4 else 4 * size) + 2 * sum(group)
            state += _moments(size, optimizer) + 4 * size
        return ModelStates(kind, params, grads, state, 0 if accumulation == 4 else flat_grads, 0,
                           checkpoint_bytes(params, state, zero, dp_rank))
    if kind == "DeepSpeedZeroOptimizer":
        compact = precision == "bf16" and accumulation == 4  # bf16 ZeRO-2 with fp32 accumulation
        layouts = [_flat_partition(g, dp, dp_rank) for g in groups]
        params = sum(b * padded for padded, _, _ in layouts)
        state = sum(_moments(size, optimizer) + 4 * size for _, size, _ in layouts)
        in_partition = b * sum(sum(overlap) for _, _, overlap in layouts)  # grads_in_partition
        grads = 0
        for group, (padded, size, overlap) in zip(groups, layouts):
            if compact:
                grads += 4 * size
                continue
            covered = max(0, min(sum(group) - dp_rank * size, size))
            pieces = len(overlap) + (1 if not overlap or covered < size else 0)
            one_view = pieces == 1 and b == 4 and overlap  # flatten() of one fp32 piece: a view of the buffer
            grads += in_partition if one_view else 4 * size
        step = b * bucket * (2 if pipelined and zero == 1 else 1)  # the reduce bucket(s), whatever the model's size
        step += b * total if zero == 1 else (4 * sum(s for _, s, _ in layouts) if compact else in_partition)
        return ModelStates(kind, params, grads, state, 0, step, checkpoint_bytes(params, state, zero, dp_rank))
    # ZeRO-3
    subs = [sub for group in groups for sub in _sub_groups(group, dp, z["sub_group_size"])]
    sizes = [sum(sub) for sub in subs]
    partitions = sum(sizes)
    grads = sum(accumulation * partitions if len(sub) == 1 and accumulation == 4 else 4 * size
                for sub, size in zip(subs, sizes))
    state = sum(_moments(size, optimizer) + 4 * size for size in sizes)
    communication = accumulation  # the trainer communicates in the accumulation dtype
    persistent, kept = 0, 0
    for n in numels:
        if n <= z["stage3_param_persistence_threshold"] and kept + n <= z["stage3_model_persistence_threshold"]:
            kept += n
            persistent += b * _ceil(n, dp) if dp > 1 else 0
    buffers = accumulation * partitions + communication * bucket + persistent
    return ModelStates(kind, b * partitions, grads, state, buffers, 0,
                       checkpoint_bytes(b * partitions, state, zero, dp_rank, zero3_whole=b * kept))
