"""BERT for pretraining, described once as a sequence of stages.

`stage_specs` lists the layers. With pipeline_parallel == 1 they run in order inside one
`SequentialBert` module under a plain DeepSpeedEngine (ZeRO 0-3); with pipeline_parallel > 1
DeepSpeed's PipelineModule splits the same list over stages (ZeRO 0-1), and the word embedding,
a TiedLayerSpec, lives on the first and the last stage with its gradient summed between them.
"""
from __future__ import annotations

import hashlib
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from ..distributed.device import all_reduce
from ..distributed.internals import full_shape, is_zero3_param
from .layers import (
    EmbeddingTail,
    MlmHead,
    MlmOutputBias,
    PretrainingHeads,
    TransformerLayer,
    WordEmbedding,
    decode_tokens,
    megatron_config,
)
from .context_split import ContextGroup
from .cross_entropy import vocab_parallel_cross_entropy
from ..config.choices import compile_enabled
from .fused import check_can_compile
from .modernbert import EmbeddingNorm, ModernLayer, ModernMlmHead, modern_stage_specs
from .micro_batch import MicroBatchCache
from .names import EMBEDDING_NAMES, TIED_EMBEDDING_KEY, logical_parameters, spec_modules
from .rng import RngTracker
from .unpadding import repad

def stage_specs(model_cfg, padded_vocab_size: int, params_dtype: torch.dtype, rng: RngTracker, tp_group,
                binary_head: bool = True, context: ContextGroup | None = None) -> list:
    """The model as an ordered list of layer specs (see layers.py for what flows between them);
    `tp_group` is the tensor-parallel group its sharded layers split over and reduce in. Without
    `binary_head` the heads are MLM only (no pooler, no next-sentence classifier). A ModernBERT
    model_cfg gives modernbert.py's stages instead (same positions, MLM only), its rows split over
    `context` (context parallelism) where given."""
    mp_config = megatron_config(params_dtype, tp_group)
    if model_cfg.modern:
        specs = modern_stage_specs(model_cfg, padded_vocab_size, mp_config, rng, tp_group, context)
        assert [(spec.typename, spec.module_args[0] if spec.typename.__name__ == "ModernLayer" else None)
                for spec in specs] == spec_modules(model_cfg), "spec_modules is out of date"
        return specs
    hidden = model_cfg.hidden_size
    word = partial(TiedLayerSpec, TIED_EMBEDDING_KEY, WordEmbedding, padded_vocab_size, hidden, mp_config, tp_group,
                   tied_weight_attr=["weight"])
    cache = MicroBatchCache()  # one per model (per stage in a pipeline): its layers share the micro-batch's masks
    specs = [
        # No forward_fn on the first use: DeepSpeed saves a pipeline layer only if it is the module
        # itself, and re-broadcasts the tied weight from this first owner after loading.
        word(),
        LayerSpec(EmbeddingTail, hidden, model_cfg.max_position_embeddings, model_cfg.type_vocab_size,
                  model_cfg.layernorm_epsilon, model_cfg.hidden_dropout, params_dtype, context),
        *[LayerSpec(TransformerLayer, i, model_cfg, mp_config, rng, tp_group, context, cache)
          for i in range(model_cfg.num_layers)],
        LayerSpec(PretrainingHeads if binary_head else MlmHead, model_cfg, params_dtype, context),
        word(forward_fn=decode_tokens),
        LayerSpec(MlmOutputBias, model_cfg.vocab_size, padded_vocab_size, mp_config, tp_group),
    ]
    described = [(spec.typename, spec.module_args[0] if spec.typename is TransformerLayer else None)
                 for spec in specs]
    assert described == spec_modules(model_cfg, binary_head), "spec_modules is out of date"
    return specs


