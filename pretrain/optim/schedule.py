"""Learning-rate schedule: linear warmup, then a decay (Megatron-LM's styles) to a horizon.

`step` counts completed optimizer steps, so lr_at(step) is the rate used by optimizer step
number step+1.  Warmup never uses lr 0 (that would waste a step): during warmup
lr = base_lr * (step+1) / warmup_steps, reaching base_lr at step warmup_steps-1.  Then, with
progress p = (step - warmup_steps) / (decay_steps - warmup_steps) running from 0 to 1:

    linear         min_lr + (base_lr - min_lr) * (1 - p)
    poly           min_lr + (base_lr - min_lr) * (1 - p) ** power
    cosine         min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * p))
    inverse_sqrt   max(min_lr, base_lr * sqrt(max(warmup_steps, 1) / max(step, 1)))
    constant       base_lr

and min_lr from step decay_steps on (constant excepted), as Megatron's --lr-decay-iters does.
decay_steps is usually train.train_steps; a longer horizon leaves the run at a higher rate
(e.g. to continue it later), a shorter one ends it at min_lr.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..config.choices import DECAYS


def _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr) -> None:
    if decay not in DECAYS:
        raise ValueError(f"lr schedule: decay must be one of {DECAYS}, got {decay!r}")
    if base_lr <= 0 or min_lr < 0 or min_lr > base_lr:
        raise ValueError(f"lr schedule: need 0 <= min_lr <= base_lr and base_lr > 0 "
                         f"(got base_lr={base_lr}, min_lr={min_lr})")
    if warmup_steps < 0:
        raise ValueError(f"lr schedule: warmup_steps must be >= 0, got {warmup_steps}")
    if decay != "constant" and decay_steps <= warmup_steps:
        raise ValueError(f"lr schedule: decay_steps ({decay_steps}) must exceed warmup_steps "
                         f"({warmup_steps}) for {decay} decay")
    if decay == "poly" and power <= 0:
        raise ValueError(f"lr schedule: poly power must be > 0, got {power}")


def lr_at(step: int, base_lr: float, warmup_steps: int, decay_steps: int, decay: str = "linear",
          power: float = 0.5, min_lr: float = 0.0) -> float:
    """Learning rate after `step` completed optimizer steps (pure function)."""
    _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr)
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0, got {step}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return base_lr
    if step >= decay_steps:
        return min_lr
    if decay == "inverse_sqrt":
        return max(min_lr, base_lr * math.sqrt(max(warmup_steps, 1) / max(step, 1)))
    progress = (step - warmup_steps) / (decay_steps - warmup_steps)
    if decay == "linear":
        remaining = 1.0 - progress
    elif decay == "poly":
        remaining = (1.0 - progress) ** power
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (base_lr - min_lr) * remaining


class WarmupDecayLR(LRScheduler):
    """Sets every param group's lr to lr_at(completed steps).  Usable as DeepSpeed's
    `lr_scheduler` (DeepSpeed calls step() after each optimizer step it does not skip).

    The checkpoint keeps only the step count: the schedule itself comes from the run's
    config (one source of truth), so a resumed run may e.g. extend the decay horizon.

    `hold`, when given, is asked at every step(): true means the optimizer step just taken was
    skipped (a non-finite loss or gradient), and the schedule stays where it is."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int,
                 decay_steps: int, decay: str = "linear", power: float = 0.5, min_lr: float = 0.0,
                 hold: Callable[[], bool] | None = None):
        _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr)
        self.schedule = dict(base_lr=base_lr, warmup_steps=warmup_steps, decay_steps=decay_steps,
                             decay=decay, power=power, min_lr=min_lr)
        self._hold = hold
        super().__init__(optimizer)  # performs the initial step: last_epoch 0, lr = lr_at(0)

    def step(self, epoch=None) -> None:
        if self._hold is not None and self._hold():
            return
        super().step()

    def get_lr(self) -> list[float]:
        lr = lr_at(self.last_epoch, **self.schedule)
        return [lr for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        lr = lr_at(self.last_epoch, **self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr for _ in self.optimizer.param_groups]


def make_lr_scheduler(optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int,
                      decay_steps: int, decay: str = "linear", power: float = 0.5,
                      min_lr: float = 0.0, hold: Callable[[], bool] | None = None) -> WarmupDecayLR:
    return WarmupDecayLR(optimizer, base_lr, warmup_steps, decay_steps, decay, power, min_lr, hold)
