"""Loss spikes (resilience.spike_policy): a finite loss far above the run's recent losses, or a
gradient norm above a limit. Large runs (PaLM, OPT, BLOOM) answer one by rolling back to the last
checkpoint and stepping over the batches around it; a spike that stays finite would otherwise
train on, and the non-finite guard (guard.py) never sees it.

The detector judges on the host from numbers every rank has alike (the guard's agreement gathers
every rank's loss sums in its one collective per step), so every rank decides the same without a
collective of its own. Its window is part of a checkpoint's trainer state: a resumed run judges
exactly as the straight run did.
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class SpikeDetector:
    def __init__(self, factor: float, window: int, grad_norm_limit: float = 0.0):
        self.factor, self.window, self.grad_norm_limit = factor, window, grad_norm_limit
        self.recent: deque[float] = deque(maxlen=window)  # the losses of the last accepted steps

    def loss_spike(self, loss: float) -> str | None:
        """Why this finite loss is a spike, or None (also while fewer than `window` steps were seen)."""
        if not math.isfinite(loss) or len(self.recent) < self.window:
            return None
        median = statistics.median(self.recent)
        if loss > self.factor * median:
            return (f"loss {loss:.4g} above {self.factor:g} x the median {median:.4g} of the last {self.window} steps "
                    f"(resilience.spike_factor, spike_window)")
        return None

    def grad_norm_spike(self, grad_norm: float) -> str | None:
        if self.grad_norm_limit and math.isfinite(grad_norm) and grad_norm > self.grad_norm_limit:
            return f"gradient norm {grad_norm:.4g} above resilience.spike_grad_norm {self.grad_norm_limit:g}"
        return None

    def accept(self, loss: float) -> None:
        """A step that was applied and judged normal: its loss joins the window."""
        if math.isfinite(loss):
            self.recent.append(loss)

    def state(self) -> list[float]:
        return list(self.recent)

    def load(self, losses: list[float]) -> None:
        self.recent = deque((float(x) for x in losses), maxlen=self.window)
