"""ModernBERT (Warner et al. 2024) on megatron-core tensor-parallel layers.

The math is transformers' ModernBertForMaskedLM (models/modernbert/modeling_modernbert.py):
token embedding -> LayerNorm -> dropout (no position or token-type embeddings); pre-LN layers
`h + Wo(attn(attn_norm(h)))`, `h + mlp.Wo(GeGLU(mlp_norm(h)))` with no attn_norm on layer 0;
rotary positions over the whole head dimension (non-interleaved halves), base global_rope_theta
on global layers and local_rope_theta on local ones, each kind scaled per model.rope_scaling
(rotary.py); layer i global when
i % global_attn_every_n_layers == 0, the others attending to keys within local_attention / 2
positions; a final LayerNorm; the MLM head dense -> GELU -> LayerNorm -> decoder tied to the
token embedding, with a bias.

The stage sequence mirrors BERT's MLM-only one (bert.py), so pipeline cutting, tied weights and
checkpoint files work alike:

  input batch       (input_ids, token_type_ids, padding_mask, masked_positions), or packed rows'
                    (input_ids, token_type_ids, sample_ids, masked_positions, position_ids, cls_positions)
  TokenEmbedding    (word_vectors, token_type_ids, ...the rest as it came)
  EmbeddingNorm     (hidden, sample_ids, masked_positions, cls_positions, position_ids)
  ModernLayer       the same five                                                    x num_layers
  ModernMlmHead     (mlm_hidden, None)            final_norm at the masked positions only
  TokenEmbedding    (mlm_logits_without_bias, None)                                  tied decoder
  DecoderBias       (mlm_logits, None)

EmbeddingNorm computes on real tokens only from there on: padded rows and packed rows (data.packing)
alike become one row [1, T] of the micro-batch's T real tokens (unpadding.py), each with its sample
id (a padded row is one sample), its position (rotary positions restart at every sample) and the
masked and [CLS] positions as flat indices into the T; attention (global or windowed) never crosses
a sample. What every layer derives from the micro-batch (rotary tables, masks) is built once
(micro_batch.py); the element-wise work is fused.py's. Token types are read past, never embedded.

Parameter layout that differs from transformers (checkpoint/modernbert_hf.py converts): Wqkv
rows are per head [q; k; v] (megatron's fused QKV) and Wi rows interleave the GeGLU halves
[input_0, gate_0, input_1, gate_1, ...], so that cutting either into TP shards along rows hands
every rank whole heads and matching halves whatever the TP size: the stored tensors stay
layout-free.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from ..distributed.megatron_core import ModelParallelConfig
from torch import nn

from .layers import (
    TIED_EMBEDDING_KEY,
    ColumnParallelLinear,
    Dropout,
    MlmOutputBias,
    RowParallelLinear,
    WordEmbedding,
    _sharded,
    _unused_init,
    decode_tokens,
    dropout,
    layer_norm,
)
from ..distributed.internals import GemmOperandsOverride
from .attention import packed_attention
from .fused import layer_kernels
from .context_parallel import context_parallel_attention
from .context_split import ContextGroup, gather_masked
from .micro_batch import MicroBatchCache
from .rng import RngTracker, checkpoint_with_rng
from .rotary import rotary_tables
from .unpadding import unpad_inputs


class TokenEmbedding(WordEmbedding):
    """ModernBERT's token embedding (model.embeddings.tok_embeddings), also the tied decoder."""


class DecoderBias(MlmOutputBias):
    """ModernBERT's MLM decoder bias (decoder.bias)."""


def context_split(context: ContextGroup, sample_ids: torch.Tensor, min_piece: int, cache: MicroBatchCache):
    """The micro-batch row's CP split, balanced by tokens and global-attention work (context_split.py),
    built once per micro-batch: pieces of at least half a local window, so that a local layer's
    halo comes from the neighbouring ranks."""
    return cache.get(sample_ids, ("cp-split", min_piece), lambda: context.balanced(sample_ids, min_piece))


