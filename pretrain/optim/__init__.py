"""Optimizers (layout-exact LAMB and StableAdamW, AdamW) and the learning-rate schedule."""

from __future__ import annotations

import torch

from ..config.choices import OPTIMIZERS
from .lamb import Lamb
from .stable_adamw import StableAdamW
from .layout import NormLayout, Segment, layout_for_deepspeed, layout_for_params
from .schedule import WarmupDecayLR, lr_at, make_lr_scheduler


def build_optimizer(name: str, param_groups, **hyper) -> torch.optim.Optimizer:
    """Lamb, StableAdamW or torch's AdamW over `param_groups` (dicts with `params`,
    `weight_decay` and `layer_adaptation`).  AdamW and StableAdamW keep the `layer_adaptation`
    key in their groups but never read it (torch optimizers accept extra group keys), so one
    grouping serves all three.  `hyper`: lr, betas, eps, weight_decay (+ max_trust_ratio,
    bias_correction for Lamb; decouple_lr, max_lr, kahan_sum for StableAdamW)."""
    if name == "lamb":
        return Lamb(param_groups, **hyper)
    if name == "stable_adamw":
        return StableAdamW(param_groups, **hyper)
    if name == "adamw":
        # fused: one kernel over all tensors instead of a loop of elementwise ops (CPU and CUDA)
        return torch.optim.AdamW(param_groups, fused=True, **hyper)
    raise ValueError(f"build_optimizer: unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


__all__ = ["Lamb", "StableAdamW", "NormLayout", "Segment", "layout_for_params", "layout_for_deepspeed",
           "lr_at", "make_lr_scheduler", "WarmupDecayLR", "build_optimizer", "OPTIMIZERS"]
