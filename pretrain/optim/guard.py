"""Skip an optimizer step whose loss or gradients are not finite.

A NaN or Inf in one micro-batch's loss, or in any gradient, would otherwise be written into
every weight by the update. The guard watches both on the device (no host sync while the step
runs): the loss through the loss function's sums, the gradients through a hook on every
parameter (before DeepSpeed reduces, partitions or casts them, so one check serves every ZeRO
stage and wrapper). When the client optimizer is about to step, the ranks agree in one small
collective whether any of them saw a non-finite value; if so, no rank updates and the learning
rate schedule does not advance (as Megatron-LM skips an iteration), while the step still counts
and its data stays consumed.

fp16 needs none of this: DeepSpeed's loss scaler already skips overflowing steps (the trainer
counts those from the engine).
"""
from __future__ import annotations

import types
from typing import Callable

import torch

from .. import device as devices

LOSS, GRADIENTS = 0, 1
WHAT = ("loss", "gradients")


class NonFiniteGuard:
    def __init__(self, on: torch.device, loss_is_finite: Callable[[torch.device], torch.Tensor]):
        self._on = on
        self._loss_is_finite = loss_is_finite  # (device) -> a bool over the loss sums since the step began
        self._seen = torch.zeros(2, device=on)  # this rank, this step: [loss, gradients] non-finite
        self._decision: list[str] | None = None  # what the ranks found non-finite, once they agreed
        self._active = False  # no decisions before the first step (DeepSpeed's construction steps once)

    def watch(self, parameters) -> None:
        """Check every gradient these parameters receive."""
        for param in parameters:
            if param.requires_grad:
                param.register_hook(self._check_gradient)

    def _check_gradient(self, grad: torch.Tensor) -> None:
        bad = torch.logical_not(torch.isfinite(grad).all())
        self._seen[GRADIENTS] = torch.maximum(self._seen[GRADIENTS], bad.to(self._seen.dtype))

    def begin_step(self) -> None:
        self._seen.zero_()
        self._decision = None
        self._active = True

    def step_is_bad(self) -> bool:
        """Whether this step must be skipped; the first call of a step is a collective over the
        world (every rank's client optimizer steps once per optimizer step), later calls reuse it."""
        if not self._active:
            return False
        if self._decision is None:
            seen = self._seen.clone()
            loss_bad = torch.logical_not(self._loss_is_finite(seen.device)).to(seen.dtype)
            seen[LOSS] = torch.maximum(seen[LOSS], loss_bad)
            flags = devices.all_reduce(seen, op="max").tolist()
            self._decision = [what for what, flag in zip(WHAT, flags) if flag > 0]
        return bool(self._decision)

    def skipped(self) -> list[str]:
        """What was non-finite in the step just taken (empty: it was applied, or never decided)."""
        return list(self._decision or [])


def guard_optimizer(optimizer: torch.optim.Optimizer, guard: NonFiniteGuard) -> None:
    """Make `optimizer.step()` a no-op on a step the guard rejects. Install it before DeepSpeed
    builds its engine: the LR scheduler it creates wraps whatever `optimizer.step` is then."""
    inner = optimizer.step

    def step(self, *args, **kwargs):
        if guard.step_is_bad():
            return None
        return inner(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)  # a bound method, as torch's LR scheduler expects
