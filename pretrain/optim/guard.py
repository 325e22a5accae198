"""Skip an optimizer step whose loss or gradients are not finite, in every precision and ZeRO stage.

A NaN or Inf in one micro-batch's loss, or in any gradient, would otherwise be written into
every weight by the update. Two checks can skip a step:

- ours: the guard watches the loss (through the loss function's sums) and every gradient
  (through a hook on every parameter, before DeepSpeed reduces, partitions or casts it) on the
  device, with no host sync while the step runs. When the client optimizer is about to step, the
  ranks agree in one small collective whether any of them saw a non-finite value; if so, no rank
  updates (`resilience.skip_nonfinite_steps`). This is the only check of ZeRO-0 fp32.
- DeepSpeed's: every other wrapper (ZeRO-1/2/3, the bf16 and fp16 optimizers) checks the reduced
  gradients (or their norm) itself and returns before calling the client optimizer at all; its
  decision is reduced over the data- and model-parallel ranks, so every rank skips together.

Either way the trainer asks `outcome()` after the step: the guard then agrees with the other
ranks on what was non-finite (the collective it had not taken yet, when DeepSpeed skipped first)
and `classify()` says whether the skip was a non-finite step, which counts toward
`resilience.max_consecutive_skips`, or an fp16 loss-scale overflow, which is the dynamic scaler doing
its job and does not count, unless the scale is already at its minimum and cannot go lower.
The learning-rate schedule does not advance on a skipped step (as Megatron-LM skips an
iteration), while the step still counts and its data stays consumed.
"""
from __future__ import annotations

import types
from typing import Callable, NamedTuple

import torch

from ..distributed import device as devices

LOSS, GRADIENTS = 0, 1
WHAT = ("loss", "gradients")
AT_MIN_SCALE = "gradients at the minimum fp16 loss scale"


class NonFiniteGuard:
    def __init__(self, on: torch.device, loss_is_finite: Callable[[torch.device], torch.Tensor], veto: bool = True):
        self._on = on
        self._loss_is_finite = loss_is_finite  # (device) -> a bool over the loss sums since the step began
        self.veto = veto  # whether our own check skips the step (resilience.skip_nonfinite_steps)
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

    def _agree(self) -> list[str]:
        """What any rank saw non-finite in this step: a collective over the world, taken once."""
        if self._decision is None:
            seen = self._seen.clone()
            loss_bad = torch.logical_not(self._loss_is_finite(seen.device)).to(seen.dtype)
            seen[LOSS] = torch.maximum(seen[LOSS], loss_bad)
            flags = devices.all_reduce(seen, op="max").tolist()
            self._decision = [what for what, flag in zip(WHAT, flags) if flag > 0]
        return self._decision

    def step_is_bad(self) -> bool:
        """Whether our check skips this step (the client optimizer asks before it updates; every
        rank's client optimizer steps once per optimizer step, or several times under ZeRO-3, so
        the first call is the collective and later ones reuse it)."""
        if not (self._active and self.veto):
            return False
        return bool(self._agree())

    def outcome(self, deepspeed_skipped: bool) -> list[str]:
        """After the step: what was non-finite in it, as every rank agrees (empty: nothing).

        When DeepSpeed skipped the step before our optimizer was called, every rank comes here
        with deepspeed_skipped set (its decision is reduced over the ranks), so the collective
        `_agree` takes is one all ranks take. A skip DeepSpeed saw and our hooks did not (a
        gradient norm that overflows while every element is finite) is named gradients."""
        if self._decision is None and not deepspeed_skipped:
            return []  # the client optimizer stepped without a vote (veto off): nothing to agree on
        found = list(self._agree())
        if deepspeed_skipped and not found:
            found = ["gradients"]
        return found

    def skipped(self) -> list[str]:
        """What our own check found non-finite in the step just taken (empty: it was applied, or
        our check had no say); read by the LR scheduler, which holds on a skipped step."""
        return list(self._decision or []) if self.veto else []


class StepOutcome(NamedTuple):
    """What became of one optimizer step."""

    skipped: bool
    what: tuple[str, ...] = ()  # what was non-finite: "loss", "gradients", AT_MIN_SCALE
    counts: bool = False  # toward resilience.max_consecutive_skips (a non-finite step, not a scaler overflow)

    @property
    def label(self) -> str:
        return "fp16 loss-scale overflow" if self.skipped and not self.counts else " and ".join(self.what)


APPLIED = StepOutcome(False)


def classify(found: list[str], deepspeed_skipped: bool, scaler_can_lower: bool | None = None) -> StepOutcome:
    """The outcome of a step from what the ranks found non-finite and whether DeepSpeed skipped it.

    `scaler_can_lower` is None without fp16; with fp16, whether the dynamic loss scale was above
    its minimum when the step overflowed (a static scale never lowers). An fp16 step whose loss was
    finite and whose gradients overflowed is the loss scaler finding its scale: skipped, not
    counted, unless the scale could not go lower, where overflow after overflow is a divergence.
    """
    if not found and not deepspeed_skipped:
        return APPLIED
    what = list(found) or ["gradients"]
    if scaler_can_lower is not None and "loss" not in what:
        if scaler_can_lower:
            return StepOutcome(True, tuple(what), counts=False)
        what = [AT_MIN_SCALE if w == "gradients" else w for w in what]
    return StepOutcome(True, tuple(sorted(what)), counts=True)


def wrap_optimizer_step(optimizer: torch.optim.Optimizer, veto: Callable[[], bool] = lambda: False,
                        before_update: Callable[[], None] = lambda: None) -> None:
    """Make `optimizer.step()` a no-op when `veto()` says so (the guard's `step_is_bad`), and run
    `before_update()` (the exact clipping of ZeRO-0) right before a step it lets through. Install
    it before DeepSpeed builds its engine: the LR scheduler it creates wraps whatever
    `optimizer.step` is then."""
    inner = optimizer.step

    def step(self, *args, **kwargs):
        if veto():
            return None
        before_update()
        return inner(*args, **kwargs)

    optimizer.step = types.MethodType(step, optimizer)  # a bound method, as torch's LR scheduler expects
