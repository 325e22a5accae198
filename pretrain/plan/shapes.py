"""The parameters each pipeline stage of a layout holds, read off the model definition itself.

`stage_specs` (pretrain/model/bert.py) is built on the meta device with a stand-in
tensor-parallel group of the layout's size: every layer allocates its real, TP-local shapes and
nothing else, in milliseconds, whatever the model's size. The stages are cut exactly as
DeepSpeed's PipelineModule cuts them (its own partition_balanced over the transformer layers,
`partition_method="type:TransformerLayer"`), the tied word embedding is on the first and the
last stage, and the parameters are grouped by the trainer's own optimizer_param_groups. A
change to the model therefore changes the plan; there is no second table of sizes to keep.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.pipe import TiedLayerSpec
from deepspeed.runtime.utils import partition_balanced
from torch import nn

from ..model.bert import stage_specs
from ..model.layers import EmbeddingTail, PretrainingHeads, TransformerLayer
from ..model.modernbert import EmbeddingNorm, ModernLayer, ModernMlmHead
from ..model.rng import RngTracker
from ..optim.groups import optimizer_param_groups


ENCODER_LAYERS = (TransformerLayer, ModernLayer)  # what PipelineModule's "type:" partitioning counts


class _ShapeGroup:
    """What the layers ask of their tensor-parallel group while they are built: its size and
    this rank's place in it (all TP ranks hold equal shapes: heads, FFN and vocabulary split evenly)."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@contextlib.contextmanager
def _process_group_for_shapes():
    """megatron-core reads a group's size only once torch.distributed is initialised (its
    get_pg_size is 1 before): outside a run, a one-process group on an in-memory store (no
    network, no files) for the time the layers are built."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class StageParams:
    """One pipeline stage's parameters on one tensor-parallel rank."""

    stage: int
    groups: tuple[tuple[int, ...], ...]  # element counts of each optimizer param group's parameters
    transformer_layers: int
    first: bool  # holds the embeddings
    last: bool  # holds the heads (and the tied decoder)

    @property
    def numel(self) -> int:
        return sum(sum(group) for group in self.groups)

    @property
    def tensors(self) -> int:
        return sum(len(group) for group in self.groups)


def stage_boundaries(num_specs: int, transformer_indices: list[int], stages: int) -> list[int]:
    """PipelineModule's cut of the spec list ("type:TransformerLayer": one unit per layer)."""
    if stages == 1:
        return [0, num_specs]
    weights = [0] * num_specs
    for index in transformer_indices:
        weights[index] = 1
    return partition_balanced(weights=weights, num_parts=stages)


def stage_parameters(cfg, tensor_parallel: int, pipeline_parallel: int) -> list[StageParams]:
    """Every stage's parameters (one TP rank's shard) for `cfg`'s model at this layout."""
    with _process_group_for_shapes(), torch.device("meta"):
        specs = stage_specs(cfg.model, cfg.model.padded_vocab_size(tensor_parallel), torch.float32,
                            RngTracker(torch.device("cpu")), _ShapeGroup(tensor_parallel), cfg.binary_head)
        transformer = [i for i, spec in enumerate(specs) if spec.typename in ENCODER_LAYERS]
        bounds = stage_boundaries(len(specs), transformer, pipeline_parallel)
        stages = []
        for stage in range(pipeline_parallel):
            holder, tied = nn.ModuleList(), {}
            for spec in specs[bounds[stage]:bounds[stage + 1]]:
                if isinstance(spec, TiedLayerSpec):  # built once per stage that uses it, as PipelineModule does
                    if spec.key not in tied:
                        tied[spec.key] = spec.build()
                        holder.append(tied[spec.key])
                else:
                    holder.append(spec.build())
            groups = tuple(tuple(p.numel() for p in group["params"])
                           for group in optimizer_param_groups(holder, cfg.optimizer))
            kinds = {type(m) for m in holder}
            stages.append(StageParams(stage, groups, sum(isinstance(m, ENCODER_LAYERS) for m in holder),
                                      bool(kinds & {EmbeddingTail, EmbeddingNorm}),
                                      any(issubclass(k, (PretrainingHeads, ModernMlmHead)) for k in kinds)))
    return stages
