"""BERT layers on megatron-core tensor-parallel building blocks.

Each layer is one step of the model's stage sequence (see `bert.py`) and passes a tuple of
tensors to the next, because DeepSpeed's pipeline engine sends exactly such tuples between
stages. Only the first element of a tuple crossing a stage boundary requires grad; masks are
integer tensors (gloo cannot send bool).

  input batch      (input_ids, token_type_ids, padding_mask, masked_positions)
  WordEmbedding    (word_vectors, token_type_ids, padding_mask, masked_positions)
  EmbeddingTail    (hidden, padding_mask, masked_positions)
  TransformerLayer (hidden, padding_mask, masked_positions)         x num_layers
  PretrainingHeads (mlm_hidden, nsp_logits)
  WordEmbedding    (mlm_logits_without_bias, nsp_logits)           tied decoder
  MlmOutputBias    (mlm_logits, nsp_logits)

Packed batches (data.packing, pretrain/data/samples/packing.py: several samples per row) carry two
more tensors and a sample id per token instead of the padding mask; the tuple's length tells
the layers which kind they hold:

  input batch      (input_ids, token_type_ids, sample_ids, masked_positions, position_ids, cls_positions)
  WordEmbedding    (word_vectors, token_type_ids, sample_ids, masked_positions, position_ids, cls_positions)

where a token attends only to the tokens of its own sample (block-diagonal attention), and the
heads read masked_positions and cls_positions as flat indices into the [rows * seq] tokens, so
they return per-sample tensors exactly as unpacked.

Real tokens only: outside context parallelism EmbeddingTail's forward (the pretraining step and
its evaluation) turns padded and packed rows alike into one row of the micro-batch's T real tokens
(unpadding.py, as ModernBERT), so that no layer computes padding:

  EmbeddingTail    (hidden [1, T, hidden], sample_ids [1, T], masked_positions, cls_positions)
  TransformerLayer the same four                                                   x num_layers

with the positions flat indices into the T tokens; the attention is attention.packed_attention's
per document (variable-length flash attention on CUDA without attention dropout), its masks and
plans built once per micro-batch for all layers (micro_batch.py). `EmbeddingTail.rows` keeps the
rows (the padded or packed tuples above, [rows, seq, hidden]): what fine-tuning's per-row hidden
states and context parallelism's column split take.

Tensors are [batch, sequence, hidden]. The math is Hugging Face BertForPreTraining's: post-LN
residual blocks, exact-erf GELU, learned absolute positions and token types, tanh pooler.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.device import all_reduce_with_grad
from ..distributed.megatron_core import ModelParallelConfig, tensor_parallel
from ..distributed.internals import PlainGemmOverride
from .context_split import ContextGroup, ContextSplit, gather_row
from .attention import packed_attention
from .cpu_bf16 import upcast_bf16
from .dropout import Dropout, dropout, keep_mask
from .fused import layer_kernels
from .micro_batch import MicroBatchCache
from .rng import RngTracker, checkpoint_with_rng
from .unpadding import unpad_inputs


# The DeepSpeed TiedLayerSpec key of the word embedding, shared by the input lookup and the MLM decoder
TIED_EMBEDDING_KEY = "word_embeddings"


def megatron_config(params_dtype: torch.dtype, tp_group) -> ModelParallelConfig:
    """Megatron layer config: allocate on CPU, leave initialisation to `init_weights`."""
    return ModelParallelConfig(
        tensor_model_parallel_size=tp_group.size(),
        params_dtype=params_dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )


def _unused_init(weight):  # megatron-core insists on an init method; init_weights does the real work
    return weight


def _sharded(layer, partition_dim: int):
    """Mark a megatron layer's weight as TP-sharded along partition_dim.

    megatron-core sets these attributes only inside its own weight initialisation, which we
    switch off (perform_initialization=False); initialisation, LAMB, clipping and conversion
    all rely on them.
    """
    tensor_parallel.set_tensor_model_parallel_attributes(layer.weight, True, partition_dim, 1)
    return layer


def layer_norm(hidden_size: int, eps: float, dtype: torch.dtype, bias: bool = True) -> nn.Module:
    """apex's FusedLayerNorm on GPU when apex is importable, torch's LayerNorm otherwise.

    Both compute the same function with parameters named weight and bias (HF_NAME_TABLE). Without
    `bias` (ModernBERT's norm_bias false) torch's, which has that option.
    """
    if not bias:
        return nn.LayerNorm(hidden_size, eps=eps, bias=False, dtype=dtype)
    if torch.cuda.is_available():
        try:
            from apex.normalization import FusedLayerNorm

            return FusedLayerNorm(hidden_size, eps=eps).to(dtype)
        except ImportError:
            pass
    return nn.LayerNorm(hidden_size, eps=eps, dtype=dtype)


def _linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
            grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None):
    """megatron-core's linear computed by F.linear, so the bias add runs inside the GEMM (addmm;
    on CUDA cuBLASLt's bias epilogue).

    megatron's autograd function multiplies, then adds the bias in a separate pass over the
    output (about 5% of a BERT-base layer on CPU; on a GPU another read and write of every
    output). Its `allreduce_dgrad` (column-parallel at TP > 1; this runs there on the CPU only,
    PlainGemmOverride) is the backward of copy_to_tensor_model_parallel_region, which we apply
    instead.
    """
    if gradient_accumulation_fusion or sequence_parallel or grad_output_buffer is not None:
        raise NotImplementedError("gradient accumulation fusion and sequence parallelism need megatron's linear")
    if allreduce_dgrad:
        input = tensor_parallel.copy_to_tensor_model_parallel_region(input, group=tp_group)
    return linear(input, weight, bias)


class _Fp32GemmLinear(torch.autograd.Function):
    """x W^T + b for bf16 tensors with every GEMM in fp32 on exactly upcast operands.

    The same arithmetic as a bf16 GEMM (bf16 products are exact in fp32, fp32 accumulation,
    the output rounded to bf16), for CPUs where that is faster (cpu_bf16.py); saves the bf16
    tensors only.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad2d = grad.reshape(-1, grad.shape[-1]).float()
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = (grad2d @ weight.float()).view(*grad.shape[:-1], weight.shape[1]).to(x.dtype)
        if need_w:
            grad_w = (grad2d.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if need_b and ctx.has_bias:
            grad_b = grad2d.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 GEMMs run as fp32 GEMMs on CPUs where that route is the faster."""
    if upcast_bf16(weight):
        return _Fp32GemmLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(PlainGemmOverride, tensor_parallel.ColumnParallelLinear):
    """megatron-core's column-parallel linear (sharding, TP regions); its GEMM is `_linear` (the
    bias inside the GEMM) except on an accelerator at TP > 1 (PlainGemmOverride)."""

    plain_forward = staticmethod(_linear)


class RowParallelLinear(PlainGemmOverride, tensor_parallel.RowParallelLinear):
    """megatron-core's row-parallel linear (sharding, TP reduction); its GEMM is `_linear` (megatron
    adds the bias after the reduction, outside it)."""

    plain_forward = staticmethod(_linear)


class WordEmbedding(nn.Module):
    """Vocabulary-parallel word embedding, also the MLM decoder (the weights are tied).

    On the first stage it embeds token ids; on the last it maps MLM hidden states to logits.
    Both uses go through `forward` so that DeepSpeed's module hooks (ZeRO-3) always fire.
    """

    def __init__(self, padded_vocab_size: int, hidden_size: int, mp_config: ModelParallelConfig, tp_group):
        super().__init__()
        self.embedding = _sharded(tensor_parallel.VocabParallelEmbedding(
            padded_vocab_size, hidden_size, init_method=_unused_init, config=mp_config, tp_group=tp_group
        ), 0)
        # True where the lookup and the decoder meet in one autograd graph (SequentialBert): the
        # lookup's weight gradient is then sparse and autograd adds it in place into the decoder's
        # dense gradient, instead of zero-filling a vocabulary-sized tensor and adding the two (7% of
        # a BERT-base step on CPU). A pipeline's first stage would hand a lone sparse gradient to
        # DeepSpeed and the optimizer, so it keeps the dense one.
        self.sparse_lookup_grad = False

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def forward(self, inputs, decode: bool = False):
        if decode:
            return self.decode(inputs)
        input_ids, *rest = inputs
        return self._lookup(input_ids), *rest

    def _lookup(self, input_ids):
        emb = self.embedding
        # A CPU optimisation only: on an accelerator the dense gradient is cheap, and sparse
        # gradients are a kernel set of their own that not every device has.
        if not self.sparse_lookup_grad or emb.weight.device.type != "cpu":
            return emb(input_ids)
        # megatron-core's VocabParallelEmbedding.forward (no sequence parallelism), sparse gradient
        if emb.tp_group.size() > 1:
            outside = (input_ids < emb.vocab_start_index) | (input_ids >= emb.vocab_end_index)
            local_ids = (input_ids - emb.vocab_start_index).masked_fill(outside, 0)
            vectors = F.embedding(local_ids, emb.weight, sparse=True).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            vectors = F.embedding(input_ids, emb.weight, sparse=True)
        return tensor_parallel.reduce_from_tensor_model_parallel_region(vectors, group=emb.tp_group)

    def decode(self, inputs):
        mlm_hidden, nsp_logits = inputs
        # hidden is replicated over TP, the weight is vocab-sharded: the copy all-reduces the
        # input's gradient over TP in backward so every rank sees the full-vocabulary gradient.
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(mlm_hidden, group=self.embedding.tp_group)
        return linear(hidden, self.embedding.weight), nsp_logits


def decode_tokens(module: WordEmbedding, inputs):
    """forward_fn of the last stage's tied word embedding (pipeline mode)."""
    return module(inputs, decode=True)


