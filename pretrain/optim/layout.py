"""Where each logical parameter lives inside the tensors an optimizer steps.

LAMB's trust ratio needs the norms of whole logical parameters, but what the optimizer
actually holds depends on the parallel layout:

* plain / ZeRO-0: one tensor per parameter (a TP shard when the layer is tensor-parallel);
* ZeRO-1/2 and DeepSpeed's BF16 optimizer: one flat fp32 *partition* per param group per
  DP rank, holding fragments of the group's parameters (a parameter may straddle two ranks
  or be absent from this one), plus alignment padding;
* ZeRO-3: one flat fp32 tensor per sub-group per DP rank, the concatenation of this rank's
  partition of every parameter in the sub-group, each padded to a multiple of the DP size.

A `NormLayout` describes this with segments ``(logical_index, start, numel)`` into each
stepped tensor (flattened), a TP-sharded flag per logical parameter and the groups over
which partial sums of squares must be added.  The builders below read DeepSpeed's own
bookkeeping (see deepspeed/runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py and
utils/tensor_fragment.py) instead of re-deriving its partitioning arithmetic.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..distributed.internals import (FlatPartitions, WholeCopies, Zero3Groups, client_optimizer, hp_fragment,
                                     is_tp_sharded, optimizer_wrapper, zero3_partition_info)


class Segment(NamedTuple):
    """`numel` elements of logical parameter `logical_index`, starting at flat offset `start`
    of the tensor the optimizer steps and at flat offset `param_offset` of the (TP-local)
    parameter itself."""
    logical_index: int
    start: int
    numel: int
    param_offset: int = 0


class NormLayout:
    """Segments of every tensor the optimizer will step, plus the reduction groups.

    tensors_segments: (tensor, [Segment, ...]) for each tensor the optimizer steps.
    tp_sharded: one flag per logical parameter; True when the logical parameter is itself
        one TP shard of a larger one (megatron's `tensor_model_parallel`), so its sums must
        be added over `tp_group`.  Replicated parameters are NOT summed over TP.
    dp_group: group whose ranks hold disjoint pieces of each parameter (ZeRO), or None when
        every DP rank holds whole parameters.
    tp_group: tensor-parallel group, or None when TP=1.
    """

    def __init__(self, tensors_segments: Iterable[tuple[torch.Tensor, Sequence[Segment]]],
                 tp_sharded: Sequence[bool], dp_group=None, tp_group=None, params: Sequence[torch.Tensor] = ()):
        self.num_logical = len(tp_sharded)
        # The model parameter of each logical index, when built from an engine (for checkpoint
        # loading, which copies a parameter's values into the tensors the optimizer steps).
        self.params = list(params)
        self.tp_sharded = [bool(s) for s in tp_sharded]
        self.dp_group = dp_group
        self.tp_group = tp_group
        # Where the norm sums are reduced: the model's device. The stepped tensors may live
        # elsewhere (CPU under ZeRO optimizer offload), and an NCCL group cannot reduce there.
        self.comm_device: torch.device | None = None
        # Keyed by id(); the tensor itself is kept alongside so its id cannot be reused.
        self._by_id: dict[int, tuple[torch.Tensor, list[Segment]]] = {}
        for tensor, segments in tensors_segments:
            segments = sorted(Segment(*s) for s in segments)
            self._check(tensor, segments)
            self._by_id[id(tensor)] = (tensor, segments)

    def _check(self, tensor: torch.Tensor, segments: list[Segment]) -> None:
        end = 0
        for seg in sorted(segments, key=lambda s: s.start):
            if not 0 <= seg.logical_index < self.num_logical:
                raise ValueError(f"NormLayout: logical index {seg.logical_index} out of range "
                                 f"[0, {self.num_logical})")
            if seg.numel <= 0 or seg.start < end or seg.start + seg.numel > tensor.numel():
                raise ValueError(f"NormLayout: segment {seg} overlaps another or lies outside a "
                                 f"tensor of {tensor.numel()} elements")
            end = seg.start + seg.numel

    def segments_for(self, tensor: torch.Tensor) -> list[Segment]:
        entry = self._by_id.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            raise KeyError(f"NormLayout: the optimizer holds a tensor of shape {tuple(tensor.shape)} "
                           "that the layout does not describe; build the layout after "
                           "deepspeed.initialize() from the engine that owns the optimizer")
        return entry[1]

    def entries(self) -> list[tuple[torch.Tensor, list[Segment]]]:
        """(tensor, segments) for every described tensor."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)


def _group_or_none(group):
    """Drop groups of one rank: summing over them is a no-op, and a None group lets the
    optimizer skip the collective altogether."""
    if group is None or dist.get_world_size(group=group) == 1:
        return None
    return group


def layout_for_params(param_groups_params: Sequence[Sequence[torch.Tensor]], tp_group=None) -> NormLayout:
    """Layout when the optimizer steps the parameters themselves (plain runs, ZeRO-0, pipeline
    engines with ZeRO-0): every tensor is one whole logical parameter, or one TP shard."""
    entries, sharded, owners = [], [], []
    for params in param_groups_params:
        for p in params:
            entries.append((p, [Segment(len(sharded), 0, p.numel())] if p.numel() else []))
            sharded.append(is_tp_sharded(p))
            owners.append(p)
    return NormLayout(entries, sharded, dp_group=None, tp_group=_group_or_none(tp_group), params=owners)


def _same_ranks(a, b) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _partition_group(groups: Sequence, dp_group, kind: str):
    """The DP group DeepSpeed partitioned over (one per param group; all must agree, which
    excludes MoE expert groups), checked against the caller's own DP group."""
    if not groups:
        raise ValueError(f"layout_for_deepspeed: {kind} has no parameter groups")
    first = groups[0]
    if any(not _same_ranks(g, first) for g in groups):
        raise NotImplementedError(f"layout_for_deepspeed: {kind} partitions param groups over "
                                  "different process groups (MoE?); LAMB layout not supported")
    if dp_group is not None and not _same_ranks(dp_group, first):
        raise ValueError("layout_for_deepspeed: the given dp_group has ranks "
                         f"{dist.get_process_group_ranks(dp_group)} but DeepSpeed partitions over "
                         f"{dist.get_process_group_ranks(first)}; pass the engine's DP group")
    return _group_or_none(first)


def _hp_mapped_layout(lp_groups, hp_partitions, partition_groups, dp_group, tp_group, kind: str) -> NormLayout:
    """ZeRO-1/2 and BF16_Optimizer: one flat fp32 partition per group; DeepSpeed links each
    low-precision (model) parameter that overlaps this rank's partition to its fragment via
    `_hp_mapping` (None when the parameter lies entirely on other ranks).  The fragment's
    hp address is (start, numel) inside the local flat partition; it already accounts for
    round-robin reordering and parameter alignment padding."""
    if len(lp_groups) != len(hp_partitions):
        raise RuntimeError(f"layout_for_deepspeed: {kind} has {len(lp_groups)} model groups but "
                           f"{len(hp_partitions)} fp32 partitions")
    entries, sharded, owners = [], [], []
    for lp_params, flat in zip(lp_groups, hp_partitions):
        segments = []
        for p in lp_params:
            index = len(sharded)  # same enumeration on every rank: all ranks hold all lp params
            sharded.append(is_tp_sharded(p))
            owners.append(p)
            fragment = hp_fragment(p)
            if fragment is not None and fragment[1] > 0:
                segments.append(Segment(index, *fragment))
        entries.append((flat, segments))
    group = _partition_group(partition_groups, dp_group, kind)
    return NormLayout(entries, sharded, dp_group=group, tp_group=_group_or_none(tp_group), params=owners)


def _stage3_layout(wrapper: Zero3Groups, dp_group, tp_group) -> NormLayout:
    """ZeRO-3: sub-group i's flat fp32 tensor is the concatenation of this rank's partition
    (Zero3Partition.size elements each) of the params of model group i. Rank r's partition of a
    parameter covers flat elements [r*size, (r+1)*size) of it; elements past numel are padding."""
    entries, sharded, groups, owners = [], [], [], []
    for params, flat in zip(wrapper.model_groups, wrapper.fp32_flat):
        segments, offset = [], 0
        for p in params:
            index = len(sharded)
            sharded.append(is_tp_sharded(p))
            owners.append(p)
            part = zero3_partition_info(p)
            rank = dist.get_rank(group=part.process_group)
            real = max(0, min(part.size, part.numel - rank * part.size))
            if real > 0:
                segments.append(Segment(index, offset, real, rank * part.size))
            offset += part.size
            groups.append(part.process_group)
        if offset != flat.numel():
            raise RuntimeError(f"layout_for_deepspeed: ZeRO-3 sub-group holds {flat.numel()} elements, "
                               f"its params' partitions add up to {offset}")
        entries.append((flat, segments))
    group = _partition_group(groups, dp_group, "DeepSpeedZeroOptimizer_Stage3")
    return NormLayout(entries, sharded, dp_group=group, tp_group=_group_or_none(tp_group), params=owners)


def _unfused_layout(wrapper: WholeCopies, tp_group) -> NormLayout:
    """FP16_UnfusedOptimizer (fp16, or bf16 with ZeRO-0 off the pipeline): one whole fp32
    copy per parameter; TP flags live on the model's low-precision parameters."""
    entries, sharded, owners = [], [], []
    for lp_params, fp32_params in zip(wrapper.model_groups, wrapper.fp32_copies):
        for lp, hp in zip(lp_params, fp32_params):
            entries.append((hp, [Segment(len(sharded), 0, hp.numel())] if hp.numel() else []))
            sharded.append(is_tp_sharded(lp))
            owners.append(lp)
    return NormLayout(entries, sharded, dp_group=None, tp_group=_group_or_none(tp_group), params=owners)


def layout_for_deepspeed(engine, tp_group=None, dp_group=None, comm_device: torch.device | None = None) -> NormLayout:
    """Layout of the tensors that the client optimizer's param_groups hold at step time,
    read from `engine.optimizer` (DeepSpeed's wrapper, or the client optimizer for ZeRO-0
    fp32).  Call after deepspeed.initialize().  `dp_group`, when given, must be the group
    DeepSpeed partitions over (checked); `tp_group` is the tensor-parallel group or None;
    `comm_device` is the model's device, where LAMB reduces its norm sums."""
    layout = _engine_layout(engine, tp_group, dp_group)
    layout.comm_device = comm_device
    return layout


def _engine_layout(engine, tp_group, dp_group) -> NormLayout:
    try:
        wrapper = optimizer_wrapper(engine)
    except NotImplementedError as e:
        raise NotImplementedError(f"layout_for_deepspeed: {e}; LAMB's layout cannot be read") from None
    kind = type(engine.optimizer).__name__
    if isinstance(wrapper, FlatPartitions):
        return _hp_mapped_layout(wrapper.model_groups, wrapper.fp32_partitions, wrapper.process_groups,
                                 dp_group, tp_group, kind)
    if isinstance(wrapper, Zero3Groups):
        return _stage3_layout(wrapper, dp_group, tp_group)
    if isinstance(wrapper, WholeCopies):
        return _unfused_layout(wrapper, tp_group)
    # ZeRO-0 fp32: DeepSpeed steps the client optimizer on the model's own parameters.
    return layout_for_params([g["params"] for g in wrapper.param_groups], tp_group)


def stepped_tensors_by_group(engine) -> list[tuple[torch.Tensor, dict]]:
    """(tensor, param group) for every tensor the client optimizer steps, read through DeepSpeed's
    wrapper: what decides the weight decay and trust-ratio settings each parameter really gets.
    ZeRO-3 empties the groups between steps and steps one sub-group's flat tensor at a time with
    the group its sub-group belongs to; every other wrapper leaves its tensors in the groups."""
    client = client_optimizer(engine)
    wrapper = optimizer_wrapper(engine)
    if isinstance(wrapper, Zero3Groups):
        return [(flat, client.param_groups[wrapper.group_of_sub_group[index]])
                for index, flat in enumerate(wrapper.fp32_flat)]
    return [(tensor, group) for group in client.param_groups for tensor in group["params"]]
