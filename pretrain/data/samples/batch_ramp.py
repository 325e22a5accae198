"""A rank's micro-batches per step during a batch warmup, read from the run's TokenClock
(pretrain/config/token_clock.py: the batch sequence in tokens)."""
from __future__ import annotations

from ...config.token_clock import TokenClock


class MicroBatchesPerStep:
    """A rank's micro-batches in each step from `first_step` on (its number counted from there), for
    the loader's packing groups (a step's share packed together) during a batch warmup."""

    def __init__(self, clock: TokenClock, first_step: int, samples_per_micro_step: int):
        self.clock, self.first_step, self.per_micro_step = clock, first_step, samples_per_micro_step

    def __call__(self, item: int) -> int:
        return self.clock.batch(self.first_step + item) // self.per_micro_step

    def after(self, steps: int) -> "MicroBatchesPerStep":
        """The same from `steps` steps later."""
        return MicroBatchesPerStep(self.clock, self.first_step + steps, self.per_micro_step)
