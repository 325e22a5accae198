"""What autograd keeps for backward, per rank: the tensors each layer of pretrain/model saves, by
recomputation mode, device kernels, precision and layout.

The unit is one micro-batch on one pipeline stage, exactly as pretrain/observability/device_memory.py's
ActivationMeter counts it (every storage once, parameters left out): the peak of a step is at
the end of a micro-batch's forward (nothing new is saved in backward), times the micro-batches
a stage holds at once under 1F1B: min(stages - stage, micro-batches) (the first stage the most).

Notation: b micro-batch rows, s sequence, h hidden, h_t = h/TP, f_t = ffn/TP, a_t = heads/TP,
V_t = padded vocabulary/TP, N = b*s tokens, P = b*p masked positions; B bytes of the model's
dtype; M bytes of a dropout mask element (the dtype's on the CPU, where `dropout` multiplies by
a keep mask; bool on GPUs, torch's native_dropout); S bytes of a LayerNorm mean/rstd element
(the input dtype on the CPU, fp32 in CUDA's kernels).

Per transformer layer (each line a tensor some op saves; the layer's input is saved once, by
the Q, K and V linears together):
    input B*N*h | Q, K, V 3*B*N*h_t | attention core (below) | context B*N*h_t (a copy, unless
    the core's output is laid out for it)
    2 dropout masks 2*M*N*h | 2 LayerNorms' inputs and statistics 2*(B*N*h + 2*S*N)
    LayerNorm 1's output B*N*h | GELU input and output 2*B*N*f_t
The attention core by kernel:
    cpu, attention dropout (spelled out): softmax, keep mask, dropped probabilities 3*B*b*a_t*s^2
    cpu, no attention dropout (SDPA's CPU flash kernel): bias B*b*s, logsumexp 4*b*a_t*s; its output
        is the context (a view)
    cuda (SDPA's memory-efficient kernel: flash takes no mask): bias B*b*ceil8(s), logsumexp
        4*b*a_t*ceil32(s), Philox seed and offset 16; its output is the context (a view)
    fakegpu (SDPA's math path, on the CPU's kernels): Q, K, V in fp32, softmax and dropped
        probabilities in fp32, a bool mask
Selective recomputation keeps the core's inputs (Q, K, V and the bias) instead of its insides;
full recomputation keeps each layer's input and, once per stage, the padding mask (8N).
Embeddings (first stage): the ids 16N (+N of the TP lookup's mask), positions 8s, LayerNorm
input and statistics, a dropout mask. Heads and loss (last stage): the last layer's output and
the masked positions (the gather), the MLM transform's tensors at P rows, the vocabulary bias
mask V_t, the vocabulary-parallel cross entropy's fp32 softmax 4*P*V_t (compiled: its input logits
B*P*V_t and two fp32 numbers per row) and its index tensors, NSP's pooled tanh and log-softmax.

ModernBERT (pretrain/model/modernbert.py; d head size, the same names otherwise) computes one
row of the micro-batch's real tokens; the plan takes N = b*s (full rows: an upper bound, padding is
never computed). Per layer:
    input B*N*h (layer 0 has no attn_norm: its QKV linear saves it) | attn_norm's statistics and
    output 2*S*N + B*N*h (layers > 0) | attention core and context (below) | attn.out_drop's mask
    Ma*N*h (attention_dropout) | mlp_norm's input and statistics B*N*h + 2*S*N | Wi reordered to
    [inputs; gates], a weight-sized copy 2*B*h*f_t | Wi's input B*N*h, its output 2*B*N*f_t (GELU's
    input and the gates are views of it) | GELU's output B*N*f_t | the MLP dropout's mask M*N*f_t |
    mlp.Wo's input B*N*f_t
The core by attention.py's path for one packed row of N tokens (choose_path; W bytes of what it
attends in, 4 on the CPU's fp32 bf16 route, B otherwise; V a view of the fused QKV output, kept
whole 3*B*N*h_t, or on the fp32 route a copy 4*N*h_t):
    dense, attention dropout (spelled out): Q, K 2*W*N*h_t, V, fp32 softmax, keep mask and dropped
        probabilities (4 + 2W)*a_t*N^2, context B*N*h_t (a copy)
    dense, SDPA's CPU flash kernel: Q and K 2*W*N*h_t, V, logsumexp 4*a_t*N, output W*N*h_t (the
        context a view; fp32 route: + B*N*h_t)
    banded (blocks of C=128 queries, width C + 2w, N_p = blocks*C): spelled: Q W*a_t*N_p*d, K and V
        band copies 2*W*a_t*blocks*width*d, the window mask blocks*C*width (bool, negated per
        layer), softmax, keep mask, dropped probabilities (4 + 2W)*a_t*blocks*C*width, context
        B*N*h_t; flash: Q, K and V (views of the keys padded by w on both sides) 2*W*a_t*(N_p + 2w)*d,
        logsumexp 4*a_t*N_p, output W*N_p*h_t (the context a view when N = N_p)
    documents (global layers of more than 256 tokens; L slots: each document padded up its
        bucket): spelled: gathered Q, K, V 3*W*L*h_t, softmax, keep mask, dropped (4 + 2W)*a_t*L*size,
        context B*N*h_t; flash: gathered Q, K, V, output 4*W*L*h_t, logsumexp 4*a_t*L, context B*N*h_t
    cuda without dropout (varlen flash attention or FlexAttention; an estimate, not measured): Q,
        K, the QKV output, its output, logsumexp, a context copy
Once per stage and micro-batch, what the layers share (pretrain/model/micro_batch.py's cache, one
storage for all): rotary cos and sin 2*B*N*d per base; without attention dropout the mask SDPA keeps
(dense W*N^2, banded W*N_p*width) and the documents' mask W*L (none when the row's length is a
bucket size: full rows then fill their buckets); the documents' gather and scatter
indices 8L + 8N. Selective recomputation keeps the checkpoint's inputs (Q, K, the QKV output
5*B*N*h_t), the context B*N*h_t and, once per stage, the rotary tables and sample ids 8N; full keeps
each layer's input and, once per stage, the sample ids and positions 16N. Embeddings: the input ids
8N (+N), the real tokens' indices 8(N+1), LayerNorm input and statistics, a dropout mask. Heads: as
BERT's MLM (no NSP) without the last layer's output (index_select keeps only its index), plus
final_norm's input and statistics at P rows B*P*h + 2*S*P.

BERT outside context parallelism computes one row of the micro-batch's real tokens too (the plan
takes N = b*s: full rows, an upper bound) and attends on attention.py's paths for a global layer
(dense up to 256 tokens, documents beyond): its core is ModernBERT's with Q, K and V the separate
linears' outputs (V B*N*h_t, or its fp32 copy), the masks and plans once per stage as ModernBERT's;
selective recomputation keeps Q, K, V and the context per layer and the sample ids 8N once per
stage. Embeddings: the input ids 8N (+N), the real tokens' indices 8(N+1), the positions' and
token types' indices 16N, LayerNorm input and statistics, a dropout mask. Heads: the masked
positions' index 8P (index keeps no input); with the binary head the [CLS] index 8b and the
pooler's input B*b*h.

Derived from the saved tensors of each op (their autograd formulas; CUDA's SDPA from torch's
sources and meta kernels) and checked byte for byte against the meter on the CPU and fakegpu;
tests/test_memory_plan.py keeps it there.
"""
from __future__ import annotations