class EmbeddingNorm(nn.Module):
    """The micro-batch's real tokens as one row (unpadding.py: padded and packed rows alike), then
    LayerNorm and dropout of their vectors (a replicated region). Every layer after it computes on
    real tokens only."""

    def __init__(self, model_cfg, params_dtype: torch.dtype, context: ContextGroup | None = None,
                 cache: MicroBatchCache | None = None):
        super().__init__()
        self.norm = layer_norm(model_cfg.hidden_size, model_cfg.layernorm_epsilon, params_dtype, model_cfg.norm_bias)
        self.dropout = Dropout(model_cfg.hidden_dropout)
        self.context = context if context is not None and context.size > 1 else None
        self.min_piece = model_cfg.local_attention // 2
        self.cache = cache if cache is not None else MicroBatchCache()

    def forward(self, inputs):
        tokens = unpad_inputs(inputs)  # padded or packed rows
        hidden = tokens.hidden
        if self.context is not None:  # this rank's share of the row's tokens
            hidden = context_split(self.context, tokens.sample_ids, self.min_piece, self.cache).local(hidden, dim=1)
        return (self.dropout(self.norm(hidden)), tokens.sample_ids, tokens.masked_positions,
                tokens.cls_positions, tokens.position_ids)


def _geglu_halves(tensor: torch.Tensor) -> torch.Tensor:
    """Wi's interleaved rows [input_0, gate_0, input_1, ...] as [inputs; gates] (a copy)."""
    return tensor.view(-1, 2, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape)


class GegluInput(GemmOperandsOverride, ColumnParallelLinear):
    """GeGLU's input projection Wi, column-parallel. Its rows are stored interleaved (so that a TP
    shard holds matching input and gate rows, see the module docstring) and reordered to
    [inputs; gates] for the GEMM: the halves of the output are then contiguous slices, where an
    interleaved output's would be strided ones (GELU and its backward on strided halves cost 3x)."""

    def gemm_operands(self, weight, bias):
        return _geglu_halves(weight), None if bias is None else _geglu_halves(bias)


