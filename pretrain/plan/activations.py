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
mask V_t, the vocabulary-parallel cross entropy's fp32 softmax 4*P*V_t and its index tensors,
NSP's pooled tanh and log-softmax.

Derived from the saved tensors of each op (their autograd formulas; CUDA's SDPA from torch's
sources and meta kernels) and checked byte for byte against the meter on the CPU and fakegpu;
tests/test_memory_plan.py keeps it there.
"""
from __future__ import annotations

from dataclasses import dataclass


def _ceil(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class Kernels:
    """What a device's kernels save, where that differs between devices."""

    attention: str  # "spelled" (CPU with attention dropout), "cpu_flash", "efficient", "math"
    mask_bytes: int | None  # a dropout mask element; None: the activation dtype's size
    stat_bytes: int | None  # a LayerNorm mean/rstd element; None: the activation dtype's size
    upcast_bf16: bool = False  # CPU bf16 GEMMs run as fp32 ones (pretrain/model/cpu_bf16.py)


def kernels_for(device_type: str, attention_dropout: float, precision: str) -> Kernels:
    """The kernels a run on `device_type` ("cpu", "cuda", "fakegpu") uses."""
    if device_type == "cuda":
        return Kernels("efficient", 1, 4)
    if device_type == "fakegpu":  # the GPU code path on the CPU's kernels
        return Kernels("math", 1, None)
    upcast = False
    if precision == "bf16":
        from ..model.cpu_bf16 import bf16_route

        upcast = bf16_route() == "fp32"
    return Kernels("spelled" if attention_dropout > 0 else "cpu_flash", None, None, upcast)


def _attention_core(k: Kernels, b: int, s: int, n: int, h_t: int, a_t: int, B: int, dropout: bool) -> int:
    """The bytes of the attention core beyond Q, K, V (none recomputed), and the context."""
    if k.attention == "efficient":
        return B * b * _ceil(s, 8) + B * n * h_t + 4 * b * a_t * _ceil(s, 32) + 16
    if k.attention == "math":
        probabilities = (2 * 4 + 1) * b * a_t * s * s if dropout else 4 * b * a_t * s * s
        return 3 * (4 - B) * n * h_t + probabilities + B * n * h_t  # Q, K, V upcast to fp32 (beyond B)
    wide = 4 if k.upcast_bf16 else B  # the fp32 route attends on fp32 copies
    qkv_extra = 3 * (wide - B) * n * h_t
    if k.attention == "spelled":
        return qkv_extra + 3 * wide * b * a_t * s * s + B * n * h_t
    # cpu_flash: its output is laid out [b, s, heads, d], so the context is a view of it
    return qkv_extra + wide * b * s + wide * n * h_t + 4 * b * a_t * s


def layer_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels) -> int:
    """One transformer layer, one micro-batch (unpacked rows)."""
    m = cfg.model
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
    ids = 16 * n + (n if tp > 1 else 0)  # input and token-type ids (int64); the TP lookup's range mask
    return ids + 8 * s + B * n * h + 2 * S * n + M * n * h


def heads_bytes(cfg, tp: int, micro: int, precision: str, kernels: Kernels) -> int:
    """Heads at the masked positions, the tied decoder, the output bias and the loss."""
    m = cfg.model
    B = 2 if precision in ("bf16", "fp16") else 4
    b, s, h = micro, cfg.data.seq_length, m.hidden_size
    n, p = b * s, b * cfg.data.max_predictions_per_seq
    S = kernels.stat_bytes or B
    v_t = m.padded_vocab_size(tp) // tp
    heads = 8 * p + B * n * h  # the gather's index and input (the last layer's output)
    heads += 4 * B * p * h + 2 * S * p  # MLM transform: dense input, GELU input, LayerNorm input/output, stats
    heads += v_t  # MlmOutputBias.is_padding (bool)
    loss = 4 * p * v_t + p + 8 * p  # cross entropy: fp32 softmax, target mask, targets
    loss += 4 * p + 4  # masked weights, the scale
    if cfg.binary_head:
        heads += B * b * h  # pooled tanh
        loss += 16 * b + 4  # NSP log-softmax (fp32, 2 classes), labels, weight
    return heads + loss


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B."""
    return min(stages - stage, micro_batches)


def stage_activation_bytes(cfg, tp: int, stage: int, stages: int, layers: int, first: bool, last: bool,
                           micro: int, micro_batches: int, precision: str, kernels: Kernels) -> int:
    """The peak bytes autograd holds on one rank of `stage`."""
    per_micro = layers * layer_bytes(cfg, tp, micro, precision, kernels)
    if cfg.model.recompute == "full":
        per_micro += 8 * micro * cfg.data.seq_length  # the padding mask, one storage for every layer
    if first:
        per_micro += embedding_bytes(cfg, tp, micro, precision, kernels)
    if last:
        per_micro += heads_bytes(cfg, tp, micro, precision, kernels)
    return in_flight(stage, stages, micro_batches) * per_micro
