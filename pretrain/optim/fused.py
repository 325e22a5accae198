"""LAMB's element-wise pass as one generated kernel per stepped tensor (`optimizer.fused`).

An optimizer step is memory-bound: its cost is the bytes it moves. Eager, LAMB's Adam direction
is nine multi-tensor sweeps (lamb.py), 88 bytes read and written per fp32 element; fused
AdamW moves 28. Compiled, the same formula is one kernel that reads w, g, m and v once and writes
m, v and the direction u (28 bytes), so LAMB's extra cost over AdamW is only what LAMB adds: the
per-parameter norms of w and u and the scaled update (lamb.py, steps 2-4).

torch.compile with dynamic shapes: one compilation serves every tensor size (ZeRO-0's parameters
one by one, ZeRO's flat partitions), and the step-dependent coefficients (bias corrections) come
in as a small tensor, never as Python numbers a graph would be specialised on, so no step
recompiles. The eager formula stays the reference: tests/test_lamb.py runs both against a plain
whole-tensor LAMB, in one process and at every layout and ZeRO stage.
"""
from __future__ import annotations

import functools

import torch


def lamb_direction(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                   coefficients: torch.Tensor) -> torch.Tensor:
    """m and v advanced in place; the direction u = m / (sqrt(v) * step_scale + eps_scale) + wd * w.
    `coefficients` (fp32, on the tensors' device): 1 - beta1, beta2, 1 - beta2, step_scale =
    bc1 / sqrt(bc2), eps_scale = eps * bc1, wd (so u = m_hat / (sqrt(v_hat) + eps) + wd w)."""
    one_minus_beta1, beta2, one_minus_beta2, step_scale, eps_scale, weight_decay = coefficients.unbind()
    m.lerp_(g, one_minus_beta1)
    v.mul_(beta2).addcmul_(g, g, value=one_minus_beta2)
    return m / (v.sqrt() * step_scale + eps_scale) + weight_decay * w


@functools.cache
def compiled_lamb_direction():
    """The compiled lamb_direction, made once per process (the first call compiles)."""
    return torch.compile(lamb_direction, dynamic=True)
