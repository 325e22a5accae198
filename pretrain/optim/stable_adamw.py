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

from .whole_parameter import WholeParameterOptimizer, flat_target, write_back


def debias_beta(beta: float, step: int) -> float:
    """beta * (1 - beta**(t-1)) / (1 - beta**t): the EMA weight that makes m and v unbiased."""
    return (beta ** step - beta) / (beta ** step - 1)


class StableAdamW(WholeParameterOptimizer):
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

    def _new_state(self, param: torch.Tensor, group: dict) -> dict:
        state = super()._new_state(param, group)
        if group["kahan_sum"] and param.dtype in (torch.float16, torch.bfloat16):
            state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def _moments(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Advance step, m and v of `params`; return g^2 / max(v, eps^2) per tensor (flat)."""
        self._advance_states(params, group)
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

    def _update(self) -> None:
        # 1. Moments, and the elementwise RMS terms of every tensor with a gradient.
        work, n, device = self._collect(self._moments)

        # 2. Per-logical-parameter sums of g^2/max(v, eps^2) and element counts in one (2, n)
        #    float64 tensor; ZeRO padding lies outside every segment and is not counted.
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

        # 3. Whole-parameter sums (whole_parameter.py: over DP, then TP for sharded parameters)
        sums = self._whole_parameter_sums(sums, device)

        # 4. lr_t / lr = 1 / max(1, rms) per logical parameter, on the device (no host sync).
        total, count = sums
        rms = (total / count.clamp(min=1.0)).sqrt()
        scale = 1.0 / rms.clamp(min=1.0)
        if not work:
            return
        targets, segment_index, rates, decays, kahan = [], [], [], [], []
        directions = []
        copy_back = []
        for p, group, ratio, segments in work:
            target = flat_target(p, copy_back)
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
        write_back(copy_back)
