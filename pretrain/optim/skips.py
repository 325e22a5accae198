"""The non-finite skip policy: how many skipped steps a run tolerates (`resilience.max_consecutive_skips`).

The guard (guard.py) decides whether one step is skipped and why; this policy counts the
outcomes over the run. A non-finite step counts toward the limit of skips in a row; an fp16
loss-scale overflow is counted as skipped but never ends the run while the dynamic scaler can
still lower its scale (it overflows several times in a row by design while it finds its scale);
at fp16.min_loss_scale an overflow is a non-finite step like any other (guard.classify).
"""
from __future__ import annotations

from ..common.errors import UserError
from .guard import AT_MIN_SCALE, StepOutcome, suspect_ranks


class NonFiniteTraining(UserError, RuntimeError):
    """Too many steps in a row had a NaN/Inf loss or gradient: the run diverged."""


class SkipPolicy:
    def __init__(self, max_consecutive: int, min_loss_scale: float | None = None, world_size: int = 1):
        self.max_consecutive = max_consecutive
        self.world_size = world_size  # to tell one rank's fault from the job's divergence
        self.min_loss_scale = min_loss_scale  # fp16 only: named when the scale is stuck at its minimum
        self.skipped = 0  # steps whose update was skipped (non-finite, or an fp16 overflow)
        # the current run of non-finite steps: (step, what was bad, the ranks that saw it first,
        # the position in the sample sequence its batch began at)
        self.bad_run: list[tuple[int, tuple[str, ...], tuple, int]] = []

    def count(self, step: int, outcome: StepOutcome, position: int) -> None:
        """Count step `step` (just taken; its batch began at sample `position` of the sequence, as
        the trainer counts it: batch warmups and skipped ranges included); raise NonFiniteTraining at
        the limit of skips in a row."""
        if not outcome.skipped:
            self.bad_run = []
            return
        self.skipped += 1
        if not outcome.counts:
            return
        self.bad_run.append((step, outcome.what, outcome.sources, position))
        limit = self.max_consecutive
        if len(self.bad_run) < limit:
            return
        what = sorted({w for _, found, _, _ in self.bad_run for w in found})
        if AT_MIN_SCALE in what:  # says more than "gradients"
            what = [f"{AT_MIN_SCALE} ({self.min_loss_scale:g}, fp16.min_loss_scale)" if w == AT_MIN_SCALE
                    else w for w in what if w != "gradients"]
        first, _, _, first_position = self.bad_run[0]
        suspects = suspect_ranks([sources for _, _, sources, _ in self.bad_run], self.world_size)
        if suspects:
            named = "; ".join(f"rank {s.rank} (host {s.host}, {s.device})" for s in suspects)
            advice = (f"{named} saw every one of them before the reduction and no other rank did: suspect that "
                      f"device (run a GPU check on it, or exclude the node) before lowering optimizer.lr")
        else:
            advice = f"Lower optimizer.lr or check the data near sample {first_position}"
        raise NonFiniteTraining(
            f"step {step}: non-finite {' and '.join(what)} in {limit} steps in a row (steps {first}-{step}, "
            f"resilience.max_consecutive_skips={limit}); every one was skipped, the weights are those after step "
            f"{first - 1}. {advice}")
