"""StableAdamW (Wortsman et al. 2023; torch-optimi's `StableAdamW`, ModernBERT's optimizer) with
layout-exact update clipping.

Per element, at step t with debiased betas  b_hat(t) = (b**t - b) / (b**t - 1):
               m = lerp(m, g, 1 - b1_hat)          v = b2_hat v + (1 - b2_hat) g^2
Per logical parameter (after v's update; the mean runs over the WHOLE parameter):
               rms = sqrt(mean(g^2 / max(v, eps^2)))        lr_t = lr / max(1, rms)
Then           w *= 1 - lr_t * wd          (decouple_lr: w *= 1 - (lr_t / max_lr) * wd)
               w -= lr_t * m / (sqrt(v) + eps)

The bias correction lives in the betas (no m_hat, v_hat), and the RMS term clips the update
Adafactor-style where the current gradient is large against its history, which is why the
reference advises against gradient clipping on top (optimizer.grad_clip defaults to off here).
`max_lr` defaults to `lr` at construction (the peak rate the schedule starts from); Kahan
summation of the weight update (`kahan_sum`) applies to bf16/fp16 tensors only, off by default.

As with LAMB (lamb.py), the per-parameter term must not depend on how TP sharding or ZeRO
partitioning cut the parameter: a `NormLayout` (layout.py) says which piece of which logical
parameter every stepped tensor holds, and one vector all-reduce over DP (and one over TP for
TP-sharded parameters) per step adds up the pieces' sums of g^2 / max(v, eps^2) and element
counts, ZeRO padding excluded.  No host sync: the clip factors stay on the device.
"""

from __future__ import annotations

import torch

from ..distributed.device import all_reduce
from .layout import NormLayout, Segment


def debias_beta(beta: float, step: int) -> float:
    """beta * (1 - beta**(t-1)) / (1 - beta**t): the EMA weight that makes m and v unbiased."""
    return (beta ** step - beta) / (beta ** step - 1)


