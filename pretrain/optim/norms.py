"""Whole-model norms in any layout: which logical parameters a rank counts, and exact global
gradient-norm clipping where the optimizer steps whole (TP-local) parameters (ZeRO-0).

Under ZeRO-1/2/3 and DeepSpeed's BF16_Optimizer, DeepSpeed's wrapper clips by a norm that counts
each parameter once in every layout (checked by tests/test_precision_matrix.py against the fp32
single-process norm). At ZeRO-0 it does not:
- fp32: the engine's own fp32 clipping counts replicated parameters only on model-parallel rank 0 of
  the whole pipe x tensor group, so later pipeline stages' LayerNorms and biases are left out,
  and it does not record the norm for get_global_grad_norm();
- fp16, and bf16 with bf16 accumulation (FP16_UnfusedOptimizer): the norm is taken over gradient
  tensors that carry no `tensor_model_parallel` attribute (deepspeed/moe/utils.py builds them from
  `p.grad`), so TP ranks > 0 drop their shards (deepspeed/runtime/utils.py get_weight_norm), and
  the tied word embedding counts twice under pipeline parallelism.
There `ExactClipping` takes over: DeepSpeed's clipping is switched off and ours runs inside the
client optimizer's step, on the gradients it is about to apply (fp32, reduced over data-parallel
ranks, the tied embedding's copies summed, fp16's loss scale already divided out).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from ..distributed import device, internals
from ..model.names import EMBEDDING_NAMES, LogicalParam, logical_parameters


def counted_once(model, parallel) -> Iterator[LogicalParam]:
    """Logical parameters of this rank that a whole-model sum must count: TP-replicated ones on
    TP rank 0 only, the tied word embedding on the first pipeline stage only."""
    for lp in logical_parameters(model):
        if lp.tp_partition_dim is None and parallel.tp_rank != 0:
            continue
        if parallel.pp_size > 1 and lp.hf_name in EMBEDDING_NAMES and not parallel.is_first_stage:
            continue
        yield lp


class ExactClipping:
    """Global gradient-norm clipping over whole (TP-local) gradients for the ZeRO-0 wrappers.

    `counted`: the model parameters whose gradients the norm sums (each logical parameter on one
    rank of its TP group and pipeline, see `counted_once`); `stepped`: (model parameter, tensor the
    optimizer steps) for every parameter, the tensor's .grad being what the optimizer will apply
    (the parameter itself at fp32, its fp32 copy under FP16_UnfusedOptimizer). Calling it clips in
    place and returns the norm before clipping (a device tensor: no host sync)."""

    def __init__(self, counted, stepped, parallel, max_norm: float):
        self.parallel = parallel
        self.max_norm = max_norm
        tensor_of = {id(param): tensor for param, tensor in stepped}
        self.counted = [tensor_of[id(param)] for param in counted if id(param) in tensor_of]
        self.stepped = [tensor for _, tensor in stepped]

    def norm(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=self.parallel.device)
        grads = [tensor.grad.detach() for tensor in self.counted if tensor.grad is not None]
        if grads:  # one multi-tensor kernel, not a dot product per tensor; fp32 per tensor, float64 across
            total += torch.stack(torch._foreach_norm(grads)).double().square().sum()
        device.all_reduce(total)  # over the world: every (context x) data-parallel replica holds the same gradients
        return (total / self.parallel.dp_cp_size).sqrt()

    def __call__(self) -> torch.Tensor:
        norm = self.norm()
        if self.max_norm > 0:
            # on the device, no host sync: a coefficient of exactly 1 leaves the gradients as they are
            coefficient = (self.max_norm / (norm + 1e-6)).clamp(max=1.0).float()
            torch._foreach_mul_([t.grad for t in self.stepped if t.grad is not None], coefficient)
        return norm


def exact_clipping_for(engine, counted, parallel, max_norm: float) -> ExactClipping | None:
    """ExactClipping for an engine whose DeepSpeed clipping is not exact (ZeRO-0), with DeepSpeed's
    own switched off; None where DeepSpeed's wrapper clips exactly itself. `counted`: see
    ExactClipping."""
    wrapper = internals.optimizer_wrapper(engine)
    if isinstance(wrapper, internals.WholeCopies):
        internals.disable_wrapper_clipping(engine)
        stepped = [(lp, hp) for lps, hps in zip(wrapper.model_groups, wrapper.fp32_copies) for lp, hp in zip(lps, hps)]
        return ExactClipping(counted, stepped, parallel, max_norm)
    if isinstance(wrapper, torch.optim.Optimizer):  # ZeRO-0 fp32: DeepSpeed steps the parameters themselves
        internals.replace_fp32_clipping(engine, lambda: None)
        stepped = [(p, p) for group in wrapper.param_groups for p in group["params"]]
        return ExactClipping(counted, stepped, parallel, max_norm)
    return None


def params_norm(model, parallel) -> float:
    """L2 norm of the whole logical model, each parameter counted once in any layout (a collective)."""
    total = torch.zeros((), dtype=torch.float64, device=parallel.device)
    for lp in counted_once(model, parallel):
        zero3 = internals.is_zero3_param(lp.param)
        if not zero3 and parallel.dp_cp_rank != 0:
            continue  # replicated over CP x DP; a ZeRO-3 partition is this rank's own
        tensor = internals.zero3_values(lp.param) if zero3 else lp.param
        total += tensor.detach().double().pow(2).sum()
    return math.sqrt(device.all_reduce(total).item())
