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

import math

import torch

from ..distributed.device import to_device_async
from .fused import compiled_lamb_direction
from .whole_parameter import WholeParameterOptimizer, flat_target, write_back


class Lamb(WholeParameterOptimizer):
    """Param-group keys: lr, betas, eps, weight_decay, layer_adaptation (False fixes the trust
    ratio to 1, for biases and LayerNorm), max_trust_ratio (None = no clamp), bias_correction.
    State per tensor: step, exp_avg, exp_avg_sq (the names DeepSpeed checkpoints know from Adam).
    fused: the Adam direction as one compiled kernel per tensor (fused.py) instead of nine
    multi-tensor sweeps; the caller checks that torch can compile for the device."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 max_trust_ratio=None, bias_correction=True, fused=False):
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
        self.fused = bool(fused)

    @torch.no_grad()
    def _adam_directions(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Advance m, v and the step counters of `params` (multi-tensor); their flat update
        directions u (the module docstring's formula, rearranged for fewer sweeps)."""
        self._advance_states(params, group)
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        beta1, beta2 = group["betas"]
        if self.fused:
            return self._fused_directions(params, grads, m, v, group)
        # Each foreach call below is one sweep over every stepped element, and an optimizer's cost
        # is its memory traffic: the formula is arranged for 9 sweeps with weight decay (11 written
        # term by term) and one full-size temporary, u itself:
        #   m = lerp(m, g, 1-b1)                          (= b1 m + (1-b1) g)
        #   u = 1 / (sqrt(v) * bc1/sqrt(bc2) + eps * bc1)  (= 1 / (bc1 (sqrt(v_hat) + eps)))
        #   u = u * m + wd w                               (= m_hat / (sqrt(v_hat) + eps) + wd w)
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        steps = [self.state[p]["step"] for p in params]  # host integers: no device sync
        if group["bias_correction"]:
            bc1 = [1 - beta1 ** step for step in steps]
            bc2 = [1 - beta2 ** step for step in steps]
        else:
            bc1 = bc2 = [1.0] * len(params)
        updates = torch._foreach_sqrt(v)
        torch._foreach_mul_(updates, [c1 / math.sqrt(c2) for c1, c2 in zip(bc1, bc2)])
        torch._foreach_add_(updates, [group["eps"] * c1 for c1 in bc1])
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, m)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        return [u.reshape(-1) for u in updates]

    def _fused_directions(self, params, grads, m, v, group) -> list[torch.Tensor]:
        """The same directions, one compiled kernel per tensor (fused.py)."""
        beta1, beta2 = group["betas"]
        direction = compiled_lamb_direction()
        out, coefficients = [], {}
        for p, g, m_p, v_p in zip(params, grads, m, v):
            step = self.state[p]["step"]
            c1, c2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
            key = (p.device, c1, c2)
            if key not in coefficients:  # one small copy per distinct step count, not per tensor, never waiting
                values = torch.tensor([1 - beta1, beta2, 1 - beta2, c1 / math.sqrt(c2), group["eps"] * c1,
                                       group["weight_decay"]], dtype=torch.float32)
                coefficients[key] = to_device_async(values, p.device)
            # flat, and detached from any base they are views of (ZeRO's partitions of flat buffers):
            # torch guards a view on its base's sizes, which would compile a graph per tensor kind
            w, g, m_p, v_p = (t.view(-1).detach() if t.is_contiguous() else t for t in (p, g, m_p, v_p))
            out.append(direction(w, g, m_p, v_p, coefficients[key]).reshape(-1))
        return out

    def _update(self) -> None:
        # 1. Elementwise update direction for every tensor with a gradient (one multi-tensor
        #    pass per group), and the segments (logical parameter pieces) it holds.
        work, n, device = self._collect(self._adam_directions)

        # 2. Per-logical-parameter partial sums of w^2 and u^2, gathered into one (2, n)
        #    float64 tensor so that adding the pieces does not depend on how they were cut.
        index, w_pieces, u_pieces = [], [], []
        for p, group, u, segments in work:
            if not group["layer_adaptation"]:
                continue  # ratio fixed to 1: its norms are never read
            w = p.detach().reshape(-1)
            for seg in segments:
                index.append(seg.logical_index)
                w_pieces.append(w.narrow(0, seg.start, seg.numel))
                u_pieces.append(u.narrow(0, seg.start, seg.numel))
        sums = torch.zeros(2, n, dtype=torch.float64, device=device)
        if index:
            # one multi-tensor launch per side, not one dot product per segment
            norms = torch.stack([torch.stack(torch._foreach_norm(w_pieces)), torch.stack(torch._foreach_norm(u_pieces))])
            positions = self._on(device, ("index", *index), lambda: torch.tensor(index))
            sums.index_add_(1, positions, norms.to(torch.float64).square())

        # 3. Whole-parameter sums (whole_parameter.py: over DP, then TP for sharded parameters)
        sums = self._whole_parameter_sums(sums, device)

        # 4. Trust ratios on the device (no host sync): r = ||w|| / ||u|| per logical parameter,
        #    1 if either norm is 0; clamped per group; 1 where the group has no layer adaptation.
        w_norm, u_norm = sums.sqrt()
        ratios = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        targets, directions, segment_index, adapt, ceiling, rates = [], [], [], [], [], []
        copy_back = []
        for p, group, u, segments in work:
            target = flat_target(p, copy_back)
            for seg in segments:  # elements outside every segment (ZeRO padding) stay untouched
                targets.append(target.narrow(0, seg.start, seg.numel))
                directions.append(u.narrow(0, seg.start, seg.numel))
                segment_index.append(seg.logical_index)
                adapt.append(bool(group["layer_adaptation"]))
                ceiling.append(float("inf") if group["max_trust_ratio"] is None else group["max_trust_ratio"])
                rates.append(-group["lr"])
        if targets:
            key = (tuple(segment_index), tuple(adapt), tuple(ceiling))
            seg_ratio = ratios[self._on(device, ("segments", key), lambda: torch.tensor(segment_index))]
            seg_ratio = torch.minimum(seg_ratio, self._on(device, ("ceiling", key),
                                                          lambda: torch.tensor(ceiling, dtype=torch.float64)))
            seg_ratio = torch.where(self._on(device, ("adapt", key), lambda: torch.tensor(adapt)), seg_ratio,
                                    torch.ones_like(seg_ratio))
            # The learning rate goes in as `alpha` (a host number), once per distinct rate: a tensor
            # of rates copied to a GPU would wait for the GPU to finish the backward pass.
            # u *= ratio in place (segments never overlap), then w += rate * u: no temporary
            torch._foreach_mul_(directions, list(seg_ratio.float().unbind()))
            for rate in dict.fromkeys(rates):
                chosen = [j for j, r in enumerate(rates) if r == rate]
                torch._foreach_add_([targets[j] for j in chosen], [directions[j] for j in chosen], alpha=rate)
        write_back(copy_back)
