"""The run's batch sequence in tokens: how many samples step k takes and how many tokens came before
it, a pure function of k (no state to checkpoint, the same on every rank and at every layout).

Tokens are samples x data.seq_length (the rows' budget, padding included: what the batch and the
schedule are sized in, as Megatron's sample-based schedules and ModernBERT's packed rows count them),
from the start of the run or of its phase (checkpoint.new_phase). The LR schedule counted in tokens
(scheduler.*_tokens) reads its position here.

Batch-size warmup (train.batch_warmup_tokens, ModernBERT's batch_size_warmup): step k's global batch
grows linearly in the tokens seen before it, from train.batch_warmup_min_size to
train.global_batch_size, rounded down to a multiple of the minimum. The minimum is whole micro-batches
on every data-parallel rank (the config checks it), so that shapes stay fixed and only the
accumulation steps change, and rounding to it rather than to micro-batch x DP gives every layout the
same batches. The samples are the one training sequence either way (loaders.py draws a step's
batch from the position the last one left): after the ramp, a step takes the samples a run at the
full batch throughout takes from the same position.

In the config layer (torch-free, like the rest of it): the config's own check of the schedule's
lengths reads it, and so do the trainer, the loaders and the spike policy.
"""
from __future__ import annotations

import bisect


class TokenClock:
    """Step k's global batch (`batch(k)`) and the tokens before it (`tokens_before(k)`)."""

    def __init__(self, global_batch_size: int, seq_length: int, ramp_tokens: int = 0, ramp_min: int | None = None):
        self.target, self.seq_length, self.ramp_tokens = global_batch_size, seq_length, ramp_tokens
        self.ramp_min = global_batch_size if not ramp_tokens else ramp_min
        self.unit = self.ramp_min
        # the ramp's steps, computed once: batch and tokens before each step while the ramp lasts
        self._batches: list[int] = []
        self._starts: list[int] = [0]
        while self.ramp_tokens and self._starts[-1] < self.ramp_tokens:
            seen = self._starts[-1]
            self._batches.append(self._ramp(seen))
            self._starts.append(seen + self._batches[-1] * seq_length)

    @classmethod
    def of(cls, cfg) -> "TokenClock":
        """The clock of a run's Config (train.*, data.seq_length)."""
        t = cfg.train
        return cls(t.global_batch_size, cfg.data.seq_length, t.batch_warmup_tokens, t.batch_warmup_min_size)

    def _ramp(self, seen: int) -> int:
        share = seen / self.ramp_tokens
        size = self.ramp_min + (self.target - self.ramp_min) * share
        return min(self.target, max(self.ramp_min, int(size // self.unit) * self.unit))

    @property
    def ramp_steps(self) -> int:
        """The steps the ramp lasts (0 without one): step ramp_steps is the first at the full batch."""
        return len(self._batches)

    def batch(self, k: int) -> int:
        """Samples of step k (0-based, from the start of the run or phase)."""
        return self._batches[k] if k < len(self._batches) else self.target

    def tokens_before(self, k: int) -> int:
        if k <= len(self._batches):
            return self._starts[k]
        return self._starts[-1] + (k - len(self._batches)) * self.target * self.seq_length

    def samples_before(self, k: int) -> int:
        return self.tokens_before(k) // self.seq_length

    def step_at_samples(self, samples: int) -> int | None:
        """The step that starts after exactly `samples` samples (None: none does)."""
        tokens = samples * self.seq_length
        if tokens <= self._starts[-1]:
            k = bisect.bisect_left(self._starts, tokens)
            return k if k < len(self._starts) and self._starts[k] == tokens else None
        rest, remainder = divmod(tokens - self._starts[-1], self.target * self.seq_length)
        return None if remainder else len(self._batches) + rest

    def schedule_clock(self, step: int) -> tuple[int, int]:
        """(tokens before step number step+1, its tokens): the LR schedule's position in tokens."""
        return self.tokens_before(step), self.batch(step) * self.seq_length
