"""The pretraining config: one dataclass per section, each with the rules about its own fields
(`problems()`), and `Config`, which adds the rules that tie sections together (`validate`).

    cfg = load_config(args.config, args.overrides)   # key and type checks (typed_yaml.py)
    cfg.validate(world_size)                          # every rule, all problems in one error
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .choices import (ARCHITECTURES, ATTENTION_KERNELS, CLASSIFIER_POOLING, COMPILE_CHOICES, DATA_KINDS, DECAYS, MASKING_MODES, OPTIMIZERS, PARAMETER_KINDS, PRECISIONS, RECOMPUTE,
                      SEGMENT_PAIRS, SPIKE_POLICIES)
from .precision import precision_problems
from .typed_yaml import ConfigError, check_tree, load_sections


@dataclass
class ModelConfig:
    architecture: str = "bert"  # "bert" (Devlin et al. 2018) | "modernbert" (Warner et al. 2024)
    vocab_size: int = 30522  # tokenizer vocabulary (before padding)
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size (see ffn_size)
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # token-type (segment) embeddings
    layernorm_epsilon: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02  # std of the normal weight initialisation
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this * tensor_parallel
    # recompute activations in backward instead of keeping them: "full" each transformer layer
    # (its input kept), "selective" the attention core only (scores, softmax, dropout: the
    # activations that grow with seq_length^2; Megatron's selective granularity), "none"
    recompute: str = "none"
    # ModernBERT only (transformers' ModernBertConfig keys): layer i attends globally when
    # i % global_attn_every_n_layers == 0, the others to keys within local_attention / 2 positions;
    # rotary bases per layer kind; biases of the LayerNorms, attention and MLP projections, and the
    # MLM head's dense layer (classifier_bias); how sequence heads pool (cls | mean). ffn_hidden_size is
    # the GeGLU width (intermediate_size), hidden_dropout the embedding and MLP dropout.
    global_attn_every_n_layers: int = 3
    local_attention: int = 128
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_bias: bool = False
    classifier_pooling: str = "cls"
    # ModernBERT's attention kernel on CUDA (without attention dropout): "varlen" torch's
    # variable-length flash attention (torch >= 2.10, bf16/fp16), "flex" FlexAttention with a block
    # mask, "auto" varlen where it can run, flex otherwise (docs/performance.md has the measurements)
    attention_kernel: str = "auto"
    # ModernBERT's element-wise work (rotary, residual + LayerNorm, GeGLU) and the MLM loss as
    # compiled fused kernels (torch.compile, dynamic shapes: one compilation per run): "auto" on
    # CUDA, "true" anywhere torch compiles (the CPU too, with a C++ compiler), "false" eager
    compile: str = "auto"

    @property
    def modern(self) -> bool:
        return self.architecture == "modernbert"

    def is_global_layer(self, index: int) -> bool:
        """ModernBERT: whether layer `index` attends to the whole sequence (else to its window)."""
        return index % self.global_attn_every_n_layers == 0

    @property
    def ffn_size(self) -> int:
        """The resolved feed-forward width."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """vocab_size rounded up so every tensor-parallel shard is a multiple of
        make_vocab_size_divisible_by (efficient GEMMs, equal shards)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings", "type_vocab_size", "make_vocab_size_divisible_by",
                     "layernorm_epsilon", "init_std"):
            _positive(p, f"model.{name}", getattr(self, name))
        if self.ffn_hidden_size is not None:
            _positive(p, "model.ffn_hidden_size", self.ffn_hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                p.append(f"model.{name} ({value}) must be in [0, 1)")
        _one_of(p, "model.recompute", self.recompute, RECOMPUTE)
        _one_of(p, "model.architecture", self.architecture, ARCHITECTURES)
        _one_of(p, "model.classifier_pooling", self.classifier_pooling, CLASSIFIER_POOLING)
        _one_of(p, "model.attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _one_of(p, "model.compile", self.compile, COMPILE_CHOICES)
        if self.modern:
            for name in ("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta"):
                _positive(p, f"model.{name}", getattr(self, name))
            if self.local_attention < 2 or self.local_attention % 2:
                p.append(f"model.local_attention ({self.local_attention}) must be an even number >= 2 "
                         "(keys within local_attention / 2 positions on either side)")
            if self.hidden_size > 0 and self.num_attention_heads > 0 and (self.hidden_size // self.num_attention_heads) % 2:
                p.append(f"model.hidden_size / model.num_attention_heads ({self.hidden_size // self.num_attention_heads}) "
                         "must be even: rotary embeddings turn pairs of head dimensions")
        if self.hidden_size > 0 and self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
            p.append(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                     f"model.num_attention_heads ({self.num_attention_heads})")
        return p


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0  # DeepSpeed ZeRO stage, 0..3
    # data parallel size is derived: world_size // (tensor_parallel * pipeline_parallel)

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.tensor_parallel < 1:
            p.append(f"parallel.tensor_parallel ({self.tensor_parallel}) must be >= 1")
        if self.pipeline_parallel < 1:
            p.append(f"parallel.pipeline_parallel ({self.pipeline_parallel}) must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"parallel.zero_stage ({self.zero_stage}) must be one of 0, 1, 2, 3")
        # DeepSpeed's pipeline engine does not support gradient/parameter partitioning.
        if self.zero_stage in (2, 3) and self.pipeline_parallel > 1:
            p.append(f"parallel.zero_stage {self.zero_stage} cannot be combined with pipeline "
                     f"parallelism (pipeline_parallel={self.pipeline_parallel}); use zero_stage 0 or 1")
        return p


@dataclass
class OptimizerConfig:
    name: str = "lamb"  # "lamb" | "adamw" | "stable_adamw"
    lr: float = 1e-3  # peak learning rate (reached at the end of warmup)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    # parameter kinds (PARAMETER_KINDS) excluded from weight decay
    no_weight_decay: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    # parameter kinds whose LAMB trust ratio is fixed to 1
    no_layer_adaptation: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    max_trust_ratio: float | None = None  # optional clamp of the LAMB trust ratio
    # global gradient-norm clipping; 0 disables; None: off with stable_adamw (its own update
    # clipping stands in for it, and torch-optimi advises against both), 1.0 otherwise (clip())
    grad_clip: float | None = None
    # stable_adamw only (torch-optimi's StableAdamW): decouple_lr decays weights by
    # (lr_t / max_lr) * weight_decay instead of lr_t * weight_decay; max_lr None = optimizer.lr;
    # kahan_sum: Kahan-compensated updates of bf16/fp16 tensors the optimizer steps
    decouple_lr: bool = False
    max_lr: float | None = None
    kahan_sum: bool = False

    STABLE_ADAMW_ONLY = {"decouple_lr": False, "max_lr": None, "kahan_sum": False}

    def clip(self) -> float:
        """The gradient-norm clipping threshold in effect (0 = off): grad_clip, or its default."""
        if self.grad_clip is not None:
            return self.grad_clip
        return 0.0 if self.name == "stable_adamw" else 1.0

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "optimizer.name", self.name, OPTIMIZERS)
        _positive(p, "optimizer.lr", self.lr)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                p.append(f"optimizer.{name} ({value}) must be in [0, 1)")
        _positive(p, "optimizer.eps", self.eps)
        _non_negative(p, "optimizer.weight_decay", self.weight_decay)
        if self.grad_clip is not None:
            _non_negative(p, "optimizer.grad_clip", self.grad_clip)
        if self.name != "stable_adamw":
            for key, default in self.STABLE_ADAMW_ONLY.items():
                if getattr(self, key) != default:
                    p.append(f"optimizer.{key} applies to optimizer.name=stable_adamw only, not {self.name}; "
                             "remove it")
        if self.max_lr is not None:
            _positive(p, "optimizer.max_lr", self.max_lr)
        if self.max_trust_ratio is not None:
            _positive(p, "optimizer.max_trust_ratio", self.max_trust_ratio)
        for name in ("no_weight_decay", "no_layer_adaptation"):
            for kind in getattr(self, name):
                if kind not in PARAMETER_KINDS:
                    p.append(f"optimizer.{name} entry {kind!r} is not a parameter kind; "
                             f"valid kinds: {', '.join(PARAMETER_KINDS)}")
        return p


@dataclass
class SchedulerConfig:
    warmup_steps: int = 0  # linear warmup over this many steps ...
    warmup_fraction: float | None = None  # ... or over this share of the decay horizon (not both)
    # "linear" | "poly" | "cosine" | "1-sqrt" | "inverse_sqrt" | "constant" (formulas: pretrain/optim/schedule.py)
    decay: str = "linear"
    decay_steps: int | None = None  # the step the decay reaches min_lr; None = train.train_steps
    # warmup-stable-decay: the rate holds at optimizer.lr from the end of warmup to this step, then
    # decays (None: the decay starts right after warmup)
    decay_start_steps: int | None = None
    power: float = 0.5  # exponent of "poly" decay
    min_lr: float = 0.0  # floor of the decayed learning rate
    # the same lengths counted in tokens (samples x data.seq_length, from the start of the run or of
    # its phase: checkpoint.new_phase); any of them set makes the whole schedule token-counted
    warmup_tokens: int | None = None
    decay_start_tokens: int | None = None
    decay_tokens: int | None = None  # None: the tokens of train.train_steps
    # warmup from scheduler.min_lr at the first step (transformers' and Composer's convention)
    # instead of reaching optimizer.lr at the last warmup step without ever stepping at 0
    warmup_from_min: bool = False

    @property
    def in_tokens(self) -> bool:
        return any(v is not None for v in (self.warmup_tokens, self.decay_start_tokens, self.decay_tokens))

    def horizon(self, train_steps: int) -> int:
        """The resolved decay horizon in steps (Megatron's --lr-decay-iters)."""
        return self.decay_steps if self.decay_steps is not None else train_steps

    def warmup(self, train_steps: int) -> int:
        """The resolved warmup length in steps; a fraction is of the decay horizon, as Megatron's
        --lr-warmup-fraction."""
        if self.warmup_fraction is not None:
            return int(self.warmup_fraction * self.horizon(train_steps))
        return self.warmup_steps

    def lengths(self, train_steps: int, position_at) -> dict:
        """lr_at's warmup_steps, decay_steps and decay_start in the schedule's unit; position_at(n):
        the schedule's position after n steps (n itself, or the tokens of the first n steps)."""
        if self.in_tokens:
            horizon = self.decay_tokens if self.decay_tokens is not None else position_at(train_steps)
            return dict(warmup_steps=self.warmup_tokens or 0, decay_steps=horizon, decay_start=self.decay_start_tokens)
        return dict(warmup_steps=self.warmup(train_steps), decay_steps=self.horizon(train_steps),
                    decay_start=self.decay_start_steps)

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "scheduler.decay", self.decay, DECAYS)
        _non_negative(p, "scheduler.warmup_steps", self.warmup_steps)
        if self.warmup_fraction is not None:
            if not 0.0 <= self.warmup_fraction <= 1.0:
                p.append(f"scheduler.warmup_fraction ({self.warmup_fraction}) must be in [0, 1]")
            if self.warmup_steps:
                p.append(f"scheduler.warmup_steps ({self.warmup_steps}) and scheduler.warmup_fraction "
                         f"({self.warmup_fraction}) both set: give one")
        for name in ("decay_steps", "decay_start_steps", "decay_tokens", "decay_start_tokens"):
            if getattr(self, name) is not None:
                _positive(p, f"scheduler.{name}", getattr(self, name))
        if self.warmup_tokens is not None:
            _non_negative(p, "scheduler.warmup_tokens", self.warmup_tokens)
        if self.in_tokens:
            steps = [name for name in ("warmup_steps", "warmup_fraction", "decay_steps", "decay_start_steps")
                     if getattr(self, name) not in (None, 0)]
            if steps:
                p.append(f"scheduler: {', '.join('scheduler.' + n for n in steps)} with token-counted lengths "
                         f"(scheduler.*_tokens): give every length in one unit")
            if self.decay == "inverse_sqrt":
                p.append("scheduler.decay inverse_sqrt is counted in steps only; give its lengths in steps")
        _positive(p, "scheduler.power", self.power)
        _non_negative(p, "scheduler.min_lr", self.min_lr)
        return p


@dataclass
class DataConfig:
    kind: str = "synthetic"  # "synthetic" (no files; tests, demos) | "indexed" (preprocessed .bin/.idx)
    seq_length: int = 128
    # masked positions per sequence (padded to this); None: what the masking rate needs,
    # ceil(max(masked_lm_prob, eval_masked_lm_prob) x seq_length) (20 at seq 128 and 15%)
    max_predictions_per_seq: int | None = None
    masked_lm_prob: float = 0.15  # share of a sequence's tokens predicted in training
    eval_masked_lm_prob: float | None = None  # ... in evaluation (validation, test); None: masked_lm_prob
    # what a predicted token becomes: [MASK] with this probability, a random token with the next, else
    # itself (BERT's 80/10/10)
    mask_token_share: float = 0.8
    random_token_share: float = 0.1
    num_samples: int = 100000  # synthetic dataset size
    # synthetic samples are [min_fraction * seq_length, seq_length] tokens long (uniform); lower it for
    # the length spread of a real corpus (packing tests, benchmarks)
    synthetic_min_fraction: float = 0.5
    seed: int = 1234  # data generation / shuffling / masking seed
    # indexed data (kind: indexed)
    paths: list[str] = field(default_factory=list)  # dataset prefixes: <prefix>.bin/.idx from tools/preprocess_data.py
    weights: list[float] = field(default_factory=list)  # blending weights, one per path; empty = equal
    vocab_file: str | None = None  # vocab.txt or tokenizer.json the data was preprocessed with
    # train on datasets whose recorded vocabulary is not vocab_file's (a deliberate change; without
    # it such a dataset is refused before the run starts, naming both files)
    accept_dataset_vocab: bool = False
    split: str = "949,50,1"  # train,valid,test shares of each corpus's documents (Megatron's rule)
    # separate validation / test corpora (all their documents; Megatron's --valid-data-path and
    # --test-data-path): used instead of the split's valid / test shares of data.paths
    valid_paths: list[str] = field(default_factory=list)
    test_paths: list[str] = field(default_factory=list)
    segment_pairs: str = "nsp"  # "nsp" (BERT) | "sop" (ALBERT/Megatron sentence order) | "none" (one segment)
    short_seq_prob: float = 0.1  # share of samples cut to a random shorter target length
    whole_word_masking: bool = True  # mask a word's pieces together (WordPiece '##' continuations; BPE: Ġ/▁ word starts)
    max_ngram: int = 1  # 1 = BERT; n > 1 masks spans of up to n words, length drawn with p ~ 1/length
    masking: str = "static"  # "static" (a sample's masks fixed) | "dynamic" (redrawn every epoch)
    index_cache_dir: str | None = None  # where sample indices are cached; default <data dir>/index-cache
    num_workers: int = 2  # loader processes per rank preparing batches ahead of the trainer (0 = inline)
    # several samples share a row of seq_length tokens, each attending only to itself (block-diagonal
    # attention, its own positions from 0): a micro-batch's samples fill as few rows as they fit in.
    # The same samples per step, the same losses and gradients, fewer padding tokens computed
    packing: bool = False

    # [first sample, count] ranges of the training sample sequence never trained on (as PaLM skips
    # the batches around a loss spike): the run steps over them, its step count and LR schedule
    # unaffected. Whole global batches (multiples of train.global_batch_size). A spike rollback
    # adds its own ranges (resilience.spike_policy), kept in the run's checkpoints
    skip_samples: list[list[int]] = field(default_factory=list)

    def problems(self) -> list[str]:
        p: list[str] = []
        _one_of(p, "data.kind", self.kind, DATA_KINDS)
        for entry in self.skip_samples:
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] >= 0 and entry[1] > 0):
                p.append(f"data.skip_samples entry {entry} must be [first sample >= 0, count > 0]")
        _positive(p, "data.seq_length", self.seq_length)
        if not 0.0 < self.masked_lm_prob <= 1.0:
            p.append(f"data.masked_lm_prob ({self.masked_lm_prob}) must be in (0, 1]")
        if self.eval_masked_lm_prob is not None and not 0.0 < self.eval_masked_lm_prob <= 1.0:
            p.append(f"data.eval_masked_lm_prob ({self.eval_masked_lm_prob}) must be in (0, 1]")
        for name in ("mask_token_share", "random_token_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                p.append(f"data.{name} ({getattr(self, name)}) must be in [0, 1]")
        if self.mask_token_share + self.random_token_share > 1.0 + 1e-12:
            p.append(f"data.mask_token_share ({self.mask_token_share}) + data.random_token_share "
                     f"({self.random_token_share}) must be <= 1 (the rest keep their token)")
        if self.max_predictions_per_seq is not None:
            _positive(p, "data.max_predictions_per_seq", self.max_predictions_per_seq)
            if self.max_predictions_per_seq > self.seq_length:
                p.append(f"data.max_predictions_per_seq ({self.max_predictions_per_seq}) must be <= "
                         f"data.seq_length ({self.seq_length})")
            elif 0.0 < self.highest_masking_rate() <= 1.0 and self.max_predictions_per_seq < round(
                    self.highest_masking_rate() * self.seq_length) - 3:
                p.append(f"data.max_predictions_per_seq ({self.max_predictions_per_seq}) caps the masking rate "
                         f"{self.highest_masking_rate():g} (about {round(self.highest_masking_rate() * self.seq_length)} "
                         f"positions at data.seq_length {self.seq_length}): raise it, or leave it unset to follow the rate")
        _positive(p, "data.num_samples", self.num_samples)
        if not 0.0 < self.synthetic_min_fraction <= 1.0:
            p.append(f"data.synthetic_min_fraction ({self.synthetic_min_fraction}) must be in (0, 1]")
        _non_negative(p, "data.seed", self.seed)  # numpy seeds must be >= 0
        _one_of(p, "data.segment_pairs", self.segment_pairs, SEGMENT_PAIRS)
        _one_of(p, "data.masking", self.masking, MASKING_MODES)
        if not 0.0 <= self.short_seq_prob <= 1.0:
            p.append(f"data.short_seq_prob ({self.short_seq_prob}) must be in [0, 1]")
        _positive(p, "data.max_ngram", self.max_ngram)
        _non_negative(p, "data.num_workers", self.num_workers)
        if self.kind == "indexed":
            p += self._indexed_problems()
        else:
            p += [f"data.{key} needs data.kind indexed" for key in ("valid_paths", "test_paths") if getattr(self, key)]
        return p

    def evaluation_masking_rate(self) -> float:
        return self.masked_lm_prob if self.eval_masked_lm_prob is None else self.eval_masked_lm_prob

    def highest_masking_rate(self) -> float:
        return max(self.masked_lm_prob, self.evaluation_masking_rate())

    def max_predictions(self) -> int:
        """Masked positions per sequence: data.max_predictions_per_seq, or what the higher of the two
        rates needs at data.seq_length (training and evaluation batches share one shape)."""
        if self.max_predictions_per_seq is not None:
            return self.max_predictions_per_seq
        return max(1, min(self.seq_length, math.ceil(self.highest_masking_rate() * self.seq_length - 1e-9)))

    def _indexed_problems(self) -> list[str]:
        p: list[str] = []
        if not self.paths:
            p.append("data.paths must list at least one dataset prefix when data.kind is indexed")
        if not self.vocab_file:
            p.append("data.vocab_file is required when data.kind is indexed")
        if self.weights and len(self.weights) != len(self.paths):
            p.append(f"data.weights has {len(self.weights)} entries for {len(self.paths)} data.paths")
        if any(not w > 0 for w in self.weights):
            p.append(f"data.weights ({self.weights}) must all be > 0")
        try:
            shares = [float(x) for x in self.split.split(",")]
        except ValueError:
            shares = []
        if not 1 <= len(shares) <= 3 or min(shares) < 0 or sum(shares) <= 0:
            p.append(f"data.split ({self.split!r}) must be up to three comma-separated non-negative shares "
                     "with a positive sum, e.g. '949,50,1'")
        if self.segment_pairs != "none" and self.seq_length < 4:
            p.append(f"data.seq_length ({self.seq_length}) must be >= 4 for segment pairs")
        return p


@dataclass
class TrainConfig:
    """What is trained and how: batch, steps, precision."""

    global_batch_size: int = 256  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    train_steps: int = 1000  # optimizer steps
    seed: int = 42  # model init / dropout seed
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    # bf16 only: the dtype gradients are accumulated over micro-batches and reduced over data-parallel
    # ranks in. "fp32" keeps what Megatron-LM keeps (DeepSpeed does it at ZeRO >= 1); "bf16" halves
    # gradient memory and reduction traffic and rounds every addition to 8 significant bits
    grad_accum_dtype: str = "fp32"
    tf32: bool = True  # TF32 tensor cores for fp32 matrix products on GPUs (Ampere and later); no effect on CPU
    deepspeed_config: str | None = None  # path to a user DeepSpeed JSON adding DeepSpeed-only options
    # batch-size warmup (ModernBERT's): the global batch grows linearly in the tokens seen (samples x
    # data.seq_length) from batch_warmup_min_size to global_batch_size over this many tokens, in
    # multiples of batch_warmup_min_size (the same batches at every layout: it must be a multiple of
    # micro_batch_size x data parallel); 0 = no warmup
    batch_warmup_tokens: int = 0
    batch_warmup_min_size: int | None = None

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("global_batch_size", "micro_batch_size", "train_steps"):
            _positive(p, f"train.{name}", getattr(self, name))
        _non_negative(p, "train.batch_warmup_tokens", self.batch_warmup_tokens)
        if self.batch_warmup_tokens and self.batch_warmup_min_size is None:
            p.append("train.batch_warmup_tokens needs train.batch_warmup_min_size (the first batch, and the ramp's step)")
        if self.batch_warmup_min_size is not None:
            if not self.batch_warmup_tokens:
                p.append("train.batch_warmup_min_size is set without train.batch_warmup_tokens")
            if not 0 < self.batch_warmup_min_size < self.global_batch_size:
                p.append(f"train.batch_warmup_min_size ({self.batch_warmup_min_size}) must be in "
                         f"(0, train.global_batch_size ({self.global_batch_size}))")
        _non_negative(p, "train.seed", self.seed)
        _one_of(p, "train.precision", self.precision, PRECISIONS)
        return p


@dataclass
class CheckpointConfig:
    """Where checkpoints go and where a run starts from."""

    save_dir: str | None = None
    save_interval: int = 0  # 0 = only at end / on SIGTERM
    keep_last: int = 3  # checkpoints kept; 0 = keep all
    load_dir: str | None = None  # resume from the latest checkpoint here
    # start from another run's latest checkpoint (e.g. phase 2 from phase 1): its weights (and, with
    # init_optimizer_states, its optimizer moments), but step 0, new data position and LR schedule;
    # a checkpoint in load_dir takes precedence, so a restarted phase-2 run resumes itself
    init_from: str | None = None
    init_optimizer_states: bool = False
    # init_from is the previous phase of this training (ModernBERT's context extension, its decay):
    # its optimizer states too, and the phase may change the LR, schedule, batch, masking, sequence
    # length and rotary bases; the start-up log lists every setting it changes, and the tokens seen
    # count on from the previous phase's (pretrain/checkpoint/phases.py)
    new_phase: bool = False
    # init_from is a smaller ModernBERT: tile its weights "from the middle" into this run's larger
    # model (ModernBERT's tile_weights_from_middle, how ModernBERT-large started from base;
    # pretrain/checkpoint/tiling.py): weights only, step 0; the model's shape keys are this run's own
    init_tiled: bool = False
    # resume (or init_from) a checkpoint trained with another vocabulary than data.vocab_file: a
    # deliberate change (the embedding of a changed id keeps what it learnt for the old token).
    # Without it such a run is refused, naming both files
    accept_new_vocab: bool = False
    # resume although the data settings that define the sample sequence (data.paths, weights, split,
    # seq_length, masking, segment pairs, seed...) differ from the checkpoint's: weights, optimizer,
    # step and LR schedule resume, the new sequence starts over from its first sample. Without it
    # such a resume is refused, naming the keys (a new phase uses init_from instead)
    accept_new_data: bool = False
    # write into a save_dir that holds another run's checkpoints (a run starting from scratch or
    # from init_from there, or resuming another directory's series into it): this run's saves
    # replace the checkpoints of the same steps, the others stay (retention removes only the run's
    # own). Without it such a run is refused before any rank starts, naming the latest checkpoint there
    overwrite: bool = False
    # save in the background: the save step copies the state to host memory (about the size of the
    # rank's checkpoint files) and training goes on while a thread writes, fsyncs and fingerprints
    # them; `latest` moves once every rank's files are durable. The next save, a stop and the end
    # of training wait for it (docs/checkpoints.md, "Asynchronous saves")
    async_save: bool = False

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("save_interval", "keep_last"):
            _non_negative(p, f"checkpoint.{name}", getattr(self, name))
        if self.new_phase and not self.init_from:
            p.append("checkpoint.new_phase needs checkpoint.init_from (the previous phase's checkpoint)")
        if self.init_tiled:
            if not self.init_from:
                p.append("checkpoint.init_tiled needs checkpoint.init_from (the smaller ModernBERT to tile)")
            for key in ("init_optimizer_states", "new_phase"):
                if getattr(self, key):
                    p.append(f"checkpoint.init_tiled takes the weights only: the smaller model's optimizer state "
                             f"does not fit the larger one; remove checkpoint.{key}")
        return p

    @property
    def loads_optimizer_states(self) -> bool:
        """Whether init_from's optimizer states are loaded (init_optimizer_states, or a new phase)."""
        return self.init_optimizer_states or self.new_phase


@dataclass
class EvalConfig:
    """Evaluation on the validation set during training (and the test set once at the end)."""

    interval: int = 0  # steps between evaluations; 0 = never
    steps: int = 10  # global batches per evaluation
    # a JSON file with every evaluation's metrics (validation at each interval, the test set once
    # at the end of training), rewritten after each; kept across resumes
    results: str | None = None

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "eval.steps", self.steps)
        _non_negative(p, "eval.interval", self.interval)
        return p


