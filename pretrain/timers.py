"""Where a training step's time goes: data, forward, backward, gradient reduction, optimizer.

Each phase's time is exclusive: when a phase starts inside another (the gradient all-reduce that
DeepSpeed runs inside `engine.backward`, the optimizer step inside the pipeline engine's
`train_batch`), the outer one's clock stops until it ends. With pipeline parallelism forward and
backward interleave inside the engine and are reported together as `forward_backward`.

On a GPU the device is synchronised at every phase boundary (as Megatron-LM's timers do), so the
times are the device's work, not the launch of its kernels; that costs some overlap, which is why
the timers are off unless train.timers is set.
"""
from __future__ import annotations

import contextlib
import time
import types
from collections import defaultdict
from typing import Callable

PHASES = ("data", "forward", "backward", "forward_backward", "grad_reduce", "optimizer")


class PhaseTimers:
    def __init__(self, synchronize: Callable[[], None]):
        self._synchronize = synchronize
        self._totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, started] of the phases running, innermost last

    @contextlib.contextmanager
    def phase(self, name: str):
        if self._stack and self._stack[-1][0] == name:  # re-entered (a wrapped method calling itself)
            yield
            return
        self._synchronize()
        now = time.perf_counter()
        if self._stack:  # pause the outer phase
            outer = self._stack[-1]
            self._totals[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            self._synchronize()
            now = time.perf_counter()
            self._totals[name] += now - self._stack.pop()[1]
            if self._stack:
                self._stack[-1][1] = now  # the outer phase resumes

    def time_method(self, owner, method: str, name: str) -> None:
        """Count every call of owner.<method> (an instance method) as phase `name`."""
        inner = getattr(owner, method)

        def timed(self_, *args, **kwargs):
            with self.phase(name):
                return inner(*args, **kwargs)

        setattr(owner, method, types.MethodType(timed, owner))

    def read(self, steps: int) -> dict[str, float]:
        """Milliseconds per step of each phase that ran since the last read; resets."""
        totals, self._totals = self._totals, defaultdict(float)
        return {name: 1e3 * totals[name] / steps for name in PHASES if name in totals}


class NoTimers:
    """train.timers off: the same interface, doing nothing."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def time_method(self, owner, method: str, name: str) -> None:
        pass

    def read(self, steps: int) -> dict[str, float]:
        return {}
