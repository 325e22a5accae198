"""Dropout as the model draws it (one module so that the layers and the attention kernels share it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout. On CPU the keep mask is one uniform draw compared with p (the same
    Bernoulli(1 - p) as F.dropout, whose bernoulli_ is 2-3x slower there: ~8% of a BERT-base
    step). Draws from the current default generator, so the RNG tracker's forks govern it."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    keep = torch.rand(x.shape, dtype=torch.float32).ge_(p).mul_(1.0 / (1.0 - p))
    return x * keep.to(x.dtype)


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout's keep mask for x, unscaled (1 kept, 0 dropped), for a kernel that applies it and the
    1/(1-p) scale itself (fused.py) and keeps it for its backward, as `dropout` keeps its own. On
    the CPU the draw `dropout` makes, in x's dtype, so a compiled layer drops what the eager one
    does; elsewhere one Bernoulli(1 - p) kernel into booleans (one byte per element, as F.dropout's
    mask)."""
    if x.device.type == "cpu":
        return torch.rand(x.shape, dtype=torch.float32).ge_(p).to(x.dtype)
    return torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1.0 - p)


class Dropout(nn.Module):
    """nn.Dropout with `dropout` above."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