def attention_bias(padding_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [batch, 1, 1, seq]: 0 where attended, the dtype's lowest value at padding
    (as Hugging Face's BERT). A float bias keeps SDPA's fused GPU kernels (memory-efficient
    attention) eligible for padded batches."""
    bias = torch.zeros(padding_mask.shape, dtype=dtype, device=padding_mask.device)
    return bias.masked_fill_(padding_mask == 0, torch.finfo(dtype).min)[:, None, None, :]


def packed_attention_bias(sample_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive block-diagonal mask [rows, 1, seq, seq] of packed rows: 0 where query and key
    belong to the same sample, the dtype's lowest value elsewhere. Padding (id 0) attends to
    padding only: no query row is fully masked (its output is never read).

    One float mask per row: SDPA keeps its fused kernels with it (on the CPU 171 ms forward and
    backward for BERT-base shapes B8 x S512, against 175 ms unmasked and 476 ms for the math path
    with the mask); torch's flex_attention has no CPU backward (torch 2.13)."""
    same = sample_ids[:, None, :, None] == sample_ids[:, None, None, :]
    bias = torch.zeros(same.shape, dtype=dtype, device=sample_ids.device)
    return bias.masked_fill_(~same, torch.finfo(dtype).min)


def self_attention(query, key, value, bias: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v with dropout on the probabilities; `bias` is
    `attention_bias`'s additive padding mask or `packed_attention_bias`'s block-diagonal one.

    Without dropout (or on GPU): torch's scaled_dot_product_attention (fused kernels). With
    dropout on CPU, SDPA falls back to its math path anyway; spelled out here it is the same
    arithmetic with `dropout`'s faster mask.
    """
    if upcast_bf16(query):
        # bf16 batched products are slower than fp32 ones there: attend in fp32, as `linear`
        # does for the projections, and hand back bf16.
        return self_attention(query.float(), key.float(), value.float(), bias.float(), dropout_p).to(query.dtype)
    if dropout_p == 0.0 or query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout_p)
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(query.shape[-1] ** -0.5).add_(bias)
    return torch.matmul(dropout(torch.softmax(scores, dim=-1), dropout_p, True), value)


class EmbeddingTail(nn.Module):
    """Adds position and token-type embeddings, LayerNorm, dropout (a replicated region). Its
    forward computes the micro-batch's real tokens only (one row, see the module docstring), or
    this rank's share of every row's columns under context parallelism."""

    def __init__(self, hidden_size, max_positions, type_vocab_size, eps, dropout, params_dtype,
                 context: ContextGroup | None = None):
        super().__init__()
        self.context = _split_group(context)
        self.position_embeddings = nn.Embedding(max_positions, hidden_size, dtype=params_dtype)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden_size, dtype=params_dtype)
        self.layernorm = layer_norm(hidden_size, eps, params_dtype)
        self.dropout = Dropout(dropout)

    def forward(self, inputs):
        return self.rows(inputs) if self.context is not None else self.real_tokens(inputs)

    def real_tokens(self, inputs):
        """(hidden [1, T, hidden], sample_ids [1, T], masked_positions, cls_positions) of the
        micro-batch's T real tokens, the positions flat indices into them (unpadding.py)."""
        tokens = unpad_inputs(inputs)
        token_types = inputs[1].reshape(-1).index_select(0, tokens.index)[None]
        hidden = self._embed(tokens.hidden, tokens.position_ids, token_types)
        return hidden, tokens.sample_ids, tokens.masked_positions, tokens.cls_positions

    def rows(self, inputs):
        """The rows as they came: (hidden [rows, seq, hidden], padding_mask, masked_positions), or
        packed rows' (hidden, sample_ids, masked_positions, cls_positions) with flat positions."""
        if len(inputs) == 6:  # packed: each sample's positions count from 0 (see the module docstring)
            word_vectors, token_type_ids, sample_ids, masked_positions, position_ids, cls_positions = inputs
            passed_on = (sample_ids, masked_positions, cls_positions)
        else:
            word_vectors, token_type_ids, padding_mask, masked_positions = inputs
            position_ids = torch.arange(word_vectors.shape[1], device=word_vectors.device)
            passed_on = (padding_mask, masked_positions)
        if self.context is not None:  # this rank's share of every row's columns (context parallelism)
            split = self.context.split(word_vectors.shape[1])
            word_vectors, token_type_ids = split.local(word_vectors, 1), split.local(token_type_ids, 1)
            position_ids = split.local(position_ids, position_ids.dim() - 1)
        return self._embed(word_vectors, position_ids, token_type_ids), *passed_on

    def _embed(self, word_vectors, position_ids, token_type_ids) -> torch.Tensor:
        hidden = word_vectors + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.layernorm(hidden))


class TransformerLayer(nn.Module):
    """Post-LN encoder layer: attention on this rank's heads, then the MLP column/row split. On
    EmbeddingTail's real tokens (or packed rows) the attention is per document (packed_attention),
    its masks from `cache`, built once per micro-batch for all layers; on padded rows and under
    context parallelism, SDPA with an additive mask."""

    def __init__(self, layer_index: int, model_cfg, mp_config: ModelParallelConfig, rng: RngTracker, tp_group,
                 context: ContextGroup | None = None, cache: MicroBatchCache | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.context = _split_group(context)
        self.cache = cache if cache is not None else MicroBatchCache()
        self.rng = rng
        self.recompute = model_cfg.recompute  # "none" | "selective" | "full"
        self.attention_kernel = model_cfg.attention_kernel
        hidden, tp = model_cfg.hidden_size, mp_config.tensor_model_parallel_size
        self.local_heads = model_cfg.num_attention_heads // tp
        self.head_dim = hidden // model_cfg.num_attention_heads
        self.attention_dropout = model_cfg.attention_dropout
        dtype = mp_config.params_dtype

        def column(out_size):
            return _sharded(ColumnParallelLinear(
                hidden, out_size, config=mp_config, init_method=_unused_init, bias=True, gather_output=False,
                tp_group=tp_group), 0)

        self.query = column(hidden)
        self.key = column(hidden)
        self.value = column(hidden)
        # the output linears hand their bias back unadded (skip_bias_add): `_residual_norm` adds it
        self.attention_output = _sharded(RowParallelLinear(
            hidden, hidden, config=mp_config, init_method=_unused_init, bias=True,
            input_is_parallel=True, skip_bias_add=True, tp_group=tp_group,
        ), 1)
        self.attention_layernorm = layer_norm(hidden, model_cfg.layernorm_epsilon, dtype)
        self.intermediate = _sharded(ColumnParallelLinear(
            hidden, model_cfg.ffn_size, config=mp_config, init_method=_unused_init, bias=True, gather_output=False,
            tp_group=tp_group), 0)
        self.output = _sharded(RowParallelLinear(
            model_cfg.ffn_size, hidden, config=mp_config, init_method=_unused_init, bias=True,
            input_is_parallel=True, skip_bias_add=True, tp_group=tp_group,
        ), 1)
        self.output_layernorm = layer_norm(hidden, model_cfg.layernorm_epsilon, dtype)
        self.dropout = Dropout(model_cfg.hidden_dropout)
        self.compile = model_cfg.compile

    def _split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[batch, seq, local heads x head_dim] -> token-major [batch, seq, heads, head_dim] (a view)."""
        batch, seq, _ = projected.shape
        return projected.view(batch, seq, self.local_heads, self.head_dim)

    def _layer(self, hidden: torch.Tensor, mask: torch.Tensor, packed: bool, first_token_only: bool = False) -> torch.Tensor:
        """`mask`: the padding mask, or with `packed` the sample id of every token. With
        `first_token_only` the layer's output at position 0 alone ([batch, 1, hidden]): keys and
        values of every token, the query, attention output and feed-forward of the first."""
        batch = hidden.shape[0]
        queries = hidden[:, :1] if first_token_only else hidden
        seq = queries.shape[1]
        query = self._split_heads(self.query(queries)[0])
        key = self._split_heads(self.key(hidden)[0])
        value = self._split_heads(self.value(hidden)[0])
        if packed and self.context is None:  # attention per document, token-major
            core, operands = self._document_attention, (query, key, value, mask)
        else:
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
            bias = packed_attention_bias(mask, query.dtype) if packed else attention_bias(mask, query.dtype)
            if self.context is not None:  # this rank's queries against every share's keys and values
                split = self.context.split(mask.shape[1])
                key, value = _gather_columns(key, split), _gather_columns(value, split)
                if packed:
                    bias = split.local(bias, 2)  # the block-diagonal mask's rows of this rank's queries
            core, operands = self._attention_core, (query, key, value, bias)
        if self.recompute == "selective" and self.training and torch.is_grad_enabled():
            # the attention core only: its scores and probabilities are recomputed in backward
            # instead of kept; the projections' outputs stay
            context = checkpoint_with_rng(core, self.rng, *operands)
        else:
            context = core(*operands)
        context = context.reshape(batch, seq, self.local_heads * self.head_dim)
        hidden = self._residual_norm(*self.attention_output(context), queries, self.attention_layernorm)
        mlp, mlp_bias = self.output(F.gelu(self.intermediate(hidden)[0]))
        return self._residual_norm(mlp, mlp_bias, hidden, self.output_layernorm)

    def _residual_norm(self, delta, bias, residual, norm) -> torch.Tensor:
        """norm(residual + dropout(delta + bias)), the post-LN residual: with model.compile one
        generated kernel forward and one backward (fused.bias_dropout_add_norm, dropout's keep mask
        drawn here as `dropout` draws it), eager four passes over memory or more."""
        kernels = layer_kernels(self.compile, delta.device.type)
        if not kernels.compiled:
            return norm(residual + self.dropout(delta + bias))
        p = self.dropout.p if self.training else 0.0
        keep = keep_mask(delta, p) if p > 0.0 else None
        return kernels.bias_dropout_add_norm(delta, bias, keep, 1.0 / (1.0 - p), residual, norm.weight, norm.bias,
                                             norm.eps)

    def _attention_core(self, query, key, value, bias) -> torch.Tensor:
        """Head-major operands and an additive mask; the context token-major."""
        dropout_p = self.attention_dropout if self.training else 0.0
        with self.rng.fork():  # this rank's heads: a TP-rank-specific dropout stream
            return self_attention(query, key, value, bias, dropout_p).transpose(1, 2)

    def _document_attention(self, query, key, value, sample_ids) -> torch.Tensor:
        """Token-major operands; each token attends its own document's (sample id's) tokens."""
        dropout_p = self.attention_dropout if self.training else 0.0
        with self.rng.fork():
            return packed_attention(query, key, value, sample_ids, dropout_p=dropout_p, cache=self.cache,
                                    kernel=self.attention_kernel)

    def forward(self, inputs):
        hidden, mask, *positions = inputs
        packed = len(inputs) == 4  # (hidden, sample_ids, masked_positions, cls_positions)
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            hidden = checkpoint_with_rng(self._layer, self.rng, hidden, mask, packed)
        else:
            hidden = self._layer(hidden, mask, packed)
        return hidden, mask, *positions

    def first_token(self, inputs) -> torch.Tensor:
        """This layer's output at position 0 only, [batch, 1, hidden] (padded rows, as
        EmbeddingTail.rows gives them): as the last layer under a head that reads [CLS] alone, it
        skips 10 of the 12 h^2 per token of its matrix products (the query, attention output and
        feed-forward of the other tokens)."""
        hidden, mask, *_ = inputs
        if len(inputs) == 4:
            raise ValueError("first_token takes padded rows, not packed ones or real tokens")
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return checkpoint_with_rng(self._layer, self.rng, hidden, mask, False, True)
        return self._layer(hidden, mask, False, True)


class PretrainingHeads(nn.Module):
    """Pooler + NSP classifier, and the MLM transform applied only at masked positions."""

    binary_head = True

    def __init__(self, model_cfg, params_dtype, context: ContextGroup | None = None):
        super().__init__()
        self.context = _split_group(context)
        hidden = model_cfg.hidden_size
        if self.binary_head:
            self.pooler = nn.Linear(hidden, hidden, dtype=params_dtype)
            self.nsp = nn.Linear(hidden, 2, dtype=params_dtype)
        self.mlm_dense = nn.Linear(hidden, hidden, dtype=params_dtype)
        self.mlm_layernorm = layer_norm(hidden, model_cfg.layernorm_epsilon, params_dtype)

    def forward(self, inputs):
        if self.context is not None:
            cls_hidden, masked_hidden = _gather_heads_input(inputs, self.context)
        elif len(inputs) == 4:  # packed: flat positions into the [rows * seq] tokens, per sample
            hidden, _sample_ids, masked_positions, cls_positions = inputs
            tokens = hidden.reshape(-1, hidden.shape[-1])
            cls_hidden = tokens[cls_positions]
            masked_hidden = tokens[masked_positions.reshape(-1)].view(*masked_positions.shape, -1)
        else:
            hidden, _padding_mask, masked_positions = inputs
            cls_hidden = hidden[:, 0]
            index = masked_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            masked_hidden = torch.gather(hidden, 1, index)
        nsp_logits = self.nsp(torch.tanh(self.pooler(cls_hidden))) if self.binary_head else None
        # Sparse prediction: only the masked positions go through the vocabulary projection.
        mlm_hidden = self.mlm_layernorm(F.gelu(self.mlm_dense(masked_hidden)))
        return mlm_hidden, nsp_logits


def _split_group(context: ContextGroup | None) -> ContextGroup | None:
    return context if context is not None and context.size > 1 else None


def _gather_columns(tensor: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """[batch, heads, share, head_dim] -> the whole rows' [batch, heads, seq, head_dim] from every share."""
    return gather_row(tensor.permute(2, 0, 1, 3), split).permute(1, 2, 0, 3)


def _gather_heads_input(inputs, context: ContextGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Under context parallelism: the [CLS] vectors and those at the masked positions, each from
    the share that holds it (the others add zeros), summed over the CP group so that every rank
    runs the heads on all of them."""
    hidden, mask, masked_positions, *cls = inputs
    rows, share, width = hidden.shape
    split = context.split(mask.shape[1])
    if cls:  # packed: flat positions into the whole [rows * seq] tokens
        columns = torch.cat([cls[0], masked_positions.reshape(-1)])
        row, column = columns // mask.shape[1], columns % mask.shape[1]
    else:  # padded: column positions per row, [CLS] at column 0
        column = torch.cat([torch.zeros(rows, 1, dtype=masked_positions.dtype, device=masked_positions.device),
                            masked_positions], dim=1).reshape(-1)
        row = torch.arange(rows, device=column.device).repeat_interleave(1 + masked_positions.shape[1])
    mine = (column >= split.start) & (column < split.end)
    local = row * share + (column - split.start).clamp(0, share - 1)
    picked = hidden.reshape(-1, width).index_select(0, local) * mine[:, None].to(hidden.dtype)
    picked = all_reduce_with_grad(picked, split.group)
    if cls:
        cls_hidden, masked = picked[:cls[0].numel()], picked[cls[0].numel():]
    else:
        picked = picked.view(rows, 1 + masked_positions.shape[1], width)
        cls_hidden, masked = picked[:, 0], picked[:, 1:].reshape(-1, width)
    return cls_hidden, masked.view(*masked_positions.shape, width)


class MlmHead(PretrainingHeads):
    """BertForMaskedLM's heads: the MLM transform only, no pooler and no next-sentence classifier
    (data.segment_pairs: none, Megatron's --bert-no-binary-head); its nsp_logits are None."""

    binary_head = False


class MlmOutputBias(nn.Module):
    """The MLM decoder's vocabulary-parallel bias; padded vocabulary entries get no probability."""

    def __init__(self, vocab_size: int, padded_vocab_size: int, mp_config: ModelParallelConfig, tp_group):
        super().__init__()
        tp, tp_rank = tp_group.size(), tp_group.rank()
        local = padded_vocab_size // tp
        self.bias = nn.Parameter(torch.zeros(local, dtype=mp_config.params_dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        vocab_ids = torch.arange(tp_rank * local, (tp_rank + 1) * local)
        self.register_buffer("is_padding", vocab_ids >= vocab_size, persistent=False)

    def forward(self, inputs):
        logits, nsp_logits = inputs
        logits = (logits + self.bias).masked_fill(self.is_padding, torch.finfo(logits.dtype).min)
        return logits, nsp_logits