@dataclass
class LoggingConfig:
    """What the run reports: the log line, TensorBoard, phase timers, profiler traces."""

    interval: int = 10  # steps between log lines
    tensorboard_dir: str | None = None
    # time each phase of a step (data, forward, backward, gradient reduction, optimizer; ms per step
    # on the log line and time/* in TensorBoard); on a GPU it synchronises at every phase boundary
    timers: bool = False
    # a torch.profiler trace of the steps [first, last] (1-based, inclusive) into profile_dir, on
    # the ranks in profile_ranks: <rank>.*.pt.trace.json for TensorBoard's profiler plugin or Perfetto
    profile_steps: list[int] = field(default_factory=list)
    profile_dir: str | None = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    # once per log window, every rank's own step time (not counting the time it waited for the
    # others) gathered in the window's one metric collective: the line shows min/median/max and the
    # slowest rank, TensorBoard each rank's figure
    stragglers: bool = True
    # a rank whose own step time is above the median by more than this share (0.2 = 20%) in
    # straggler_windows log windows in a row is named in a warning line
    straggler_share: float = 0.2
    straggler_windows: int = 2

    def problems(self) -> list[str]:
        p: list[str] = []
        _positive(p, "logging.interval", self.interval)
        _positive(p, "logging.straggler_windows", self.straggler_windows)
        _non_negative(p, "logging.straggler_share", self.straggler_share)
        if self.profile_steps:
            first_last = self.profile_steps
            if len(first_last) != 2 or not 1 <= first_last[0] <= first_last[1]:
                p.append(f"logging.profile_steps ({first_last}) must be [first, last] with 1 <= first <= last")
            if not self.profile_dir:
                p.append("logging.profile_steps needs logging.profile_dir (where the trace is written)")
        if any(rank < 0 for rank in self.profile_ranks):
            p.append(f"logging.profile_ranks ({self.profile_ranks}) must be ranks >= 0")
        return p


