"""Stop requests: a SIGTERM (a scheduler's preemption notice) on any rank, or the run's wall-time
limit (`resilience.exit_duration_minutes`) on any rank, agreed by every rank at the same steps so
that all of them save the same checkpoint and stop together."""
from __future__ import annotations

import contextlib
import signal
import threading
import time

from ..distributed import device
from ..distributed.parallel import Parallel


class StopRequests:
    def __init__(self, check_interval: int, exit_duration_minutes: float, parallel: Parallel,
                 started: float | None = None):
        self.check_interval = check_interval  # resilience.stop_check_interval: steps between agreements
        self.exit_duration_minutes = exit_duration_minutes  # 0: no wall-time limit
        self.parallel = parallel
        self.started = time.monotonic() if started is None else started  # the wall time counts from here
        self.sigterm = False

    def request(self, *_signal_args) -> None:
        """What the SIGTERM handler does: ask; the ranks agree at the next check."""
        self.sigterm = True

    @contextlib.contextmanager
    def on_sigterm(self):
        """SIGTERM requests a stop while inside (the previous handler back afterwards); only the
        main thread can take signals, elsewhere nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self.request)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def agreed(self, step: int) -> str | None:
        """Why the ranks stop after `step`, if they do. Every rank calls it at the same steps (a
        collective every `check_interval` steps)."""
        if step % self.check_interval:
            return None
        minutes = (time.monotonic() - self.started) / 60
        over_time = bool(self.exit_duration_minutes) and minutes >= self.exit_duration_minutes
        sigterm, late = device.reduce_floats([self.sigterm, over_time], self.parallel.device, op="max")
        if sigterm:
            return "SIGTERM received"
        if late:
            return f"resilience.exit_duration_minutes ({self.exit_duration_minutes:g}) reached after {minutes:.1f} min"
        return None