class ModernLayer(nn.Module):
    """Pre-LN encoder layer on the micro-batch's real tokens (EmbeddingNorm's one row): rotary
    attention (global or windowed, within each sample) on this rank's heads, then the GeGLU MLP
    split column/row over TP. The rotary tables and the attention masks come from `cache`, built
    once per micro-batch for all layers (micro_batch.py); the element-wise work between the matrix
    products runs as fused.py's groups (compiled per model.compile)."""

    def __init__(self, layer_index: int, model_cfg, mp_config: ModelParallelConfig, rng: RngTracker, tp_group,
                 cache: MicroBatchCache | None = None, context: ContextGroup | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.context = context if context is not None and context.size > 1 else None
        self.rng = rng
        self.cache = cache if cache is not None else MicroBatchCache()
        self.recompute = model_cfg.recompute
        self.attention_kernel = model_cfg.attention_kernel
        self.compile = model_cfg.compile
        hidden, tp = model_cfg.hidden_size, mp_config.tensor_model_parallel_size
        self.local_heads = model_cfg.num_attention_heads // tp
        self.head_dim = hidden // model_cfg.num_attention_heads
        self.is_global = model_cfg.is_global_layer(layer_index)
        self.half_window = None if self.is_global else model_cfg.local_attention // 2
        self.min_piece = model_cfg.local_attention // 2  # the CP split's (see context_split)
        self.rope_theta = model_cfg.global_rope_theta if self.is_global else model_cfg.local_rope_theta
        self.rope_scaling = model_cfg.rope_scaling_of(self.is_global)
        self.max_position_embeddings = model_cfg.max_position_embeddings
        self.attention_dropout = model_cfg.attention_dropout
        dtype, eps = mp_config.params_dtype, model_cfg.layernorm_epsilon

        def column(out_size, bias):
            return _sharded(ColumnParallelLinear(hidden, out_size, config=mp_config, init_method=_unused_init, bias=bias,
                                                 gather_output=False, tp_group=tp_group), 0)

        def row(in_size, bias):
            return _sharded(RowParallelLinear(in_size, hidden, config=mp_config, init_method=_unused_init, bias=bias,
                                              input_is_parallel=True, skip_bias_add=False, tp_group=tp_group), 1)

        # transformers' layer 0 has nn.Identity() as attn_norm: the embedding norm just ran
        self.attn_norm = layer_norm(hidden, eps, dtype, model_cfg.norm_bias) if layer_index > 0 else None
        self.attn_qkv = column(3 * hidden, model_cfg.attention_bias)
        self.attn_out = row(hidden, model_cfg.attention_bias)
        self.mlp_norm = layer_norm(hidden, eps, dtype, model_cfg.norm_bias)
        self.mlp_in = _sharded(GegluInput(hidden, 2 * model_cfg.ffn_size, config=mp_config, init_method=_unused_init,
                                          bias=model_cfg.mlp_bias, gather_output=False, tp_group=tp_group), 0)
        self.mlp_out = row(model_cfg.ffn_size, model_cfg.mlp_bias)
        self.attention_out_dropout = Dropout(model_cfg.attention_dropout)  # transformers' attn.out_drop
        self.mlp_dropout = model_cfg.hidden_dropout

    def _layer(self, hidden, sample_ids, position_ids) -> torch.Tensor:
        rows, seq, _ = hidden.shape
        kernels = layer_kernels(self.compile, hidden.device.type)
        normed = self.attn_norm(hidden) if self.attn_norm is not None else hidden
        qkv = self.attn_qkv(normed)[0].view(rows, seq, self.local_heads, 3, self.head_dim)
        query, key, value = qkv.unbind(3)  # [rows, seq, heads, head_dim] each
        cos, sin = self.cache.get(sample_ids, ("rotary", self.is_global, hidden.dtype),
                                  self._rotary(sample_ids, position_ids, hidden.dtype))
        query, key = kernels.rotate_query_key(query, key, cos, sin)
        if self.recompute == "selective" and self.training and torch.is_grad_enabled():
            context = checkpoint_with_rng(self._attention_core, self.rng, query, key, value, sample_ids)
        else:
            context = self._attention_core(query, key, value, sample_ids)
        context = context.reshape(rows, seq, self.local_heads * self.head_dim)
        attended = self.attention_out_dropout(self.attn_out(context)[0])
        norm = self.mlp_norm
        hidden, normed = kernels.add_norm(hidden, attended, norm.weight, norm.bias, norm.eps)
        gated = kernels.geglu(self.mlp_in(normed)[0])
        with self.rng.fork():  # this rank's slice of the MLP width: a TP-rank-specific stream
            gated = dropout(gated, self.mlp_dropout, self.training)
        return hidden + self.mlp_out(gated)[0]

    def _rotary(self, sample_ids, position_ids, dtype):
        """The builder of this layer kind's rotary tables for the micro-batch: over the whole row
        (dynamic NTK scales with its longest document), then this rank's share under CP."""
        def build():
            cos, sin = rotary_tables(position_ids, self.head_dim, self.rope_theta, dtype, self.rope_scaling,
                                     self.max_position_embeddings)
            if self.context is None:
                return cos, sin
            split = context_split(self.context, sample_ids, self.min_piece, self.cache)
            return split.local(cos, 1), split.local(sin, 1)
        return build

    def _attention_core(self, query, key, value, sample_ids) -> torch.Tensor:
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.context is not None:  # [1, share, heads, head_dim]: this rank's queries, the row's documents
            split = context_split(self.context, sample_ids, self.min_piece, self.cache)
            with self.rng.fork():
                return context_parallel_attention(query[0], key[0], value[0], sample_ids, split,
                                                  half_window=self.half_window, dropout_p=dropout_p,
                                                  cache=self.cache, ring=self.context.ring)[None]
        with self.rng.fork():  # this rank's heads: a TP-rank-specific dropout stream
            return packed_attention(query, key, value, sample_ids, half_window=self.half_window, dropout_p=dropout_p,
                                    cache=self.cache, kernel=self.attention_kernel)

    def forward(self, inputs):
        # (hidden, sample_ids, masked_positions, cls_positions, position_ids): EmbeddingNorm's one row
        hidden, sample_ids, masked_positions, cls_positions, position_ids = inputs
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            hidden = checkpoint_with_rng(self._layer, self.rng, hidden, sample_ids, position_ids)
        else:
            hidden = self._layer(hidden, sample_ids, position_ids)
        return hidden, sample_ids, masked_positions, cls_positions, position_ids


class ModernMlmHead(nn.Module):
    """The encoder's final LayerNorm and the MLM head (dense -> GELU -> LayerNorm), applied at the
    masked positions only (LayerNorm is per token, so norming those alone is the same numbers)."""

    def __init__(self, model_cfg, params_dtype: torch.dtype, context: ContextGroup | None = None,
                 cache: MicroBatchCache | None = None):
        super().__init__()
        self.context = context if context is not None and context.size > 1 else None
        self.min_piece = model_cfg.local_attention // 2
        self.cache = cache if cache is not None else MicroBatchCache()
        hidden, eps, bias = model_cfg.hidden_size, model_cfg.layernorm_epsilon, model_cfg.norm_bias
        self.final_norm = layer_norm(hidden, eps, params_dtype, bias)
        self.dense = nn.Linear(hidden, hidden, bias=model_cfg.classifier_bias, dtype=params_dtype)
        self.norm = layer_norm(hidden, eps, params_dtype, bias)
        self.classifier_pooling = model_cfg.classifier_pooling  # read by sequence-level fine-tuning

    def forward(self, inputs):
        hidden, sample_ids, masked_positions, _cls_positions, _position_ids = inputs  # flat positions
        tokens = hidden.reshape(-1, hidden.shape[-1])
        if self.context is not None:  # every rank's share of the masked tokens, the head then run on all
            split = context_split(self.context, sample_ids, self.min_piece, self.cache)
            masked_hidden = gather_masked(tokens, masked_positions, split)
        else:
            masked_hidden = tokens.index_select(0, masked_positions.reshape(-1)).view(*masked_positions.shape, -1)
        return self.transform(self.final_norm(masked_hidden)), None

    def transform(self, normed: torch.Tensor) -> torch.Tensor:
        """transformers' ModernBertPredictionHead (also the sequence and token heads' first step)."""
        return self.norm(F.gelu(self.dense(normed)))


def modern_stage_specs(model_cfg, padded_vocab_size: int, mp_config: ModelParallelConfig, rng: RngTracker,
                       tp_group, context: ContextGroup | None = None) -> list:
    """ModernBERT as bert.stage_specs' ordered list of layer specs (see the module docstring)."""
    dtype = mp_config.params_dtype
    token = partial(TiedLayerSpec, TIED_EMBEDDING_KEY, TokenEmbedding, padded_vocab_size, model_cfg.hidden_size,
                    mp_config, tp_group, tied_weight_attr=["weight"])
    cache = MicroBatchCache()  # one per model (per stage in a pipeline): its layers share the micro-batch's masks
    return [
        token(),  # no forward_fn on the first use: see bert.stage_specs
        LayerSpec(EmbeddingNorm, model_cfg, dtype, context, cache),
        *[LayerSpec(ModernLayer, i, model_cfg, mp_config, rng, tp_group, cache, context)
          for i in range(model_cfg.num_layers)],
        LayerSpec(ModernMlmHead, model_cfg, dtype, context, cache),
        token(forward_fn=decode_tokens),
        LayerSpec(DecoderBias, model_cfg.vocab_size, padded_vocab_size, mp_config, tp_group),
    ]