@dataclass
class ResilienceConfig:
    """What a long job does when something goes wrong: timeouts, stops, non-finite steps."""

    dist_timeout_minutes: float = 10.0  # collective timeout: a dead/hung rank makes the others exit
    # no training step or evaluation step finished for this long: every rank writes what it was
    # doing, which rank is stuck and every thread's stack, and ends (exit 124). 0 = no limit on steps
    hang_timeout_minutes: float = 15.0
    # the same watch over the start-up (resuming or initialising, up to the end of the first step,
    # which builds the communicators) and over a checkpoint save, which may rightly take longer than
    # a step (a loaded parallel file system); 0 = no limit there. All three 0: no watchdog
    startup_timeout_minutes: float = 30.0
    save_timeout_minutes: float = 30.0
    # every rank must have joined the job's rendezvous within this long; else the ones that did
    # end, naming the ranks that did not
    rendezvous_timeout_minutes: float = 10.0
    exit_after_steps: int = 0  # stop (saving a checkpoint) after this many steps of this run; 0 = run to train_steps
    # save and exit 0 once this many minutes have passed since the trainer started (checked every
    # stop_check_interval steps), ahead of a scheduler's time limit; the relaunch resumes. 0 = no limit
    exit_duration_minutes: float = 0.0
    # steps between the ranks' agreement on a SIGTERM (one collective and host sync each time);
    # keep interval x step time well inside the scheduler's grace period (SLURM: KillWait, 30 s)
    stop_check_interval: int = 5
    # skip a step whose loss or gradients are NaN/Inf on any rank (weights and LR schedule left as
    # they were), by our own check: one collective and host sync per step. DeepSpeed's wrappers
    # (ZeRO-1/2/3, bf16, fp16) skip such steps themselves whatever this says; only ZeRO-0 fp32
    # then lets a NaN into the weights
    skip_nonfinite_steps: bool = True
    # this many non-finite steps in a row stop the job with an error (fp16 loss-scale overflows
    # count only once the dynamic scale has reached fp16.min_loss_scale)
    max_consecutive_skips: int = 10
    # a loss spike: a finite loss above spike_factor x the median of the last spike_window steps
    # losses (judged once that many steps were seen), or a gradient norm above spike_grad_norm
    # (0 = not judged). off | log (a warning and a TensorBoard event) | skip (no rank applies the
    # step: loss spikes only, judged before the update) | rollback (every rank reloads the run's
    # latest checkpoint and steps over the samples from it to spike_skip_batches global batches
    # past the spike; at most spike_max_rollbacks times, then the job stops)
    spike_policy: str = "off"
    spike_factor: float = 3.0
    spike_window: int = 100
    spike_grad_norm: float = 0.0
    spike_skip_batches: int = 0
    spike_max_rollbacks: int = 5

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("dist_timeout_minutes", "stop_check_interval", "max_consecutive_skips",
                     "rendezvous_timeout_minutes"):
            _positive(p, f"resilience.{name}", getattr(self, name))
        _one_of(p, "resilience.spike_policy", self.spike_policy, SPIKE_POLICIES)
        for name in ("spike_window", "spike_max_rollbacks"):
            _positive(p, f"resilience.{name}", getattr(self, name))
        if self.spike_factor <= 1.0:
            p.append(f"resilience.spike_factor ({self.spike_factor}) must be > 1 (a multiple of the running median loss)")
        for name in ("spike_grad_norm", "spike_skip_batches"):
            _non_negative(p, f"resilience.{name}", getattr(self, name))
        if self.spike_policy == "skip" and self.spike_grad_norm:
            p.append("resilience.spike_policy=skip judges the loss before the update; the gradient norm is known only "
                     "after it: use spike_policy log or rollback with resilience.spike_grad_norm")
        for name in ("exit_after_steps", "exit_duration_minutes", "hang_timeout_minutes", "startup_timeout_minutes",
                     "save_timeout_minutes"):
            _non_negative(p, f"resilience.{name}", getattr(self, name))
        return p

    def watchdog_limits(self) -> dict[str, tuple[float, str]]:
        """The watchdog's limit per kind of phase (pretrain/resilience/watchdog.py), with its key."""
        return {kind: (getattr(self, name), f"resilience.{name}") for kind, name in (
            ("start-up", "startup_timeout_minutes"), ("step", "hang_timeout_minutes"), ("save", "save_timeout_minutes"))}


