"""The model section: architecture, shape, dropout, the attention pattern and kernels (BERT and
ModernBERT), with the rules about its own fields."""
from __future__ import annotations

from dataclasses import dataclass

from . import rope_scaling as rope
from .checks import one_of, positive
from .choices import ARCHITECTURES, ATTENTION_KERNELS, CLASSIFIER_POOLING, COMPILE_CHOICES, RECOMPUTE


@dataclass
class ModelConfig:
    architecture: str = "bert"  # "bert" (Devlin et al. 2018) | "modernbert" (Warner et al. 2024)
    # tokenizer vocabulary (before padding); null: data.vocab_file's size, read before the run starts
    # (pretrain/data/samples/provider.py: vocab_size_from_tokenizer)
    vocab_size: int | None = 30522
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
    # ModernBERT: rotary scaling with transformers' definitions (rope_scaling.py): null, or
    # {rope_type: linear | dynamic | yarn, factor: ..., ...} for both layer kinds, or
    # {global: {...} | null, local: {...} | null}
    rope_scaling: dict | None = None
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_bias: bool = False
    classifier_pooling: str = "cls"
    # the attention kernel on CUDA without attention dropout (ModernBERT; BERT outside context
    # parallelism, whose training has dropout: SDPA per document then): "varlen" torch's
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

    def rope_scaling_of(self, is_global: bool) -> dict | None:
        """ModernBERT: the rotary scaling spec of the global or the local layers (None: unscaled)."""
        return rope.resolved(self.rope_scaling)["global" if is_global else "local"]

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
        if self.vocab_size is None:
            p.append("model.vocab_size is null (the size of data.vocab_file's tokenizer) but no readable "
                     "data.vocab_file gives it: set data.vocab_file, or model.vocab_size to a number")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings", "type_vocab_size", "make_vocab_size_divisible_by",
                     "layernorm_epsilon", "init_std"):
            if getattr(self, name) is not None:
                positive(p, f"model.{name}", getattr(self, name))
        if self.ffn_hidden_size is not None:
            positive(p, "model.ffn_hidden_size", self.ffn_hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                p.append(f"model.{name} ({value}) must be in [0, 1)")
        one_of(p, "model.recompute", self.recompute, RECOMPUTE)
        one_of(p, "model.architecture", self.architecture, ARCHITECTURES)
        one_of(p, "model.classifier_pooling", self.classifier_pooling, CLASSIFIER_POOLING)
        one_of(p, "model.attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        one_of(p, "model.compile", self.compile, COMPILE_CHOICES)
        p += rope.problems(self.rope_scaling, self.modern)
        if self.modern:
            for name in ("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta"):
                positive(p, f"model.{name}", getattr(self, name))
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