class StableAdamW(torch.optim.Optimizer):
    """Param-group keys: lr, betas, eps, weight_decay, decouple_lr, max_lr (None: lr at
    construction when decouple_lr), kahan_sum.  Other keys (layer_adaptation) are ignored.
    State per tensor: step (a host int), exp_avg, exp_avg_sq (the names DeepSpeed checkpoints
    know from Adam), and kahan_comp for low-precision tensors with kahan_sum."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01,
                 decouple_lr=False, max_lr=None, kahan_sum=False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"StableAdamW: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"StableAdamW: betas must be in [0, 1), got {betas}")
        if decouple_lr and max_lr is None:
            max_lr = lr
        if max_lr is not None and max_lr <= 0:
            raise ValueError(f"StableAdamW: max_lr must be > 0 or None, got {max_lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decouple_lr=decouple_lr, max_lr=max_lr, kahan_sum=kahan_sum)
        super().__init__(params, defaults)
        self._layout: NormLayout | None = None
        self._constants: dict = {}  # index tensors of the layout, per device

    def set_layout(self, layout: NormLayout | None) -> None:
        """Tell the optimizer how its tensors map onto logical parameters (None = every tensor
        is a whole parameter, no collectives)."""
        self._layout = layout
        self._constants = {}

    def _on(self, device: torch.device, key: tuple, make) -> torch.Tensor:
        """A small index tensor that only changes with the layout: built once, kept on `device`."""
        cached = self._constants.get((device, key))
        if cached is None:
            cached = self._constants[(device, key)] = make().to(device)
        return cached

    @torch.no_grad()
    def _moments(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Advance step, m and v of `params`; return g^2 / max(v, eps^2) per tensor (flat)."""
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("StableAdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["kahan_sum"] and p.dtype in (torch.float16, torch.bfloat16):
                    state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
        beta1, beta2 = group["betas"]
        by_step: dict[int, list[int]] = {}  # host integers; one foreach pass per distinct step
        for i, p in enumerate(params):
            by_step.setdefault(self.state[p]["step"], []).append(i)
        for step, chosen in by_step.items():
            grads = [params[i].grad for i in chosen]
            m = [self.state[params[i]]["exp_avg"] for i in chosen]
            v = [self.state[params[i]]["exp_avg_sq"] for i in chosen]
            beta1_hat, beta2_hat = debias_beta(beta1, step), debias_beta(beta2, step)
            torch._foreach_lerp_(m, grads, 1 - beta1_hat)
            torch._foreach_mul_(v, beta2_hat)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2_hat)
        # g^2 / max(v, eps^2) in one full-size temporary per tensor
        ratios = torch._foreach_maximum([self.state[p]["exp_avg_sq"] for p in params], group["eps"] ** 2)
        torch._foreach_reciprocal_(ratios)
        grads = [p.grad for p in params]
        torch._foreach_mul_(ratios, grads)
        torch._foreach_mul_(ratios, grads)
        return [r.reshape(-1) for r in ratios]

    @staticmethod
    def _decay_rate(group: dict) -> float:
        """c in w *= 1 - c * (lr_t / lr): lr * wd, or lr * wd / max_lr with decouple_lr."""
        wd = group["weight_decay"]
        if wd == 0:
            return 0.0
        if not group["decouple_lr"]:
            return group["lr"] * wd
        if group["max_lr"] is None:
            raise ValueError("StableAdamW: a param group with decouple_lr needs max_lr (the peak learning rate)")
        return group["lr"] * wd / group["max_lr"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # 1. Moments, and the elementwise RMS terms of every tensor with a gradient.
        work = []  # (param, group, flat g^2/max(v, eps^2), segments)
        implicit = 0  # without a layout each tensor is its own logical parameter
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p, ratio in zip(params, self._moments(params, group)):
                if self._layout is None:
                    segments = [Segment(implicit, 0, p.numel())] if p.numel() else []
                    implicit += 1
                else:
                    segments = self._layout.segments_for(p)
                work.append((p, group, ratio, segments))

        # 2. Per-logical-parameter sums of g^2/max(v, eps^2) and element counts in one (2, n)
        #    float64 tensor; ZeRO padding lies outside every segment and is not counted.
        layout = self._layout
        n = implicit if layout is None else layout.num_logical
        if work:
            device = work[0][0].device
        else:
            entries = layout.entries() if layout is not None else []
            device = entries[0][0].device if entries else torch.device("cpu")
        index, pieces, counts = [], [], []
        for p, group, ratio, segments in work:
            for seg in segments:
                index.append(seg.logical_index)
                pieces.append(ratio.narrow(0, seg.start, seg.numel))
                counts.append(float(seg.numel))
        sums = torch.zeros(2, n, dtype=torch.float64, device=device)
        if index:
            key = tuple(zip(index, counts))
            positions = self._on(device, ("index", key), lambda: torch.tensor(index))
            # the terms are >= 0: their L1 norm is their sum (one multi-tensor launch)
            partial = torch.stack(torch._foreach_norm(pieces, 1)).to(torch.float64)
            sums.index_add_(1, positions, torch.stack([partial, self._on(device, ("counts", key),
                                                                         lambda: torch.tensor(counts, dtype=torch.float64))]))

        # 3. Whole-parameter sums: the pieces on other DP ranks (ZeRO), then the other TP shards of
        #    sharded parameters only.  Issued by every rank, even one holding nothing; on the
        #    model's device (under optimizer offload the stepped tensors are on the CPU).
        if layout is not None and layout.comm_device is not None:
            sums = sums.to(layout.comm_device)
        if layout is not None and layout.dp_group is not None:
            all_reduce(sums, layout.dp_group)
        if layout is not None and layout.tp_group is not None:
            mask = self._on(sums.device, ("tp_sharded",), lambda: torch.tensor(layout.tp_sharded, dtype=torch.bool))
            sharded = all_reduce(torch.where(mask, sums, torch.zeros_like(sums)), layout.tp_group)
            sums = torch.where(mask, sharded, sums)

        # 4. lr_t / lr = 1 / max(1, rms) per logical parameter, on the device (no host sync).
        total, count = sums.to(device)
        rms = (total / count.clamp(min=1.0)).sqrt()
        scale = 1.0 / rms.clamp(min=1.0)
        if not work:
            return loss
        targets, segment_index, rates, decays, kahan = [], [], [], [], []
        directions = []
        copy_back = []
        for p, group, ratio, segments in work:
            flat = p.data.view(-1) if p.data.is_contiguous() else None
            target = flat if flat is not None else p.data.reshape(-1).clone()
            if flat is None:
                copy_back.append((p, target))
            # m / (sqrt(v) + eps) into the RMS temporary, which step 2 is done with
            state = self.state[p]
            denom = ratio.view_as(p)
            torch.sqrt(state["exp_avg_sq"], out=denom)
            denom.add_(group["eps"]).reciprocal_().mul_(state["exp_avg"])
            comp = state.get("kahan_comp")
            for seg in segments:  # elements outside every segment (ZeRO padding) stay untouched
                targets.append(target.narrow(0, seg.start, seg.numel))
                directions.append(ratio.narrow(0, seg.start, seg.numel))
                segment_index.append(seg.logical_index)
                rates.append(group["lr"])
                decays.append(self._decay_rate(group))
                kahan.append(None if comp is None else comp.view(-1).narrow(0, seg.start, seg.numel))
        seg_scale = scale[self._on(device, ("segments", tuple(segment_index)), lambda: torch.tensor(segment_index))]
        # weight decay: w *= 1 - c * scale, one multi-tensor pass per distinct c (a host number:
        # a tensor of rates copied to a GPU would wait for the backward pass to finish)
        for c in dict.fromkeys(decays):
            if c == 0.0:
                continue
            chosen = [j for j, d in enumerate(decays) if d == c]
            factors = 1.0 - c * seg_scale[self._on(device, ("chosen", tuple(chosen)), lambda: torch.tensor(chosen))]
            torch._foreach_mul_([targets[j] for j in chosen], list(factors.float().unbind()))
        # the step: u *= scale in place (segments never overlap), then w += -lr * u
        if directions:
            torch._foreach_mul_(directions, list(seg_scale.float().unbind()))
        for rate in dict.fromkeys(rates):
            chosen = [j for j, r in enumerate(rates) if r == rate]
            plain = [j for j in chosen if kahan[j] is None]
            if plain:
                torch._foreach_add_([targets[j] for j in plain], [directions[j] for j in plain], alpha=-rate)
            compensated = [j for j in chosen if kahan[j] is not None]
            if compensated:  # Kahan: c += -lr u; w_new = w + c; c += w - w_new
                comps, ws = [kahan[j] for j in compensated], [targets[j] for j in compensated]
                torch._foreach_add_(comps, [directions[j] for j in compensated], alpha=-rate)
                before = [w.clone() for w in ws]
                torch._foreach_add_(ws, comps)
                torch._foreach_sub_(before, ws)
                torch._foreach_add_(comps, before)
        for p, target in copy_back:
            p.data.copy_(target.view_as(p))
        return loss