@dataclass
class Fp16Config:
    """Loss scaling for train.precision fp16 (ignored otherwise), as Megatron's --loss-scale,
    --initial-loss-scale, --loss-scale-window, --hysteresis and --min-loss-scale; written into the
    DeepSpeed JSON's fp16 block (a user JSON may not contradict them)."""

    loss_scale: float = 0.0  # 0 = dynamic scaling; > 0 = this static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2 ** this
    loss_scale_window: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_loss_scale: int = 1  # the scale never drops below this (an integer for DeepSpeed)

    def problems(self) -> list[str]:
        p: list[str] = []
        _non_negative(p, "fp16.loss_scale", self.loss_scale)
        if not 0 <= self.initial_scale_power <= 64:
            p.append(f"fp16.initial_scale_power ({self.initial_scale_power}) must be in [0, 64]")
        for name in ("loss_scale_window", "hysteresis", "min_loss_scale"):
            _positive(p, f"fp16.{name}", getattr(self, name))
        if self.min_loss_scale > 0 and self.loss_scale == 0 and 2.0 ** min(self.initial_scale_power, 64) < self.min_loss_scale:
            p.append(f"fp16.min_loss_scale ({self.min_loss_scale}) must be <= 2 ** fp16.initial_scale_power "
                     f"({2 ** self.initial_scale_power})")
        return p

    def deepspeed_block(self) -> dict[str, Any]:
        """DeepSpeed's names for the same settings (its fp16 block)."""
        return {"loss_scale": self.loss_scale, "initial_scale_power": self.initial_scale_power,
                "loss_scale_window": self.loss_scale_window, "hysteresis": self.hysteresis,
                "min_loss_scale": self.min_loss_scale}