import copy

from dataclasses import dataclass

from ..config.choices import compile_enabled


def _ceil(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Kernels:
    """What a device's kernels save, where that differs between devices."""

    attention: str  # "spelled" (CPU with attention dropout), "cpu_flash", "efficient", "math"
    mask_bytes: int | None  # a dropout mask element; None: the activation dtype's size
    stat_bytes: int | None  # a LayerNorm mean/rstd element; None: the activation dtype's size
    upcast_bf16: bool = False  # CPU bf16 GEMMs run as fp32 ones (pretrain/model/cpu_bf16.py)
    compiled: bool = False  # model.compile took effect (the loss's compiled form keeps the logits, not a softmax)


def kernels_for(device_type: str, attention_dropout: float, precision: str, compile_setting: str = "auto") -> Kernels:
    """The kernels a run on `device_type` ("cpu", "cuda", "fakegpu") uses (`compile_setting`: model.compile)."""
    compiled = compile_enabled(compile_setting, device_type)
    if device_type == "cuda":
        return Kernels("efficient", 1, 4, compiled=compiled)
    if device_type == "fakegpu":  # the GPU code path on the CPU's kernels
        return Kernels("math", 1, None, compiled=compiled)
    upcast = False
    if precision == "bf16":
        from ..model.cpu_bf16 import bf16_route

        upcast = bf16_route() == "fp32"
    return Kernels("spelled" if attention_dropout > 0 else "cpu_flash", None, None, upcast, compiled)


def _attention_core(k: Kernels, b: int, s: int, n: int, h_t: int, a_t: int, B: int, dropout: bool,
                    keys: int | None = None) -> int:
    """The bytes of the attention core beyond Q, K, V (none recomputed), and the context: `s`
    queries per row against `keys` keys (`s` by default; BERT under CP: its share against the row)."""
    keys = s if keys is None else keys
    if k.attention == "efficient":
        return B * b * _ceil(keys, 8) + B * n * h_t + 4 * b * a_t * _ceil(s, 32) + 16
    if k.attention == "math":
        probabilities = (2 * 4 + 1) * b * a_t * s * keys if dropout else 4 * b * a_t * s * keys
        return 3 * (4 - B) * n * h_t + probabilities + B * n * h_t  # Q, K, V upcast to fp32 (beyond B)
    wide = 4 if k.upcast_bf16 else B  # the fp32 route attends on fp32 copies
    qkv_extra = 3 * (wide - B) * n * h_t
    if k.attention == "spelled":
        return qkv_extra + 3 * wide * b * a_t * s * keys + B * n * h_t
    # cpu_flash: its output is laid out [b, s, heads, d], so the context is a view of it
    return qkv_extra + wide * b * s + wide * n * h_t + 4 * b * a_t * s


def modern_attention_path(cfg, index: int, tokens: int) -> str:
    """The path pretrain/model/attention.py takes for layer `index` off CUDA: the model attends one
    packed row of the micro-batch's `tokens` real tokens (choose_path): "dense", "banded" or
    "documents"."""
    from ..model.attention import choose_path

    m = cfg.model
    half_window = None if m.is_global_layer(index) else m.local_attention // 2
    if half_window is not None and half_window >= tokens - 1:
        half_window = None  # the window holds the whole row
    return choose_path(tokens, half_window)


def _documents_need_a_mask(cfg) -> bool:
    """Whether full rows' documents leave spare slots in their bucket (a mask): not when the row's
    length is a bucket size (128, 512: then SDPA attends the bucket without one)."""
    from ..model.attention import _ladder

    return _ladder(cfg.data.seq_length) != cfg.data.seq_length


def _documents_slots(cfg, micro: int) -> int:
    """Gathered slots of the documents path for `micro` full rows: each row one document, padded
    up its length's bucket (attention._ladder)."""
    from ..model.attention import _ladder

    return micro * _ladder(cfg.data.seq_length)


def _modern_core(cfg, k: Kernels, index: int, micro: int, h_t: int, a_t: int, B: int) -> int:
    """ModernBERT's attention core beyond the layer's input and norm (none recomputed), one packed
    row of n = micro x seq_length tokens: what its path saves from the rotary Q and K on, and the
    context the output projection saves. The masks and plans the layers share (the cache's) are
    counted once per stage (_modern_shared)."""
    from ..model.attention import BAND_BLOCK

    m = cfg.model
    n, d = micro * cfg.data.seq_length, h_t // a_t
    spelled = m.attention_dropout > 0
    if k.attention == "efficient" and not spelled:
        # CUDA (varlen flash attention or FlexAttention; an estimate, not measured here): Q and K,
        # V a view of the fused QKV output (all of it), its output and logsumexp, the context a copy
        return 2 * B * n * h_t + 3 * B * n * h_t + B * n * h_t + 4 * a_t * _ceil(n, 128) + B * n * h_t
    W = 4 if k.upcast_bf16 else B  # the fp32 route attends on fp32 copies of Q, K, V
    path = modern_attention_path(cfg, index, n)
    value = 4 * n * h_t if k.upcast_bf16 else 3 * B * n * h_t  # V: a view of the fused QKV output, or a copy
    if path == "banded":
        w = m.local_attention // 2
        blocks, width = -(-n // BAND_BLOCK), BAND_BLOCK + 2 * w
        padded = blocks * BAND_BLOCK
        band = a_t * blocks * width * d  # the key (value) band of every block, a copy
        scores = blocks * BAND_BLOCK * width  # per head
        if spelled:  # Q (or its padded copy), K band, the window mask (bool, all heads; negated per layer),
            # fp32 softmax, keep mask and dropped probabilities, V band, the context (a copy)
            return W * a_t * padded * d + 2 * W * band + scores + (4 + 2 * W) * a_t * scores + B * n * h_t
        # SDPA's CPU flash kernel on the blocks: Q blocks, K and V (their bands are views of the keys
        # padded by the window on both sides: one row), logsumexp, its output (the context: a view
        # when n is a whole number of blocks and nothing was upcast)
        context = 0 if padded == n and not k.upcast_bf16 else B * n * h_t
        keys = a_t * (padded + 2 * w) * d
        return W * a_t * padded * d + 2 * W * keys + 4 * a_t * padded + W * padded * h_t + context
    return _global_core(cfg, k, path, micro, h_t, a_t, B, value)


def _global_core(cfg, k: Kernels, path: str, micro: int, h_t: int, a_t: int, B: int, value: int) -> int:
    """The documents or dense path's core (CPU kernels) on one row of n = micro x seq_length
    tokens, beyond what feeds its Q and K: `value` the bytes V keeps (ModernBERT: the fused QKV
    output or an fp32 copy; BERT: its own linear's output or the copy)."""
    n = micro * cfg.data.seq_length
    spelled = cfg.model.attention_dropout > 0
    W = 4 if k.upcast_bf16 else B  # the fp32 route attends on fp32 copies of Q, K, V
    if path == "documents":
        slots = _documents_slots(cfg, micro)
        if spelled:  # per bucket Q, K, V copies, fp32 softmax, keep mask, dropped probabilities; the context
            size = slots // micro  # every document in one bucket (full rows)
            return 3 * W * slots * h_t + (4 + 2 * W) * a_t * slots * size + B * n * h_t
        # SDPA's CPU flash kernel per bucket: the gathered Q, K, V, its output, logsumexp; the
        # context (the gathered-back output) a copy
        return 3 * W * slots * h_t + W * slots * h_t + 4 * a_t * slots + B * n * h_t
    # dense: the [n, n] mask over the whole row
    if spelled:  # Q, K (or fp32 copies), fp32 softmax, keep mask and dropped probabilities, V, the
        # context (a copy)
        return 2 * W * n * h_t + value + (4 + 2 * W) * a_t * n * n + B * n * h_t
    # SDPA's CPU flash kernel: Q and K, V, logsumexp, its output (the context a view; the fp32
    # route: the bf16 copy of the output, which the output projection saves)
    context = B * n * h_t if k.upcast_bf16 else 0
    return 2 * W * n * h_t + value + 4 * a_t * n + W * n * h_t + context


def _plan_bytes(cfg, micro: int, W: int, path: str, keeps_mask: bool) -> int:
    """What a global layer kind's path keeps once per stage: the documents path's gather and
    scatter-back indices and its masks, or the dense path's [n, n] mask, where SDPA keeps a mask."""
    n = micro * cfg.data.seq_length
    if path == "documents":
        slots = _documents_slots(cfg, micro)
        return 8 * slots + 8 * n + (W * slots if keeps_mask and _documents_need_a_mask(cfg) else 0)
    return W * n * n if keeps_mask and path == "dense" else 0


def _modern_shared(cfg, tp: int, micro: int, precision: str, k: Kernels, layers: range) -> int:
    """What the layers of a stage (`layers`: their numbers) share per micro-batch, one storage each
    (pretrain/model/micro_batch.py): the rotary cos and sin of each base, and per layer kind the
    mask SDPA keeps (the dense and banded paths without attention dropout) or the documents path's
    gather indices; with recomputation the checkpoints' sample ids (and positions)."""
    from ..model.attention import BAND_BLOCK

    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    W = 4 if k.upcast_bf16 else B
    n, d = micro * cfg.data.seq_length, m.hidden_size // m.num_attention_heads
    if not layers:
        return 0
    if m.recompute == "full":
        return 16 * n  # sample ids and positions, the checkpoints' inputs
    kinds = {m.is_global_layer(i) for i in layers}
    total = 2 * B * n * d * len(kinds)  # cos and sin [1, n, 1, d] per rotary base
    if m.recompute == "selective":
        return total + 8 * n  # the sample ids, an input of every checkpointed core
    if k.attention == "efficient" and m.attention_dropout == 0:
        return total  # CUDA: a BlockMask or document boundaries, small (an estimate)
    spelled = m.attention_dropout > 0
    for kind in kinds:
        index = next(i for i in layers if m.is_global_layer(i) == kind)
        path = modern_attention_path(cfg, index, n)
        if path == "banded" and not spelled:
            w = m.local_attention // 2
            total += W * -(-n // BAND_BLOCK) * BAND_BLOCK * (BAND_BLOCK + 2 * w)
        elif path != "banded":
            total += _plan_bytes(cfg, micro, W, path, keeps_mask=not spelled)
    return total


def real_tokens_bert(cfg) -> bool:
    """BERT computing one row of each micro-batch's real tokens (Config.real_tokens_only, not ModernBERT)."""
    return not cfg.model.modern and cfg.parallel.context_parallel == 1


def _bert_core(cfg, k: Kernels, micro: int, h_t: int, a_t: int, B: int) -> int:
    """BERT's attention core on one row of n = micro x seq_length real tokens (none recomputed):
    Q, K, V (the separate linears' outputs) as its path saves them, and the context the output
    projection saves; the masks and plans once per stage (_bert_shared)."""
    m = cfg.model
    n = micro * cfg.data.seq_length
    spelled = m.attention_dropout > 0
    path = modern_attention_path(cfg, 0, n)  # every BERT layer is global
    slots = _documents_slots(cfg, micro)
    if k.attention == "efficient":  # CUDA (estimates, not measured here)
        if not spelled:  # varlen flash attention or FlexAttention: Q, K, V, output, logsumexp
            return 4 * B * n * h_t + 4 * a_t * _ceil(n, 128)
        if path == "documents":  # SDPA (memory-efficient, its dropout) per bucket, then gathered back
            return 4 * B * slots * h_t + 4 * a_t * _ceil(slots, 32) + 16 + B * n * h_t
        return 4 * B * n * h_t + 4 * a_t * _ceil(n, 32) + 16
    if k.attention == "math":  # fakegpu: SDPA's math path or the spelled softmax on the whole row
        return 3 * B * n * h_t + _attention_core(k, 1, n, n, h_t, a_t, B, spelled)
    W = 4 if k.upcast_bf16 else B  # V: its linear's output, or an fp32 copy
    return _global_core(cfg, k, path, micro, h_t, a_t, B, W * n * h_t)


def _bert_shared(cfg, micro: int, precision: str, k: Kernels) -> int:
    """What BERT's layers of a stage share per micro-batch (micro_batch.py's cache): the mask SDPA
    keeps (dense path) or the documents path's indices and masks; with recomputation the
    checkpoints' sample ids."""
    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    W = 4 if k.upcast_bf16 else B
    n = micro * cfg.data.seq_length
    if m.recompute in ("full", "selective"):
        return 8 * n  # the sample ids, an input of every checkpoint
    spelled = m.attention_dropout > 0
    if k.attention == "efficient" and not spelled:
        return 0  # CUDA: document boundaries or a BlockMask, small (an estimate)
    keeps_mask = not spelled or k.attention in ("efficient", "math")  # SDPA runs (on CUDA with its dropout)
    return _plan_bytes(cfg, micro, W, modern_attention_path(cfg, 0, n), keeps_mask)


def _modern_layer_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels, index: int) -> int:
    """One ModernLayer (pretrain/model/modernbert.py), one micro-batch: n = micro x seq_length real
    tokens in one row (full rows: an upper bound, padding is never computed)."""
    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    b, s, h = micro, cfg.data.seq_length, m.hidden_size
    n, h_t, f_t, a_t = b * s, h // tp, m.ffn_size // tp, m.num_attention_heads // tp
    M = 0 if m.hidden_dropout == 0 else (kernels.mask_bytes or B)  # the MLP's dropout (on [N, f_t])
    Ma = 0 if m.attention_dropout == 0 else (kernels.mask_bytes or B)  # attn.out_drop's (on [N, h])
    S = kernels.stat_bytes or B
    layer_input = B * n * h  # by attn_norm, or on layer 0 (no attn_norm) by the QKV linear
    if m.recompute == "full":
        return layer_input
    attn_norm = B * n * h + 2 * S * n if index > 0 else 0  # its statistics, and its output (the QKV linear's input)
    mlp = (B * n * h + 2 * S * n  # mlp_norm's input and statistics
           + 2 * B * h * f_t  # Wi reordered [inputs; gates]: a copy of the weight, saved by the GEMM
           + B * n * h  # Wi's input (mlp_norm's output)
           + 2 * B * n * f_t  # Wi's output, all of it (GELU's input and the gates are views of it)
           + B * n * f_t  # GELU's output (the product's other factor)
           + M * n * f_t + B * n * f_t)  # the dropout's mask, mlp.Wo's input
    if m.recompute == "selective":
        # the checkpoint's inputs: rotary Q and K, V (a view of the fused QKV output, kept whole);
        # the sample ids once per stage (_modern_shared); the context
        core = 2 * B * n * h_t + 3 * B * n * h_t + B * n * h_t
    else:
        core = _modern_core(cfg, kernels, index, b, h_t, a_t, B)
    return layer_input + attn_norm + core + Ma * n * h + mlp


def layer_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels, index: int | None = None) -> int:
    """One transformer layer, one micro-batch (unpacked rows). ModernBERT's layers differ by kind
    (global or local, and layer 0 has no attn_norm): `index` the layer's number in the model;
    None, the largest layer's (layers 1 to global_attn_every_n_layers: local ones and a global one)."""
    m = cfg.model
    if m.modern:
        if index is None:
            return max(_modern_layer_bytes(cfg, tp, micro, precision, kernels, i)
                       for i in range(1, m.global_attn_every_n_layers + 1))
        return _modern_layer_bytes(cfg, tp, micro, precision, kernels, index)
    B = 2 if precision in ("bf16", "fp16") else 4
    b, s, h = micro, cfg.data.seq_length, m.hidden_size
    n, h_t, f_t, a_t = b * s, h // tp, m.ffn_size // tp, m.num_attention_heads // tp
    M = 0 if m.hidden_dropout == 0 else (kernels.mask_bytes or B)
    S = kernels.stat_bytes or B
    layer_input = B * n * h
    if m.recompute == "full":
        return layer_input
    rest = 2 * M * n * h + 2 * (B * n * h + 2 * S * n) + B * n * h + 2 * B * n * f_t
    qkv = 3 * B * n * h_t
    if real_tokens_bert(cfg):
        if m.recompute == "selective":  # the checkpoint's inputs Q, K, V (the sample ids: _bert_shared); the context
            return layer_input + qkv + B * n * h_t + rest
        return layer_input + _bert_core(cfg, kernels, b, h_t, a_t, B) + rest
    if m.recompute == "selective":
        context = B * n * h_t
        return layer_input + qkv + B * b * s + context + rest
    core = _attention_core(kernels, b, s, n, h_t, a_t, B, m.attention_dropout > 0)
    return layer_input + qkv + core + rest


def embedding_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels) -> int:
    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    b, s, h = micro, cfg.data.seq_length, m.hidden_size
    n = b * s
    M = 0 if m.hidden_dropout == 0 else (kernels.mask_bytes or B)
    S = kernels.stat_bytes or B
    if m.modern:  # the input ids only (no token types, no positions), the TP lookup's range mask, the
        # real tokens' indices (unpadding: one spare slot), LayerNorm's input and statistics, the dropout's mask
        return 8 * n + (n if tp > 1 else 0) + 8 * (n + 1) + B * n * h + 2 * S * n + M * n * h
    if real_tokens_bert(cfg):  # the input ids, the TP lookup's range mask, the real tokens' indices
        # (one spare slot), the positions' and token types' indices of the real tokens
        ids = 8 * n + (n if tp > 1 else 0) + 8 * (n + 1) + 16 * n
        return ids + B * n * h + 2 * S * n + M * n * h
    ids = 16 * n + (n if tp > 1 else 0)  # input and token-type ids (int64); the TP lookup's range mask
    return ids + 8 * s + B * n * h + 2 * S * n + M * n * h


