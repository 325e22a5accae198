"""The scheduler section: the learning-rate warmup and decay, counted in steps or tokens, with the
rules about its own fields."""
from __future__ import annotations

from dataclasses import dataclass

from .checks import non_negative, one_of, positive
from .choices import DECAYS


@dataclass
class SchedulerConfig:
    warmup_steps: int = 0  # linear warmup over this many steps ...
    warmup_fraction: float | None = None  # ... or over this share of the decay horizon (not both)
    # "linear" | "poly" | "cosine" | "1-sqrt" | "inverse_sqrt" | "constant" (formulas: pretrain/optim/schedule.py)
    decay: str = "linear"
    decay_steps: int | None = None  # the step the decay reaches min_lr; None = train.train_steps
    # warmup-stable-decay: the rate holds at optimizer.lr from the end of warmup to this step, then
    # decays (None: the decay starts right after warmup)
    decay_start_steps: int | None = None
    power: float = 0.5  # exponent of "poly" decay
    min_lr: float = 0.0  # floor of the decayed learning rate
    # the same lengths counted in tokens (samples x data.seq_length, from the start of the run or of
    # its phase: checkpoint.new_phase); any of them set makes the whole schedule token-counted
    warmup_tokens: int | None = None
    decay_start_tokens: int | None = None
    decay_tokens: int | None = None  # None: the tokens of train.train_steps
    # warmup from scheduler.min_lr at the first step (transformers' and Composer's convention)
    # instead of reaching optimizer.lr at the last warmup step without ever stepping at 0
    warmup_from_min: bool = False

    @property
    def in_tokens(self) -> bool:
        return any(v is not None for v in (self.warmup_tokens, self.decay_start_tokens, self.decay_tokens))

    def horizon(self, train_steps: int) -> int:
        """The resolved decay horizon in steps (Megatron's --lr-decay-iters)."""
        return self.decay_steps if self.decay_steps is not None else train_steps

    def warmup(self, train_steps: int) -> int:
        """The resolved warmup length in steps; a fraction is of the decay horizon, as Megatron's
        --lr-warmup-fraction."""
        if self.warmup_fraction is not None:
            return int(self.warmup_fraction * self.horizon(train_steps))
        return self.warmup_steps

    def lengths(self, train_steps: int, position_at) -> dict:
        """lr_at's warmup_steps, decay_steps and decay_start in the schedule's unit; position_at(n):
        the schedule's position after n steps (n itself, or the tokens of the first n steps)."""
        if self.in_tokens:
            horizon = self.decay_tokens if self.decay_tokens is not None else position_at(train_steps)
            return dict(warmup_steps=self.warmup_tokens or 0, decay_steps=horizon, decay_start=self.decay_start_tokens)
        return dict(warmup_steps=self.warmup(train_steps), decay_steps=self.horizon(train_steps),
                    decay_start=self.decay_start_steps)

    def problems(self) -> list[str]:
        p: list[str] = []
        one_of(p, "scheduler.decay", self.decay, DECAYS)
        non_negative(p, "scheduler.warmup_steps", self.warmup_steps)
        if self.warmup_fraction is not None:
            if not 0.0 <= self.warmup_fraction <= 1.0:
                p.append(f"scheduler.warmup_fraction ({self.warmup_fraction}) must be in [0, 1]")
            if self.warmup_steps:
                p.append(f"scheduler.warmup_steps ({self.warmup_steps}) and scheduler.warmup_fraction "
                         f"({self.warmup_fraction}) both set: give one")
        for name in ("decay_steps", "decay_start_steps", "decay_tokens", "decay_start_tokens"):
            if getattr(self, name) is not None:
                positive(p, f"scheduler.{name}", getattr(self, name))
        if self.warmup_tokens is not None:
            non_negative(p, "scheduler.warmup_tokens", self.warmup_tokens)
        if self.in_tokens:
            steps = [name for name in ("warmup_steps", "warmup_fraction", "decay_steps", "decay_start_steps")
                     if getattr(self, name) not in (None, 0)]
            if steps:
                p.append(f"scheduler: {', '.join('scheduler.' + n for n in steps)} with token-counted lengths "
                         f"(scheduler.*_tokens): give every length in one unit")
            if self.decay == "inverse_sqrt":
                p.append("scheduler.decay inverse_sqrt is counted in steps only; give its lengths in steps")
        positive(p, "scheduler.power", self.power)
        non_negative(p, "scheduler.min_lr", self.min_lr)
        return p