# Section name -> dataclass, in the order sections are listed and validated.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "resilience": ResilienceConfig,
    "fp16": Fp16Config,
}

# Keys that lived in `train` until the sections above mirrored the trainer's parts: a config
# naming one is refused with its new place (no silent alias). Checkpoints written before keep
# loading (Config.from_stored moves their keys).
MOVED_KEYS: dict[str, str] = {
    **{f"train.{key}": f"checkpoint.{key}" for key in (
        "save_dir", "load_dir", "save_interval", "keep_last", "init_from", "init_optimizer_states", "accept_new_vocab")},
    "train.eval_interval": "eval.interval", "train.eval_steps": "eval.steps", "train.eval_results": "eval.results",
    "train.log_interval": "logging.interval",
    **{f"train.{key}": f"logging.{key}" for key in (
        "tensorboard_dir", "timers", "profile_steps", "profile_dir", "profile_ranks")},
    **{f"train.{key}": f"resilience.{key}" for key in (
        "dist_timeout_minutes", "hang_timeout_minutes", "rendezvous_timeout_minutes", "exit_after_steps",
        "exit_duration_minutes", "stop_check_interval", "skip_nonfinite_steps", "max_consecutive_skips")},
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def binary_head(self) -> bool:
        """Whether the model has the pooler and the next-sentence (or sentence-order) classifier:
        not with data.segment_pairs none, whose samples are single segments."""
        return self.data.segment_pairs != "none"

    @property
    def shapes_vary(self) -> bool:
        """Whether the activations' shapes change between micro-batches: packed rows (as many as
        the samples fill) and ModernBERT (which computes each micro-batch's real tokens only)."""
        return self.data.packing or self.model.modern

    def data_parallel_size(self, world_size: int) -> int:
        problem = _world_size_problem(self, world_size)
        if problem:
            raise ConfigError(problem)
        return world_size // (self.parallel.tensor_parallel * self.parallel.pipeline_parallel)

    def grad_accum_steps(self, world_size: int) -> int:
        dp = self.data_parallel_size(world_size)
        problem = _batch_problem(self, dp)
        if problem:
            raise ConfigError(problem)
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    # -- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON serialisable), e.g. to store in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> "Config":
        """Build from a nested dict with the same key and type checks as a YAML file.
        Missing sections/fields take their defaults. Does not run validate()."""
        clean, problems = check_tree(d, source, SECTIONS, MOVED_KEYS)
        if problems:
            raise ConfigError(problems)
        return _build(clean)

    @classmethod
    def from_stored(cls, d: dict, source: str = "dict") -> "Config":
        """from_dict for a config a checkpoint stored: one saved before the keys moved out of
        `train` (MOVED_KEYS) has them moved to their sections first."""
        d = {section: dict(entries) if isinstance(entries, dict) else entries for section, entries in d.items()}
        for old, new in MOVED_KEYS.items():
            old_section, old_key = old.split(".")
            if isinstance(d.get(old_section), dict) and old_key in d[old_section]:
                new_section, new_key = new.split(".")
                d.setdefault(new_section, {})[new_key] = d[old_section].pop(old_key)
        return cls.from_dict(d, source)

    def _schedule_length_problems(self) -> list[str]:
        """The schedule's lengths against each other and the run: warmup within the run, the decay's
        start within [warmup, horizon), in the schedule's unit (token lengths with a fixed batch:
        samples x data.seq_length per step)."""
        from .token_clock import TokenClock

        s, t = self.scheduler, self.train
        unit = "tokens" if s.in_tokens else "steps"
        clock = TokenClock.of(self)
        lengths = s.lengths(t.train_steps, clock.tokens_before if s.in_tokens else int)
        warmup, horizon, start = lengths["warmup_steps"], lengths["decay_steps"], lengths["decay_start"]
        run = clock.tokens_before(t.train_steps) if s.in_tokens else t.train_steps
        horizon_name = (f"scheduler.decay_{unit}" if getattr(s, f"decay_{unit}") is not None
                        else "train.train_steps" if unit == "steps" else "the tokens of train.train_steps")
        warmup_name = (f"scheduler.warmup_{unit}" if s.warmup_fraction is None
                       else f"scheduler.warmup_fraction x {horizon_name}")
        p = []
        if warmup > run:
            run_name = f"the tokens of train.train_steps ({run})" if s.in_tokens else f"train.train_steps ({run})"
            p.append(f"{warmup_name} ({warmup}) must be <= {run_name}")
        elif start is not None and start < warmup:
            p.append(f"scheduler.decay_start_{unit} ({start}) must be >= {warmup_name} ({warmup})")
        elif s.decay != "constant" and horizon <= (warmup if start is None else start):
            first = warmup_name if start is None else f"scheduler.decay_start_{unit}"
            p.append(f"{horizon_name} ({horizon}) must exceed {first} ({warmup if start is None else start}) for "
                     f"scheduler.decay {s.decay}")
        return p

    # -- rules ------------------------------------------------------------------------------

    def validate(self, world_size: int | None = None) -> None:
        """Check every rule; raise one ConfigError listing all violations, one per line.
        Pass world_size once it is known to also check the parallel/batch arithmetic."""
        m, par, o, s, d, t = self.model, self.parallel, self.optimizer, self.scheduler, self.data, self.train
        p = m.problems() + par.problems() + self._model_split_problems()
        p += o.problems() + s.problems()
        clock_readable = t.global_batch_size > 0 and d.seq_length > 0 and (
            not t.batch_warmup_tokens or 0 < (t.batch_warmup_min_size or 0) < t.global_batch_size)
        if not s.problems() and clock_readable and t.train_steps > 0:
            p += self._schedule_length_problems()
        if s.min_lr > o.lr:
            p.append(f"scheduler.min_lr ({s.min_lr}) must be <= optimizer.lr ({o.lr})")
        p += d.problems()
        if m.modern and d.segment_pairs != "none":
            p.append(f"model.architecture modernbert has no next-sentence head: set data.segment_pairs none "
                     f"(not {d.segment_pairs})")
        if d.seq_length > m.max_position_embeddings:
            p.append(f"data.seq_length ({d.seq_length}) must be <= "
                     f"model.max_position_embeddings ({m.max_position_embeddings})")
        p += t.problems() + self.checkpoint.problems() + self.eval.problems() + self.logging.problems()
        p += self.resilience.problems() + self._batch_problems(world_size)
        r = self.resilience
        if r.spike_policy == "rollback" and not (self.checkpoint.save_dir and self.checkpoint.save_interval):
            p.append("resilience.spike_policy=rollback reloads the run's latest checkpoint: set checkpoint.save_dir and "
                     "checkpoint.save_interval")
        gbs = self.train.global_batch_size
        for first, count in (e for e in self.data.skip_samples if isinstance(e, list) and len(e) == 2):
            if gbs > 0 and (first % gbs or count % gbs):
                p.append(f"data.skip_samples [{first}, {count}]: whole global batches, multiples of "
                         f"train.global_batch_size ({gbs})")
        if r.exit_duration_minutes and not self.checkpoint.save_dir:
            p.append(f"resilience.exit_duration_minutes ({r.exit_duration_minutes:g}) needs checkpoint.save_dir: the "
                     "job saves a checkpoint before it exits, for the relaunch to resume")
        if t.precision in PRECISIONS and par.zero_stage in (0, 1, 2, 3):
            p += precision_problems(t.precision, t.grad_accum_dtype, par.zero_stage, par.pipeline_parallel)
        p += self.fp16.problems()
        if p:
            raise ConfigError(p)

    def _model_split_problems(self) -> list[str]:
        """How the model's shapes divide over tensor and pipeline parallelism."""
        m, par, p = self.model, self.parallel, []
        tp, pp = par.tensor_parallel, par.pipeline_parallel
        if tp >= 1 and m.num_attention_heads > 0 and m.num_attention_heads % tp:
            p.append(f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                     f"parallel.tensor_parallel ({tp})")
        if tp >= 1 and m.ffn_size > 0 and m.ffn_size % tp:
            p.append(f"model ffn size ({m.ffn_size}, from model.ffn_hidden_size or 4 x hidden_size) "
                     f"must be divisible by parallel.tensor_parallel ({tp})")
        if pp >= 1 and m.num_layers > 0 and m.num_layers % pp:
            p.append(f"model.num_layers ({m.num_layers}) must be divisible by "
                     f"parallel.pipeline_parallel ({pp})")
        return p

    def _batch_problems(self, world_size: int | None) -> list[str]:
        """G = micro x accumulation x data parallel (data parallel known with the world size)."""
        t, par = self.train, self.parallel
        if t.global_batch_size <= 0 or t.micro_batch_size <= 0 or par.tensor_parallel < 1 or par.pipeline_parallel < 1:
            return []  # reported by the sections
        if world_size is None:
            if t.global_batch_size % t.micro_batch_size:
                return [f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                        f"train.micro_batch_size ({t.micro_batch_size})"]
            return []
        problem = _world_size_problem(self, world_size)
        if problem:
            return [problem]
        dp = world_size // (par.tensor_parallel * par.pipeline_parallel)
        problems = [_batch_problem(self, dp)]
        if t.batch_warmup_min_size and t.batch_warmup_min_size % (t.micro_batch_size * dp):
            problems.append(f"train.batch_warmup_min_size ({t.batch_warmup_min_size}) must be a multiple of "
                            f"train.micro_batch_size x data parallel ({t.micro_batch_size} x {dp}): every batch of "
                            f"the warmup is whole micro-batches on every rank")
        return [problem for problem in problems if problem]


def _positive(problems: list[str], name: str, value: float) -> None:
    if not value > 0:
        problems.append(f"{name} ({value}) must be > 0")


def _non_negative(problems: list[str], name: str, value: float) -> None:
    if not value >= 0:
        problems.append(f"{name} ({value}) must be >= 0")


def _one_of(problems: list[str], name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        problems.append(f"{name} ({value!r}) must be one of: {', '.join(allowed)}")


def _world_size_problem(cfg: Config, world_size: int) -> str | None:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size < 1 or tp < 1 or pp < 1 or world_size % (tp * pp):
        return (f"world size ({world_size}) must be a positive multiple of parallel.tensor_parallel x "
                f"parallel.pipeline_parallel ({tp} x {pp} = {tp * pp})")
    return None


def _batch_problem(cfg: Config, data_parallel: int) -> str | None:
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if m < 1 or g < 1 or g % (m * data_parallel):
        return (f"train.global_batch_size ({g}) must equal train.micro_batch_size ({m}) x gradient "
                f"accumulation x data_parallel ({data_parallel}), i.e. be a positive multiple of "
                f"{m * data_parallel}")
    return None


def _build(clean: dict[str, dict[str, Any]]) -> Config:
    return Config(**{name: cls(**clean.get(name, {})) for name, cls in SECTIONS.items()})


def load_config(path: str | None, overrides: Sequence[str] = (),
                inherit: Callable[[dict], dict] | None = None) -> Config:
    """Load a YAML config (with its `base:` files) and apply `section.field=value` overrides.

    Checks keys and types and reports every problem in one ConfigError. Rule checks are
    separate: call cfg.validate(world_size) once the world size is known.
    `base:` paths are relative to the file naming them; this file's values win over its bases.
    Override values are parsed as YAML (`checkpoint.save_dir=null`, `optimizer.no_weight_decay=[bias]`).
    `inherit` takes the {section: {key: value}} tree and returns it with the keys it leaves unset
    taken from elsewhere: a run's keys from its starting point are the layer above's business
    (pretrain/checkpoint/starting_point.py's load_run_config passes inherit_model_keys).
    """
    tree = load_sections(path, overrides, SECTIONS, MOVED_KEYS)
    return _build(inherit(tree) if inherit is not None else tree)
