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

Where it came from: each rank keeps its own flags (its loss, and one per parameter, set before
any reduction) and the agreement gathers every rank's two flags instead of reducing them (the same
one small collective). A non-finite step then takes one more collective, on such steps only: every
rank that saw a non-finite value itself sends its host, device and the first parameters (by name,
in the order backward produced them) whose gradients were not finite (`NonFiniteSource`).

Either way the trainer asks `outcome()` after the step: the guard then agrees with the other
ranks on what was non-finite (the collective it had not taken yet, when DeepSpeed skipped first)
and `classify()` says whether the skip was a non-finite step, which counts toward
`resilience.max_consecutive_skips`, or an fp16 loss-scale overflow, which is the dynamic scaler doing
its job and does not count, unless the scale is already at its minimum and cannot go lower.
The learning-rate schedule does not advance on a skipped step (as Megatron-LM skips an
iteration), while the step still counts and its data stays consumed.
"""
from __future__ import annotations

import socket
import types
from typing import Callable, NamedTuple

import torch

from ..distributed import device as devices

LOSS, GRADIENTS = 0, 1
WHAT = ("loss", "gradients")
SPIKE = "loss spike"  # a finite loss the spike detector judged a spike (spikes.py), with a policy that skips it
AT_MIN_SCALE = "gradients at the minimum fp16 loss scale"
NAMED_PARAMETERS = 5  # of a rank's non-finite gradients, the first this many are named


class NonFiniteSource(NamedTuple):
    """A rank that saw a non-finite value itself, before any reduction carried it to the others."""

    rank: int
    host: str
    device: str
    loss: bool
    gradients: bool
    parameters: tuple[str, ...]  # the first (backward order) with a non-finite gradient
    more: int  # how many more parameters had one

    def describe(self) -> str:
        what = " and ".join(w for w, bad in (("loss", self.loss), ("gradients", self.gradients)) if bad)
        named = ", ".join(self.parameters) + (f" and {self.more} more" if self.more else "")
        return f"rank {self.rank} (host {self.host}, {self.device}): {what}" + (f" ({named})" if named else "")


class NonFiniteGuard:
    def __init__(self, on: torch.device, loss_is_finite: Callable[[torch.device], torch.Tensor], veto: bool = True,
                 rank: int = 0):
        self._on, self.rank = on, rank
        self._loss_is_finite = loss_is_finite  # (device) -> a bool over the loss sums since the step began
        self.veto = veto  # whether our own check skips the step (resilience.skip_nonfinite_steps)
        self._loss_seen = torch.zeros((), device=on)  # this rank, this step: a non-finite loss
        self._names: list[str] = []  # the watched parameters, in the order watch() got them
        self._param_bad = torch.zeros(0, dtype=torch.bool, device=on)  # this rank, this step: per parameter
        self._flags: list[list[float]] | None = None  # every rank's [loss, gradients], once they agreed
        self._decision: list[str] | None = None  # what the ranks found non-finite, once they agreed
        self._sources: list[NonFiniteSource] | None = None
        self._active = False  # no decisions before the first step (DeepSpeed's construction steps once)
        # resilience.spike_policy: the step's loss over the job, judged in the same collective
        self._loss_sums: Callable[[torch.device], torch.Tensor] | None = None
        self._loss_of: Callable[[list[float]], float] | None = None
        self._judge: Callable[[float], str | None] | None = None
        self.veto_spikes = False
        self.global_loss: float | None = None  # this step's loss over the job, once agreed (with spikes judged)
        self.spike: str | None = None  # why this step's loss is a spike, once agreed

    def judge_spikes(self, loss_sums: Callable[[torch.device], torch.Tensor], loss_of: Callable[[list[float]], float],
                     judge: Callable[[float], str | None], veto: bool) -> None:
        """Agree on every step (also with the non-finite veto off) and judge its loss over the job:
        `loss_sums(device)`, this rank's share of the loss sums (zeros where it holds none), summed
        over the ranks in the agreement's collective, `loss_of(sums)` the loss, `judge(loss)` why it
        is a spike (or None). With `veto`, a spike is skipped like a non-finite step (SPIKE)."""
        self._loss_sums, self._loss_of, self._judge, self.veto_spikes = loss_sums, loss_of, judge, veto

    def watch(self, named_parameters) -> None:
        """Check every gradient these (name, parameter) pairs receive."""
        for name, param in named_parameters:
            if param.requires_grad:
                index = len(self._names)
                self._names.append(name)
                param.register_hook(lambda grad, index=index: self._check_gradient(grad, index))
        self._param_bad = torch.zeros(len(self._names), dtype=torch.bool, device=self._on)

    def _check_gradient(self, grad: torch.Tensor, index: int) -> None:
        flag = self._param_bad[index]
        flag |= torch.logical_not(torch.isfinite(grad).all())  # in place, on the device: no host sync

    def begin_step(self) -> None:
        self._loss_seen.zero_()
        self._param_bad.zero_()
        self._flags = self._decision = self._sources = None
        self.global_loss = self.spike = None
        self._active = True

    def _local_flags(self) -> torch.Tensor:
        """[loss, gradients] non-finite on this rank in this step (float, on the device)."""
        loss_bad = torch.logical_not(self._loss_is_finite(self._on))
        gradients_bad = self._param_bad.any() if len(self._names) else torch.zeros((), dtype=torch.bool, device=self._on)
        return torch.stack([loss_bad, gradients_bad]).to(torch.float64)

    def _agree(self) -> list[str]:
        """What any rank saw non-finite in this step (and, judging spikes, whether its loss is one):
        every rank's flags and loss sums gathered (one collective over the world, taken once)."""
        if self._decision is None:
            local = self._local_flags()
            if self._loss_sums is not None:
                local = torch.cat([local, self._loss_sums(self._on).to(local)])
            rows = [t.tolist() for t in devices.all_gather(local)]
            self._flags = [row[:2] for row in rows]
            self._decision = [what for i, what in enumerate(WHAT) if any(flags[i] > 0 for flags in self._flags)]
            if self._loss_sums is not None:
                self.global_loss = self._loss_of([sum(column) for column in zip(*(row[2:] for row in rows))])
                self.spike = None if self._decision else self._judge(self.global_loss)
                if self.spike and self.veto_spikes:
                    self._decision = [SPIKE]
        return self._decision

    def _vetoes(self, decision: list[str]) -> bool:
        return bool(decision) and (self.veto if decision != [SPIKE] else self.veto_spikes)

    def sources(self) -> list[NonFiniteSource]:
        """The ranks that saw this step's non-finite values themselves (after `outcome()` found
        some): one object collective, taken by every rank on such a step only."""
        if self._sources is None:
            mine = None
            loss_bad, gradients_bad = (flag > 0 for flag in self._flags[self.rank])
            if loss_bad or gradients_bad:
                bad = [self._names[i] for i in reversed(self._param_bad.nonzero().flatten().tolist())]
                mine = NonFiniteSource(self.rank, socket.gethostname(), str(self._on), loss_bad, gradients_bad,
                                       tuple(bad[:NAMED_PARAMETERS]), max(0, len(bad) - NAMED_PARAMETERS))
            self._sources = [s for s in devices.all_gather_object(mine) if s is not None]
        return self._sources

    def step_is_bad(self) -> bool:
        """Whether our check skips this step (the client optimizer asks before it updates; every
        rank's client optimizer steps once per optimizer step, or several times under ZeRO-3, so
        the first call is the collective and later ones reuse it)."""
        if not (self._active and (self.veto or self.veto_spikes)):
            return False
        return self._vetoes(self._agree())

    def outcome(self, deepspeed_skipped: bool) -> list[str]:
        """After the step: what was non-finite in it, as every rank agrees (empty: nothing).

        When DeepSpeed skipped the step before our optimizer was called, every rank comes here
        with deepspeed_skipped set (its decision is reduced over the ranks), so the collective
        `_agree` takes is one all ranks take. A skip DeepSpeed saw and our hooks did not (a
        gradient norm that overflows while every element is finite) is named gradients."""
        if self._decision is None and not deepspeed_skipped:
            if self._loss_sums is None:
                return []  # the client optimizer stepped without a vote (veto off): nothing to agree on
            self._agree()  # judging spikes, every rank agrees on every step; no veto was asked: the step was applied
            return []
        found = list(self._agree())
        if deepspeed_skipped and not found:
            found = ["gradients"]
        return found

    def traced(self) -> list[NonFiniteSource]:
        """After `outcome()`: the sources of this step's non-finite values (every rank calls it
        when the outcome was a skip; [] when no rank saw one itself, e.g. a norm overflow)."""
        if not self._decision or self._decision == [SPIKE]:
            return []
        return self.sources()

    def skipped(self) -> list[str]:
        """What our own check found non-finite in the step just taken (empty: it was applied, or
        our check had no say); read by the LR scheduler, which holds on a skipped step."""
        return list(self._decision) if self._decision and self._vetoes(self._decision) else []


