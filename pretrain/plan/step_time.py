"""A step's predicted time at a layout: the matrix products of each rank's share of the model,
the pipeline's bubble, and the tensor-, pipeline- and data-parallel traffic over the links it
takes.

The model (each term named in `StepTime`):
- compute: per micro-batch, the stage's transformer layers (their matrix products split over
  TP, three times the forward for forward + backward, plus what recomputation runs again: the
  whole layer forward with `full`, the attention core with `selective`) and, on the last stage,
  the heads (pooler and MLM transform replicated over TP, the vocabulary projection split),
  at the device's matrix-product FLOP/s for the precision; their element-wise work
  (layer_elementwise_bytes: LayerNorms, dropouts and residuals are replicated over TP) at the
  device's memory bandwidth; and a fixed time per layer and micro-batch (kernel launches);
- tp: Megatron's all-reduces of [micro, seq, hidden] activations, 2 per layer in forward, 2 in
  backward, 2 more with full recomputation, and the vocabulary-parallel embedding's 1;
- pp: one activation forward and one gradient backward per micro-batch per stage boundary;
  with 1F1B the step is (micro-batches + stages - 1) times the slowest stage's micro-batch;
- optimizer: the step's reads and writes of weights, gradients and moments (OPTIMIZER_BYTES per
  element this rank steps, by optimizer: all of its stage's with ZeRO-0, 1/DP of them with ZeRO
  1-3) over the device's memory bandwidth;
- dp: DeepSpeed's gradient traffic, none of it assumed hidden behind backward: ZeRO-0 and
  ZeRO-1 reduce once per step (ZeRO-1 then all-gathers the updated parameters), ZeRO-2
  reduce-scatters every micro-batch's gradients, ZeRO-3 also gathers the parameters in every
  micro-batch's forward and backward.
A collective of n bytes over g ranks moves 2(g-1)/g n (all-reduce) or (g-1)/g n (reduce-scatter,
all-gather) per rank, over the node's links when the group stays inside one node and over the
network otherwise (DeepSpeed's rank topology: tensor-parallel ranks adjacent, then data, then
pipeline).
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ..model.flops import attention_core_forward_flops, encoder_forward_flops, mlm_forward_flops, pooler_forward_flops
from .layouts import Layout

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Hardware:
    """What step times are predicted from (per device)."""

    gpus_per_node: int
    flops: dict  # precision -> achievable matrix-product FLOP/s of one device
    intra_node_bandwidth: float  # bytes/s one device moves in a collective inside a node
    inter_node_bandwidth: float  # bytes/s one device moves across nodes
    memory_bandwidth: float = 1.5e12  # bytes/s the device's element-wise work moves
    optimizer_bandwidth: float | None = None  # bytes/s of the optimizer step (None: memory_bandwidth)
    latency: float = 20e-6  # seconds per collective or message
    layer_overhead: float = 0.0  # seconds per layer and micro-batch beyond its FLOPs (fwd + bwd)
    device_type: str = "cuda"  # what optimizer.fused "auto" resolves for


# bytes the optimizer step reads and writes per fp32 element it steps. Fused AdamW reads the weight,
# gradient and both moments and writes weight and moments (7 x 4); LAMB eager runs nine sweeps for
# its Adam direction (88) and three for the norms, the trust ratio and the update (28); compiled
# (optimizer.fused) the direction is one pass (28 + 28). StableAdamW's eager sweeps are counted as
# LAMB's. On an H100, LAMB's 88 bytes more than AdamW's predict 9.9 ms of the 15 ms the steps differ
# by at BERT-large (calibration.py).
OPTIMIZER_BYTES = {"adamw": 28, "lamb": 116, "lamb_fused": 56, "stable_adamw": 116}


def optimizer_bytes_per_element(optimizer_cfg, device_type: str) -> int:
    """OPTIMIZER_BYTES of the config's optimizer on `device_type` (optimizer.fused resolved there)."""
    from ..config.choices import compile_enabled

    if optimizer_cfg.name == "lamb" and compile_enabled(optimizer_cfg.fused, device_type):
        return OPTIMIZER_BYTES["lamb_fused"]
    return OPTIMIZER_BYTES[optimizer_cfg.name]


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds of matrix products (and per-layer overhead) on the slowest stage
    bubble: float  # the pipeline's fill and drain
    tp: float
    pp: float
    dp: float
    optimizer: float  # the optimizer step over the elements this rank steps

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.pp + self.dp + self.optimizer


def layer_elementwise_bytes(model_cfg, seq_length: int, tp: int, precision: str, recompute: str) -> float:
    """Bytes one layer's element-wise work reads and writes for one row, forward + backward (about
    twice the forward's), and what recomputation repeats. Per token, forward: the replicated part,
    which tensor parallelism does not split (2 LayerNorms, 2 dropouts, 2 residual additions: about
    20 passes over h), and the split one (GELU over ffn/TP, softmax and dropout over the local
    heads' scores: about 6 passes over heads/TP x seq)."""
    s, h, f, a = seq_length, model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.num_attention_heads
    scores = 6 * a / tp * s * s
    forward = BYTES[precision] * (20 * s * h + 2 * s * f / tp + scores)
    again = {"full": forward, "selective": BYTES[precision] * scores}.get(recompute, 0.0)
    return 3 * forward + again


