"""Learning-rate schedule: warmup, an optional stable stage, then a decay to a horizon (Megatron-LM's
styles, and the warmup-stable-decay / "trapezoidal" schedule of ModernBERT and MiniCPM).

Positions count in steps or in tokens (scheduler.unit). `done` is the position before the step
about to be taken and `size` what that step adds (1 step, or its tokens), so lr_at(done, size) is the
rate that step uses. Warmup never uses lr 0 (that would waste a step): during warmup
lr = base_lr * (done + size) / warmup, reaching base_lr at the step that ends it; with
`warmup_from_min` (transformers' and Composer's convention) lr = min_lr + (base_lr - min_lr) *
done / warmup, the first step at min_lr. Measured in tokens with a fixed batch of T tokens a step, done = step * T and
size = T: exactly the step-counted rates of a warmup of warmup / T steps. Then the rate holds at
base_lr until `decay_start` (default: the end of warmup; a later one is WSD's stable stage), and
with progress p = (done - decay_start) / (decay_end - decay_start) running from 0 to 1:

    linear         min_lr + (base_lr - min_lr) * (1 - p)
    poly           min_lr + (base_lr - min_lr) * (1 - p) ** power
    cosine         min_lr + (base_lr - min_lr) * 0.5 * (1 + cos(pi * p))
    1-sqrt         min_lr + (base_lr - min_lr) * (1 - sqrt(p))      (Hägele et al. 2024; ModernBERT's decay)
    inverse_sqrt   max(min_lr, base_lr * sqrt(max(warmup, 1) / max(done, 1)))   (steps only)
    constant       base_lr

and min_lr from decay_end on (constant excepted), as Megatron's --lr-decay-iters does.
decay_end is usually train.train_steps; a longer horizon leaves the run at a higher rate
(e.g. to continue it later), a shorter one ends it at min_lr. With decay_start set these are
transformers' get_wsd_schedule (num_stable_steps = decay_start - warmup, num_decay_steps =
decay_end - decay_start, min_lr_ratio = min_lr / base_lr) at every step.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..config.choices import DECAYS


def _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr, decay_start=None) -> None:
    if decay not in DECAYS:
        raise ValueError(f"lr schedule: decay must be one of {DECAYS}, got {decay!r}")
    if base_lr <= 0 or min_lr < 0 or min_lr > base_lr:
        raise ValueError(f"lr schedule: need 0 <= min_lr <= base_lr and base_lr > 0 "
                         f"(got base_lr={base_lr}, min_lr={min_lr})")
    if warmup_steps < 0:
        raise ValueError(f"lr schedule: warmup_steps must be >= 0, got {warmup_steps}")
    start = warmup_steps if decay_start is None else decay_start
    if start < warmup_steps:
        raise ValueError(f"lr schedule: decay_start ({decay_start}) must be >= warmup ({warmup_steps})")
    if decay != "constant" and decay_steps <= start:
        raise ValueError(f"lr schedule: decay_steps ({decay_steps}) must exceed the decay's start "
                         f"({start}) for {decay} decay")
    if decay == "poly" and power <= 0:
        raise ValueError(f"lr schedule: poly power must be > 0, got {power}")


def lr_at(step: int, base_lr: float, warmup_steps: int, decay_steps: int, decay: str = "linear",
          power: float = 0.5, min_lr: float = 0.0, decay_start: int | None = None, size: int = 1,
          warmup_from_min: bool = False) -> float:
    """Learning rate of the step taken after position `step` (completed steps, or tokens seen) that
    adds `size` to it (pure function; the module docstring has the formulas)."""
    _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr, decay_start)
    if step < 0:
        raise ValueError(f"lr schedule: step must be >= 0, got {step}")
    if step < warmup_steps:
        if warmup_from_min:
            return min_lr + (base_lr - min_lr) * step / warmup_steps
        return base_lr * min(step + size, warmup_steps) / warmup_steps
    start = warmup_steps if decay_start is None else decay_start
    if decay == "constant" or step < start:
        return base_lr
    if step >= decay_steps:
        return min_lr
    if decay == "inverse_sqrt":
        return max(min_lr, base_lr * math.sqrt(max(warmup_steps, 1) / max(step, 1)))
    progress = (step - start) / (decay_steps - start)
    if decay == "linear":
        remaining = 1.0 - progress
    elif decay == "poly":
        remaining = (1.0 - progress) ** power
    elif decay == "1-sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr + (base_lr - min_lr) * remaining


def steps_clock(step: int) -> tuple[int, int]:
    """A schedule counted in optimizer steps: (position before step number step+1, its size)."""
    return step, 1


class WarmupDecayLR(LRScheduler):
    """Sets every param group's lr to lr_at(the schedule's position).  Usable as DeepSpeed's
    `lr_scheduler` (DeepSpeed calls step() after each optimizer step it does not skip).

    `clock(n)` is (position, size) of the schedule's step n+1 given n completed steps: steps_clock,
    or the tokens of the run's batch sequence (config/token_clock.py's TokenClock), a pure function
    of n. The checkpoint keeps only the step count: the schedule itself comes from the run's config
    (one source of truth), so a resumed run may e.g. extend the decay horizon.

    `hold`, when given, is asked at every step(): true means the optimizer step just taken was
    skipped (a non-finite loss or gradient), and the schedule stays where it is."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int,
                 decay_steps: int, decay: str = "linear", power: float = 0.5, min_lr: float = 0.0,
                 hold: Callable[[], bool] | None = None, decay_start: int | None = None,
                 warmup_from_min: bool = False, clock: Callable[[int], tuple[int, int]] = steps_clock):
        _validate(base_lr, warmup_steps, decay_steps, decay, power, min_lr, decay_start)
        self.schedule = dict(base_lr=base_lr, warmup_steps=warmup_steps, decay_steps=decay_steps,
                             decay=decay, power=power, min_lr=min_lr, decay_start=decay_start,
                             warmup_from_min=warmup_from_min)
        self._hold, self._clock = hold, clock
        super().__init__(optimizer)  # performs the initial step: last_epoch 0, lr = lr_at(0)

    def step(self, epoch=None) -> None:
        if self._hold is not None and self._hold():
            return
        super().step()

    def _lr(self) -> float:
        position, size = self._clock(self.last_epoch)
        return lr_at(position, size=size, **self.schedule)

    def get_lr(self) -> list[float]:
        lr = self._lr()
        return [lr for _ in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict["_step_count"])
        self.apply()

    def apply(self) -> None:
        """Set every group's rate to the schedule's at its position: after a checkpoint's optimizer
        state was loaded (ZeRO's and torch's load_state_dict bring the saved groups' rates, the old
        schedule's, which the next step would otherwise use)."""
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr for _ in self.optimizer.param_groups]


def make_lr_scheduler(optimizer: torch.optim.Optimizer, base_lr: float, warmup_steps: int,
                      decay_steps: int, decay: str = "linear", power: float = 0.5,
                      min_lr: float = 0.0, hold: Callable[[], bool] | None = None, **wsd) -> WarmupDecayLR:
    """`wsd`: decay_start, warmup_from_min, clock (WarmupDecayLR's)."""
    return WarmupDecayLR(optimizer, base_lr, warmup_steps, decay_steps, decay, power, min_lr, hold, **wsd)