class StepOutcome(NamedTuple):
    """What became of one optimizer step."""

    skipped: bool
    what: tuple[str, ...] = ()  # what was non-finite: "loss", "gradients", AT_MIN_SCALE
    counts: bool = False  # toward resilience.max_consecutive_skips (a non-finite step, not a scaler overflow)
    sources: tuple[NonFiniteSource, ...] = ()  # of a counted step: the ranks that saw it themselves

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
    if found == [SPIKE] and not deepspeed_skipped:
        return StepOutcome(True, (SPIKE,), counts=True)  # skipped by resilience.spike_policy, counted in a row
    what = [w for w in found if w != SPIKE] or ["gradients"]
    if scaler_can_lower is not None and "loss" not in what:
        if scaler_can_lower:
            return StepOutcome(True, tuple(what), counts=False)
        what = [AT_MIN_SCALE if w == "gradients" else w for w in what]
    return StepOutcome(True, tuple(sorted(what)), counts=True)


def describe_nonfinite(step: int, outcome: StepOutcome) -> str:
    """One line: what was non-finite in a skipped step and which ranks saw it before any reduction."""
    head = f"step {step}: non-finite {outcome.label}"
    if not outcome.sources:
        return (f"{head}; no rank saw a non-finite value before the reduction (the reduced gradients or their norm "
                f"overflowed)")
    return f"{head}, seen first by " + "; ".join(source.describe() for source in outcome.sources)


def suspect_ranks(sources_per_step: list[tuple[NonFiniteSource, ...]], world_size: int) -> list[NonFiniteSource]:
    """The ranks that saw every one of these non-finite steps themselves while the others saw none
    of them: with two steps or more, the device to suspect. [] when there is no such pattern."""
    if len(sources_per_step) < 2 or not all(sources_per_step):
        return []
    every = set.intersection(*({s.rank for s in sources} for sources in sources_per_step))
    anyone = set.union(*({s.rank for s in sources} for sources in sources_per_step))
    if not every or every != anyone or len(every) >= world_size:
        return []
    return sorted({s.rank: s for s in sources_per_step[-1] if s.rank in every}.values())


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