def _spans_nodes(ranks: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def _group_bandwidth(topology, axis: str, hw: Hardware) -> float:
    groups = topology.get_axis_comm_lists(axis)
    crosses = any(_spans_nodes(group, hw.gpus_per_node) for group in groups)
    return hw.inter_node_bandwidth if crosses else hw.intra_node_bandwidth


def _all_reduce(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    return 0.0 if ranks == 1 else 2 * (ranks - 1) / ranks * nbytes / bandwidth + latency


def _one_way(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """A reduce-scatter or all-gather of `nbytes` (the whole tensor) over `ranks`."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * nbytes / bandwidth + latency


def predict_step_time(cfg, layout: Layout, hw: Hardware, stage_numels: list[int], grad_bytes: int) -> StepTime:
    """`cfg` at `layout` (Layout.apply'd); `stage_numels`: each stage's parameter elements on one
    TP rank (shapes.stage_parameters); `grad_bytes`: bytes per gradient element reduced over DP."""
    m, d = cfg.model, cfg.data
    t, pp, dp = layout.tp, layout.pp, layout.dp
    micro, seq, hidden = layout.micro_batch, d.seq_length, m.hidden_size
    micro_batches = cfg.train.global_batch_size // (micro * dp)
    flops_per_second = hw.flops[layout.precision]
    act = BYTES[layout.precision]
    cp = layout.cp  # each CP rank computes its share of every row's tokens (and of its attention)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=t, num_dp=dp * cp)

    layers = m.num_layers // pp
    # the slowest stage's layers (ModernBERT's global layers cost more than its windowed ones)
    per_layer = max(3 * encoder_forward_flops(m, seq, range(p * layers, (p + 1) * layers)) for p in range(pp)) / layers
    if layout.recompute == "full":
        per_layer += encoder_forward_flops(m, seq) / m.num_layers
    elif layout.recompute == "selective":
        per_layer += sum(attention_core_forward_flops(m, seq, i) for i in range(m.num_layers)) / m.num_layers
    encoder = layers * micro * per_layer / t / cp
    elementwise = layers * micro * layer_elementwise_bytes(m, seq, t, layout.precision, layout.recompute) / cp
    vocab = m.padded_vocab_size(t)
    pooler = pooler_forward_flops(m) if cfg.binary_head else 0.0
    # the transform is replicated over TP, the vocabulary projection split
    mlm = d.max_predictions() * mlm_forward_flops(m, vocab // t)
    heads = 3 * micro * (pooler + mlm)
    softmax = 3 * 4 * 4 * micro * d.max_predictions() * (vocab // t)  # the loss's fp32 passes over the logits
    # the slowest stage: every stage has as many layers, the last one the heads too
    per_micro = ((encoder + heads) / flops_per_second + (elementwise + softmax) / hw.memory_bandwidth
                 + hw.layer_overhead * layers)

    activation = micro * seq * hidden * act / cp
    tp_bw = _group_bandwidth(topology, "model", hw)
    collectives = 4 * layers + (2 * layers if layout.recompute == "full" else 0) + 1
    tp_per_micro = collectives * _all_reduce(activation, t, tp_bw, hw.latency)
    if cp > 1:  # global layers gather every share's keys and values (and reduce their gradients back);
        # local layers' halos are small. Counted with TP's communication, over the data group's bandwidth
        global_layers = sum(1 for i in range(layers) if not m.modern or m.is_global_layer(i))
        kv = 2 * micro * seq * hidden * act / t
        tp_per_micro += global_layers * 2 * _one_way(kv, cp, _group_bandwidth(topology, "data", hw), hw.latency)

    pp_per_micro = 0.0
    if pp > 1:
        pp_bw = _group_bandwidth(topology, "pipe", hw)
        pp_per_micro = 2 * (activation / pp_bw + hw.latency)

    slots = micro_batches + pp - 1  # 1F1B: fill, steady state, drain
    compute = micro_batches * per_micro
    bubble = (pp - 1) * per_micro
    tp = slots * tp_per_micro
    pp_time = slots * pp_per_micro

    dp_bw = _group_bandwidth(topology, "data", hw)
    dp = dp * cp  # gradients average over context x data
    numel = max(stage_numels)
    grads, params = numel * grad_bytes, numel * act
    if layout.zero == 0:
        dp_time = _all_reduce(grads, dp, dp_bw, hw.latency)
    elif layout.zero == 1:
        dp_time = _one_way(grads, dp, dp_bw, hw.latency) + _one_way(params, dp, dp_bw, hw.latency)
    elif layout.zero == 2:
        dp_time = micro_batches * _one_way(grads, dp, dp_bw, hw.latency) + _one_way(params, dp, dp_bw, hw.latency)
    else:
        dp_time = micro_batches * (2 * _one_way(params, dp, dp_bw, hw.latency) + _one_way(grads, dp, dp_bw, hw.latency))
    stepped = numel / dp if layout.zero > 0 else numel
    optimizer = (optimizer_bytes_per_element(cfg.optimizer, hw.device_type) * stepped
                 / (hw.optimizer_bandwidth or hw.memory_bandwidth))
    return StepTime(compute, bubble, tp, pp_time, dp_time, optimizer)