def heads_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels) -> int:
    """Heads at the masked positions, the tied decoder, the output bias and the loss."""
    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    b, s, h = micro, cfg.data.seq_length, m.hidden_size
    n, p = b * s, b * cfg.data.max_predictions()
    S = kernels.stat_bytes or B
    v_t = m.padded_vocab_size(tp) // tp
    if m.modern:  # index_select at the masked positions keeps its index only; final_norm's input
        # and statistics at P rows, then the transform as BERT's
        heads = 8 * p + B * p * h + 2 * S * p
    elif real_tokens_bert(cfg):  # index keeps the masked positions only; the [CLS] rows are a copy
        heads = 8 * p + ((8 * b + B * b * h) if cfg.binary_head else 0)
    else:
        heads = 8 * p + B * n * h  # the gather's index and input (the last layer's output)
    heads += 4 * B * p * h + 2 * S * p  # MLM transform: dense input, GELU input, LayerNorm input/output, stats
    heads += v_t  # MlmOutputBias.is_padding (bool)
    # cross entropy (pretrain/model/cross_entropy.py), both forms keeping the local targets and whether
    # they are in range: compiled, the logits as the model output them and each row's fp32 maximum
    # and sum of exponentials; eager, megatron's fp32 softmax
    loss = (B * p * v_t + 8 * p if kernels.compiled else 4 * p * v_t) + 8 * p + p
    loss += 4 * p + 4  # masked weights, the scale
    if cfg.binary_head:
        heads += B * b * h  # pooled tanh
        loss += 16 * b + 4  # NSP log-softmax (fp32, 2 classes), labels, weight
    return heads + loss


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B."""
    return min(stages - stage, micro_batches)


def context_share(cfg, cp: int):
    """`cfg` as one CP rank's activations see it, for an estimate: rows of seq_length / cp tokens
    (the rank's share; context_kv_bytes adds what it gathers from the others)."""
    out = copy.copy(cfg)
    out.data = copy.copy(cfg.data)
    out.data.seq_length = -(-cfg.data.seq_length // cp)
    return out


def context_kv_bytes(cfg, tp: int, cp: int, micro: int, precision: str, layers: range) -> int:
    """What a CP rank keeps beyond its share for backward: the keys and values of the other ranks'
    shares that each global layer gathers (context_parallel.py's checkpointed blocks keep them).
    ModernBERT's ring attention keeps none of those, but its own share's keys and values and its
    float32 context (ring_attention.py)."""
    m = cfg.model
    if m.modern and cfg.parallel.context_attention == "ring":
        global_layers = sum(1 for i in layers if m.is_global_layer(i))
        share = micro * -(-cfg.data.seq_length // cp)
        return global_layers * share * (m.hidden_size // tp) * (2 * {"fp32": 4, "bf16": 2, "fp16": 2}[precision] + 4)
    global_layers = sum(1 for i in layers if not m.modern or m.is_global_layer(i))  # BERT's are all global
    others = micro * cfg.data.seq_length * (cp - 1) // cp
    return global_layers * 2 * others * (m.hidden_size // tp) * {"fp32": 4, "bf16": 2, "fp16": 2}[precision]


def context_scores_bytes(cfg, tp: int, cp: int, micro: int, precision: str, kernels: Kernels, layers: int) -> int:
    """BERT under CP: what its layers' attention cores keep beyond a share-by-share estimate (each
    rank's queries attend the whole row's keys: scores [share x row], not [share x share])."""
    m = cfg.model
    if m.modern or cp == 1 or m.recompute in ("full", "selective"):
        return 0  # ModernBERT's blocks keep no scores; recomputation keeps no core
    B = 2 if precision in ("bf16", "fp16") else 4
    share = -(-cfg.data.seq_length // cp)
    args = (kernels, micro, share, micro * share, m.hidden_size // tp, m.num_attention_heads // tp, B,
            m.attention_dropout > 0)
    return layers * (_attention_core(*args, keys=cfg.data.seq_length) - _attention_core(*args))


def stage_activation_bytes(cfg, tp: int, stage: int, stages: int, layers: int, first: bool, last: bool,
                           micro: int, micro_batches: int, precision: str, kernels: Kernels,
                           first_layer: int | None = None) -> int:
    """The peak bytes autograd holds on one rank of `stage`; `first_layer` the number of its first
    transformer layer (ModernBERT; None: `stage * layers`, pipeline stages of equal layer counts)."""
    m = cfg.model
    if m.modern:  # layers differ by kind (global or local); a stage holds a contiguous run of them
        first_layer = stage * layers if first_layer is None else first_layer
        per_micro = sum(layer_bytes(cfg, tp, micro, precision, kernels, i)
                        for i in range(first_layer, first_layer + layers))
    else:
        per_micro = layers * layer_bytes(cfg, tp, micro, precision, kernels)
    if m.modern:
        first_layer = stage * layers if first_layer is None else first_layer
        per_micro += _modern_shared(cfg, tp, micro, precision, kernels, range(first_layer, first_layer + layers))
    elif real_tokens_bert(cfg):
        per_micro += _bert_shared(cfg, micro, precision, kernels)
    elif m.recompute == "full":
        per_micro += 8 * micro * cfg.data.seq_length  # the padding mask, one storage for every layer
    if first:
        per_micro += embedding_bytes(cfg, tp, micro, precision, kernels)
    if last:
        per_micro += heads_bytes(cfg, tp, micro, precision, kernels)
    return in_flight(stage, stages, micro_batches) * per_micro
