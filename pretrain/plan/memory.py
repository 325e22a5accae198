"""A rank's predicted memory: model states (states.py, exact), activations (activations.py,
exact for the meter's accounting), DeepSpeed's buffers, and the workspace of a step.

    prediction = predict_rank_memory(cfg, world_size, pp_rank, device_type)

`total` is the prediction of the device's allocated peak (torch.cuda.max_memory_allocated over a
step): the states, the buffers held while micro-batches run, the activations at their peak
(the end of a forward with the most micro-batches in flight), and the workspace beside them then:
the tensors an op makes and frees within backward (one recomputed layer, the loss's logits and
their gradient, the activation gradients flowing back). The workspace and the pipeline's buffers
are estimates from the shapes (no allocator to read them from on the CPU); the rest is counted.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from ..config import Config
from ..config.deepspeed import read_user_deepspeed_config
from .activations import (context_kv_bytes, context_scores_bytes, context_share, heads_bytes, in_flight,
                          kernels_for, layer_bytes, stage_activation_bytes)
from .layouts import Layout, layout_of
from .shapes import StageParams, stage_parameters
from .states import ITEM, ZERO_DEFAULTS, model_states


@dataclass(frozen=True)
class MemoryPrediction:
    wrapper: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations_peak: int
    buffers: int  # DeepSpeed's buckets and gradient buffers, the pipeline's send/receive buffers
    workspace: int
    gradient_bytes_per_element: int  # what the data-parallel reduction moves per gradient element
    # host memory, not the device's: what a save's snapshot holds with checkpoint.async_save (the
    # rank's checkpoint files' tensors: states.checkpoint_bytes); 0 without it
    checkpoint_snapshot: int = 0

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.activations_peak + self.buffers
                + self.workspace)

    def breakdown(self) -> dict[str, int]:
        """The figures FirstStepMemory measures (same keys), the rest, and the device peak."""
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_state": self.optimizer_state,
                "activations_peak": self.activations_peak, "buffers": self.buffers, "workspace": self.workspace,
                "device_peak": self.total}


def zero_settings(cfg: Config) -> dict:
    """The zero_optimization sizes a user DeepSpeed JSON (train.deepspeed_config) sets; DeepSpeed's
    defaults otherwise (states.ZERO_DEFAULTS)."""
    if not cfg.train.deepspeed_config:
        return {}
    user = read_user_deepspeed_config(cfg.train.deepspeed_config)
    return {k: v for k, v in user.get("zero_optimization", {}).items() if k in ZERO_DEFAULTS}


def _pipeline_buffers(cfg, layout: Layout, stage: StageParams, micro_batches: int) -> int:
    """The pipeline engine's own tensors (DeepSpeed's pipe/engine.py): receive buffers of the
    activations and gradients exchanged, the first stage's input clones and the last stage's
    outputs kept per schedule slot."""
    if layout.pp == 1:
        return 0
    B = ITEM[layout.precision]
    b, s, h = layout.micro_batch, cfg.data.seq_length, cfg.model.hidden_size
    p = b * cfg.data.max_predictions()
    slots = max(2, min(layout.pp - stage.stage, micro_batches))
    inputs = 8 * (3 * b * s + p)  # ids, token types, padding mask, masked positions (int64)
    activation = B * b * s * h
    total = activation  # the receive (or gradient) buffer
    if stage.first:
        total += slots * inputs
    if stage.last:
        vocab = cfg.model.padded_vocab_size(layout.tp) // layout.tp
        total += slots * (B * p * vocab + activation) + inputs
    return total


def _workspace(cfg, layout: Layout, kernels) -> int:
    """What a step allocates and frees around the activation peak, on the rank's largest op set."""
    B = ITEM[layout.precision]
    m = cfg.model
    b, s, h = layout.micro_batch, cfg.data.seq_length, m.hidden_size
    p = b * cfg.data.max_predictions()
    vocab = m.padded_vocab_size(layout.tp) // layout.tp
    logits = 2 * B * p * vocab  # the MLM logits and their gradient
    flowing = 2 * B * b * s * (h + m.ffn_size // layout.tp)  # activation gradients of one layer
    recomputed = 0
    if m.recompute != "none":  # one layer's activations exist again during its backward
        plain = copy.copy(cfg)  # only the model section changes
        plain.model = copy.copy(cfg.model)
        plain.model.recompute = "none"
        recomputed = layer_bytes(plain, layout.tp, b, layout.precision, kernels)
    return logits + flowing + recomputed


def predict_memory(cfg: Config, layout: Layout, stage_index: int, stages: list[StageParams], device_type: str,
                   dp_rank: int = 0, zero_config: dict | None = None) -> MemoryPrediction:
    """`cfg` already at `layout` (Layout.apply); one rank of pipeline stage `stage_index`."""
    stage = stages[stage_index]
    t = cfg.train
    micro_batches = t.global_batch_size // (layout.micro_batch * layout.dp)
    # ZeRO partitions over DeepSpeed's data group, context x data; dp_rank is the rank's place in it
    states = model_states(stage.groups, layout.dp * layout.cp, dp_rank, layout.precision, layout.zero,
                          t.grad_accum_dtype, cfg.optimizer.name, layout.pp > 1, zero_config)
    kernels = kernels_for(device_type, cfg.model.attention_dropout, layout.precision, cfg.model.compile)
    shared = cfg if layout.cp == 1 else context_share(cfg, layout.cp)  # a CP rank's share of each row
    activations = stage_activation_bytes(shared, layout.tp, stage_index, layout.pp, stage.transformer_layers,
                                         stage.first, stage.last, layout.micro_batch, micro_batches,
                                         layout.precision, kernels,
                                         first_layer=sum(s.transformer_layers for s in stages[:stage_index]))
    if layout.cp > 1:  # an estimate: the CP ranks' shares, the keys and values global layers gather, and the
        # heads, which every CP rank runs on all of the row's masked tokens
        first = sum(s.transformer_layers for s in stages[:stage_index])
        extra = context_kv_bytes(cfg, layout.tp, layout.cp, layout.micro_batch, layout.precision,
                                 range(first, first + stage.transformer_layers))
        extra += context_scores_bytes(cfg, layout.tp, layout.cp, layout.micro_batch, layout.precision, kernels,
                                      stage.transformer_layers)
        if stage.last:
            extra += heads_bytes(cfg, layout.tp, layout.micro_batch, layout.precision, kernels) - heads_bytes(
                context_share(cfg, layout.cp), layout.tp, layout.micro_batch, layout.precision, kernels)
        activations += in_flight(stage_index, layout.pp, micro_batches) * extra
    buffers = states.persistent_buffers + states.step_buffers + _pipeline_buffers(cfg, layout, stage, micro_batches)
    reduced = ITEM[t.grad_accum_dtype] if layout.precision == "bf16" else ITEM[layout.precision]
    return MemoryPrediction(states.wrapper, states.parameters, states.gradients, states.optimizer_state, activations,
                            buffers, _workspace(cfg, layout, kernels), reduced,
                            _checkpoint_snapshot(cfg, layout, stage, states.checkpoint, dp_rank))


def _checkpoint_snapshot(cfg, layout: Layout, stage: StageParams, files: int, dp_rank: int) -> int:
    """checkpoint.async_save: the host memory of a save's snapshot, the rank's checkpoint files
    (states.checkpoint_bytes), less the last pipeline stage's copy of the tied word embedding, which
    no layer file of that stage holds (the first stage's does)."""
    if not cfg.checkpoint.async_save:
        return 0
    if layout.pp > 1 and stage.last and not stage.first and dp_rank == 0 and layout.zero < 3:
        files -= ITEM[layout.precision] * cfg.model.padded_vocab_size(layout.tp) // layout.tp * cfg.model.hidden_size
    return files


def predict_rank_memory(cfg: Config, world_size: int, pp_rank: int, device_type: str, dp_rank: int = 0
                        ) -> MemoryPrediction:
    """The prediction for one rank of a run of `cfg` on `world_size` ranks."""
    layout = layout_of(cfg, world_size)
    stages = stage_parameters(cfg, layout.tp, layout.pp)
    return predict_memory(cfg, layout, pp_rank, stages, device_type, dp_rank, zero_settings(cfg))