class SequentialBert(nn.Module):
    """Runs the stage specs in order in one process (pipeline_parallel == 1)."""

    def __init__(self, specs: list):
        super().__init__()
        self.tied = nn.ModuleDict()
        self.layers = nn.ModuleList()
        self._steps = []
        for spec in specs:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    self.tied[spec.key] = spec.build()
                module = self.tied[spec.key]
                self._steps.append(partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                self.layers.append(spec.build())
                self._steps.append(self.layers[-1])
        for module in self.tied.values():
            module.sparse_lookup_grad = True  # both uses of the tied weight are in this one graph

    def forward(self, inputs):
        for step in self._steps:
            inputs = step(inputs)
        return inputs

    def encode(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """What Hugging Face's BertModel returns: the last layer's hidden states and the pooled
        [CLS] vector (tanh of the pooler); for packed inputs, of each sample's [CLS] at its flat
        cls_positions ([samples, hidden]). ModernBERT: ModernBertModel's last_hidden_state (after
        final_norm) and `pooled`'s vector."""
        if self._modern_head() is not None:
            hidden = self.hidden_states(inputs)[-1]
            return hidden, self._modern_pool(hidden, inputs[2])
        hidden = self.hidden_states(inputs)[-1]
        cls_hidden = hidden.reshape(-1, hidden.shape[-1])[inputs[5]] if len(inputs) == 6 else hidden[:, 0]
        return hidden, torch.tanh(self._heads().pooler(cls_hidden))

    def pooled(self, inputs) -> torch.Tensor:
        """`encode`'s pooled [CLS] vector alone, the last layer computed for [CLS] only
        (TransformerLayer.first_token): what a sequence-level head needs, for less (a sixth fewer
        matrix-product FLOPs in a 6-layer encoder). ModernBERT: the final-normed [CLS] vector
        (model.classifier_pooling cls) or the mean over the real tokens (mean), before the task
        head's transform, as transformers' ModernBertFor{SequenceClassification,MultipleChoice}."""
        if self._modern_head() is not None:
            return self.encode(inputs)[1]
        last = max(i for i, step in enumerate(self._steps) if isinstance(step, TransformerLayer))
        for step in self._steps[:last]:
            inputs = _on_rows(step, inputs)
        cls_hidden = self._steps[last].first_token(inputs)[:, 0]
        return torch.tanh(self._heads().pooler(cls_hidden))

    def hidden_states(self, inputs) -> list[torch.Tensor]:
        """The embeddings' output and every transformer layer's ([batch, seq, hidden] each), as
        Hugging Face's output_hidden_states gives them (ModernBERT: the last after final_norm,
        as its last_hidden_state; it computes real tokens only, so its states are zero at the
        padding, as transformers' unpadded FlashAttention path gives them)."""
        states, real = [], inputs[2]  # the padding mask, or packed rows' sample ids
        for step in self._steps:
            if isinstance(step, ModernMlmHead):
                states[-1] = step.final_norm(states[-1])
                return [repad(state, real) for state in states]
            if isinstance(step, PretrainingHeads):
                return states
            inputs = _on_rows(step, inputs)
            if isinstance(step, (EmbeddingTail, TransformerLayer, EmbeddingNorm, ModernLayer)):
                states.append(inputs[0])
        raise RuntimeError("the model has no heads stage")

    def _heads(self) -> PretrainingHeads:
        return next(step for step in self._steps if isinstance(step, PretrainingHeads))

    def _modern_head(self) -> ModernMlmHead | None:
        return next((step for step in self._steps if isinstance(step, ModernMlmHead)), None)

    def _modern_pool(self, hidden: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        if self._modern_head().classifier_pooling == "mean":
            weights = padding_mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * weights).sum(1) / weights.sum(1)
        return hidden[:, 0]


def _on_rows(step, inputs):
    """One stage step keeping BERT's rows ([rows, seq, hidden]): per-row hidden states are what the
    fine-tuning and encoding paths read, where the pretraining forward computes real tokens only."""
    return step.rows(inputs) if isinstance(step, EmbeddingTail) else step(inputs)


def build_model(model_cfg, padded_vocab_size, params_dtype, rng, tp_group, pipeline_topology=None,
                loss_fn=None, binary_head: bool = True, shapes_vary: bool = False,
                context: ContextGroup | None = None) -> nn.Module:
    """`shapes_vary` (Config.shapes_vary: packed batches, whose row count follows their samples'
    lengths, or a model that computes real tokens only): the pipeline engine exchanges the
    activations' shapes every micro-batch (DeepSpeed's dynamic_shape) instead of once."""
    specs = stage_specs(model_cfg, padded_vocab_size, params_dtype, rng, tp_group, binary_head, context)
    if pipeline_topology is None or pipeline_topology.get_dim("pipe") == 1:
        return SequentialBert(specs)
    return PipelineModule(
        layers=specs,
        topology=pipeline_topology,
        loss_fn=loss_fn,
        partition_method="type:ModernLayer" if model_cfg.modern else "type:TransformerLayer",
        activation_checkpoint_interval=0,  # TransformerLayer checkpoints itself, with our RNG streams
        dynamic_shape=shapes_vary,
    )


def name_seed(seed: int, name: str) -> int:
    """A generator seed derived from the run's seed and a tensor's name: every rank and layout
    draws the same numbers for the same name without touching a global generator."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def full_initial_value(hf_name: str, kind: str, shape, model_cfg, seed: int) -> torch.Tensor:
    """The whole logical tensor, as Hugging Face initialises it, from a per-name seed: BERT's
    normal(0, init_std) weights; ModernBERT's normal truncated at 2 standard deviations, with the
    output projections' standard deviation init_std / sqrt(2 x num_layers)
    (ModernBertPreTrainedModel._init_weights).

    Drawn on the CPU, always (device="cpu" is explicit: inside deepspeed.zero.Init a tensor made
    without a device lands on the accelerator, where the CPU generator cannot draw), so that every
    device and layout starts from the same numbers."""
    cpu = torch.device("cpu")
    if kind == "layernorm":
        return torch.ones(shape, device=cpu) if hf_name.endswith("weight") else torch.zeros(shape, device=cpu)
    if kind == "bias":
        return torch.zeros(shape, device=cpu)
    generator = torch.Generator(device=cpu).manual_seed(name_seed(seed, hf_name))
    std = model_cfg.init_std
    if model_cfg.modern:
        if hf_name.endswith(("attn.Wo.weight", "mlp.Wo.weight", "head.dense.weight")):
            std = std / (2.0 * model_cfg.num_layers) ** 0.5
        value = torch.empty(shape, device=cpu)
        torch.nn.init.trunc_normal_(value, 0.0, std, -2.0 * std, 2.0 * std, generator=generator)
    else:
        value = torch.empty(shape, device=cpu).normal_(0.0, std, generator=generator)
    if hf_name in EMBEDDING_NAMES:
        value[model_cfg.vocab_size:] = 0.0  # vocabulary padding rows are never looked up or predicted
    return value


def local_shard(full: torch.Tensor, partition_dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    if partition_dim is None:
        return full
    size = full.shape[partition_dim] // tp_size
    return full.narrow(partition_dim, tp_rank * size, size)


def init_weights(model: nn.Module, model_cfg, seed: int, tp_rank: int, tp_size: int) -> None:
    """Identical initial weights in every layout: full tensor from the name's seed, then our shard."""
    for lp in logical_parameters(model):
        shape = list(full_shape(lp.param))
        if lp.tp_partition_dim is not None:
            shape[lp.tp_partition_dim] *= tp_size
        shard = local_shard(full_initial_value(lp.hf_name, lp.kind, shape, model_cfg, seed),
                            lp.tp_partition_dim, tp_rank, tp_size)
        assign_local(lp.param, shard)


def assign_local(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy a TP-local value into a parameter, also when ZeRO-3 holds only a partition of it."""
    if is_zero3_param(param):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value)
    else:
        with torch.no_grad():
            param.copy_(value)


class PretrainingLoss:
    """MLM (at masked positions, vocabulary-parallel) + NSP cross entropy, as BertForPreTraining
    (MLM only, as BertForMaskedLM, when the model has no binary head: its nsp_logits are None).

    Called once per micro-batch (also as the pipeline's loss_fn on the last stage); keeps the
    detached metric sums of the micro-batches since the last `drain`.

    What a step minimises: the MLM loss is one mean over every masked token of the global batch
    (all micro-batches, all data-parallel ranks), as BertForPreTraining computes it over one
    batch, not Megatron's mean of per-micro-batch means. So the step does not depend on how the
    global batch is cut into micro-batches, although micro-batches hold different numbers of
    masked tokens. `scale_to_global_batch` sets that up before a step's micro-batches; the NSP
    loss is likewise one mean over the global batch's samples (packed micro-batches hold
    unequal numbers of them; without packing it is the mean of equal micro-batches' means).
    """

    METRICS = ("lm_loss_sum", "mlm_count", "mlm_correct", "nsp_loss_sum", "nsp_count", "nsp_correct")

    def __init__(self, tp_group, tp_rank: int, compile: str = "false"):
        self.tp_group = tp_group
        self.tp_rank = tp_rank
        self.compile = compile  # model.compile: the cross entropy's sweeps as compiled kernels
        self._sums = None  # stays on the model's device: no host sync per micro-batch
        self._lm_scale = None  # micro-batches per global batch / its masked tokens, for one step
        self._nsp_scale = None  # micro-batches per global batch / its samples, for one step

    def scale_to_global_batch(self, masked_tokens: torch.Tensor, micro_batches: int, samples: int) -> None:
        """Until the next `drain`: return each micro-batch's MLM loss as its token sum times
        micro_batches / masked_tokens (and its NSP loss as its sum times micro_batches /
        samples). DeepSpeed averages the micro-batches' gradients (1 / accumulation steps, 1 /
        data-parallel size), so the step's gradient is that of the sum over the global batch's
        `masked_tokens` tokens divided by their number."""
        self._lm_scale = micro_batches / masked_tokens.float().clamp(min=1.0)
        self._nsp_scale = micro_batches / samples

    @staticmethod
    def masked_tokens(labels) -> torch.Tensor:
        """Masked positions of one micro-batch's labels (a device scalar)."""
        return labels[1].float().sum()

    def __call__(self, outputs, labels):
        mlm_logits, nsp_logits = outputs
        masked_labels, masked_weights, nsp_labels = labels
        weights = masked_weights.float()
        with torch.no_grad():
            predicted = vocab_parallel_argmax(mlm_logits, self.tp_group, self.tp_rank)
            mlm_correct = ((predicted == masked_labels).float() * weights).sum()
        # the logits as the model output them (no fp32 copy; they stay unchanged: the pipeline
        # engine returns them from eval_batch)
        use_compiled = compile_enabled(self.compile, mlm_logits.device.type)
        if use_compiled:
            check_can_compile(mlm_logits.device.type)
        per_token = vocab_parallel_cross_entropy(mlm_logits, masked_labels, self.tp_group, use_compiled)
        count = weights.sum()
        lm_sum = (per_token * weights).sum()
        lm_loss = lm_sum * self._lm_scale if self._lm_scale is not None else lm_sum / count.clamp(min=1.0)
        if nsp_logits is None:  # no binary head: no NSP loss, zero NSP sums (and count)
            values = torch.stack([lm_sum.detach(), count.detach(), mlm_correct, *torch.zeros_like(count).expand(3)])
            self._sums = values.double() if self._sums is None else self._sums + values.double()
            return lm_loss
        nsp_sum = F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="sum")
        with torch.no_grad():
            nsp_correct = (nsp_logits.argmax(-1) == nsp_labels).float().sum()
        values = torch.stack([lm_sum.detach(), count.detach(), mlm_correct, nsp_sum.detach(),
                              torch.full_like(count, nsp_labels.numel()), nsp_correct]).double()
        self._sums = values if self._sums is None else self._sums + values
        return lm_loss + nsp_sum * (self._nsp_scale if self._nsp_scale is not None else 1.0 / nsp_labels.numel())

    def all_finite(self, device: torch.device) -> torch.Tensor:
        """Whether every loss since the last drain was finite (a bool on `device`; true on ranks
        that computed none)."""
        if self._sums is None:
            return torch.ones((), dtype=torch.bool, device=device)
        return torch.isfinite(self._sums).all().to(device)

    def current(self, device: torch.device) -> torch.Tensor:
        """The sums since the last drain, left in place (float64 on `device`; zeros before any)."""
        if self._sums is None:
            return torch.zeros(len(self.METRICS), dtype=torch.float64, device=device)
        return self._sums.to(device=device, dtype=torch.float64)

    def drain(self, device: torch.device) -> torch.Tensor:
        """Sums since the last drain (zeros on ranks that computed no loss), on `device`; ends
        the step's global-batch scaling."""
        sums = torch.zeros(len(self.METRICS), dtype=torch.float64, device=device) if self._sums is None \
            else self._sums.to(device)
        self._sums = None
        self._lm_scale = None
        self._nsp_scale = None
        return sums

    @staticmethod
    def averages(sums: list[float]) -> dict:
        """The losses and accuracies a set of metric sums stands for: per masked token (MLM) and
        per sequence (NSP), over everything summed."""
        s = dict(zip(PretrainingLoss.METRICS, sums))
        lm = s["lm_loss_sum"] / max(s["mlm_count"], 1.0)
        nsp = s["nsp_loss_sum"] / max(s["nsp_count"], 1.0)
        return {
            "loss": lm + nsp,
            "lm_loss": lm,
            "nsp_loss": nsp,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1.0),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_count"], 1.0),
        }


def vocab_parallel_argmax(logits: torch.Tensor, tp_group, tp_rank: int) -> torch.Tensor:
    """Index of the largest logit over the whole vocabulary when each rank holds a slice."""
    local_max, local_index = logits.max(dim=-1)
    global_index = local_index + tp_rank * logits.shape[-1]
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return global_index
    best = all_reduce(local_max.clone(), tp_group, op="max")
    candidate = torch.where(local_max == best, global_index, torch.full_like(global_index, 2**62))
    return all_reduce(candidate, tp_group, op="min")
