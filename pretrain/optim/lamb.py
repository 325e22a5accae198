"""LAMB (You et al. 2019, Algorithm 2; the NVLAMB variant) with layout-exact trust ratios.

Per element:   m = b1 m + (1-b1) g          v = b2 v + (1-b2) g^2
               u = m_hat / (sqrt(v_hat) + eps) + wd * w     (decoupled weight decay)
Per logical parameter:  r = ||w|| / ||u||  (1 if either norm is 0; optionally <= max_trust_ratio)
               w -= lr * r * u

The norms are those of the WHOLE logical parameter.  Under tensor parallelism or ZeRO the
optimizer only sees pieces of it; a `NormLayout` (see layout.py) says which piece of which
logical parameter every stepped tensor holds, and one pair of vector all-reduces per step
assembles the full sums.  Gradient clipping is not done here: DeepSpeed clips the global
gradient norm before calling step().
"""

from __future__ import annotations

import torch

from ..device import all_reduce
from .layout import NormLayout, Segment


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return torch.dot(x, x)


class Lamb(torch.optim.Optimizer):
    """Param-group keys: lr, betas, eps, weight_decay, layer_adaptation (False fixes the trust
    ratio to 1, for biases and LayerNorm), max_trust_ratio (None = no clamp), bias_correction.
    State per tensor: step, exp_avg, exp_avg_sq (the names DeepSpeed checkpoints know from Adam)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 max_trust_ratio=None, bias_correction=True):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if max_trust_ratio is not None and max_trust_ratio <= 0:
            raise ValueError(f"Lamb: max_trust_ratio must be > 0 or None, got {max_trust_ratio}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        layer_adaptation=True, max_trust_ratio=max_trust_ratio,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)
        self._layout: NormLayout | None = None

    def set_layout(self, layout: NormLayout | None) -> None:
        """Tell the optimizer how its tensors map onto logical parameters (None = every tensor
        is a whole parameter, no collectives)."""
        self._layout = layout

    @torch.no_grad()
    def _adam_direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Advance m, v and the step counter; return the flat update direction u."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Lamb does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            bc1 = 1 - beta1 ** state["step"]
            bc2 = 1 - beta2 ** state["step"]
        else:
            bc1 = bc2 = 1.0
        u = (m / bc1) / (v / bc2).sqrt_().add_(group["eps"])
        if group["weight_decay"] != 0:
            u.add_(p, alpha=group["weight_decay"])
        return u.reshape(-1)

    def _device(self, work) -> torch.device:
        """Device for the norm vectors (the collectives need the backend's device)."""
        if work:
            return work[0][0].device
        entries = self._layout.entries() if self._layout is not None else []
        return entries[0][0].device if entries else torch.device("cpu")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # 1. Elementwise update direction for every tensor with a gradient, and the segments
        #    (logical parameter pieces) it holds.
        work = []  # (param, group, flat update, segments)
        implicit = 0  # without a layout each tensor is its own logical parameter
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self._layout is None:
                    segments = [Segment(implicit, 0, p.numel())] if p.numel() else []
                    implicit += 1
                else:
                    segments = self._layout.segments_for(p)
                work.append((p, group, self._adam_direction(p, group), segments))

        # 2. Per-logical-parameter partial sums of w^2 and u^2, gathered into one (2, n)
        #    float64 tensor so that adding the pieces does not depend on how they were cut.
        layout = self._layout
        n = implicit if layout is None else layout.num_logical
        device = self._device(work)
        index, w_sq, u_sq = [], [], []
        for p, group, u, segments in work:
            if not group["layer_adaptation"]:
                continue  # ratio fixed to 1: its norms are never read
            w = p.detach().reshape(-1)
            for seg in segments:
                index.append(seg.logical_index)
                w_sq.append(_sum_sq(w.narrow(0, seg.start, seg.numel)))
                u_sq.append(_sum_sq(u.narrow(0, seg.start, seg.numel)))
        sums = torch.zeros(2, n, dtype=torch.float64, device=device)
        if index:
            pieces = torch.stack([torch.stack(w_sq), torch.stack(u_sq)]).to(torch.float64)
            sums.index_add_(1, torch.tensor(index, device=device), pieces)

        # 3. Whole-parameter sums: add the pieces held by other DP ranks (ZeRO), then the other
        #    TP shards of sharded parameters only (a replicated parameter is already whole on
        #    every TP rank).  Two vector collectives per step, not one per parameter; they run
        #    even when this rank holds nothing, so that every rank issues the same ones.
        #    On the model's device: under optimizer offload the stepped tensors are on the CPU,
        #    where an NCCL group cannot reduce.
        if layout is not None and layout.comm_device is not None:
            sums = sums.to(layout.comm_device)
        if layout is not None and layout.dp_group is not None:
            all_reduce(sums, layout.dp_group)
        if layout is not None and layout.tp_group is not None:
            mask = torch.tensor(layout.tp_sharded, dtype=torch.bool, device=sums.device)
            sharded = all_reduce(torch.where(mask, sums, torch.zeros_like(sums)), layout.tp_group)
            sums = torch.where(mask, sharded, sums)

        w_norm, u_norm = sums.sqrt().tolist()

        # 4. Apply each logical parameter's ratio to its segments; elements outside every
        #    segment (ZeRO alignment padding) are left untouched.
        for p, group, u, segments in work:
            flat = p.data.view(-1) if p.data.is_contiguous() else None
            target = flat if flat is not None else p.data.reshape(-1).clone()
            for seg in segments:
                ratio = 1.0
                if group["layer_adaptation"]:
                    wn, un = w_norm[seg.logical_index], u_norm[seg.logical_index]
                    ratio = wn / un if wn > 0 and un > 0 else 1.0
                    if group["max_trust_ratio"] is not None:
                        ratio = min(ratio, group["max_trust_ratio"])
                target.narrow(0, seg.start, seg.numel).add_(u.narrow(0, seg.start, seg.numel),
                                                            alpha=-group["lr"] * ratio)
            if flat is None:
                p.data.copy_(target.view_as(p))
        return loss
