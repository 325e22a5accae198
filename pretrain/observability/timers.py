"""Where a training step's time goes: data, forward, backward, gradient reduction, optimizer.

Each phase's time is exclusive: when a phase starts inside another (the gradient all-reduce that
DeepSpeed runs inside `engine.backward`, the optimizer step inside the pipeline engine's
`train_batch`), the outer one's clock stops until it ends. With pipeline parallelism forward and
backward interleave inside the engine and are reported together as `forward_backward`.

On a GPU the device is synchronised at every phase boundary (as Megatron-LM's timers do), so the
times are the device's work, not the launch of its kernels; that costs some overlap, which is why
the timers are off unless logging.timers is set.
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

    def start(self, name: str) -> bool:
        """Begin phase `name`, pausing the one running; False (and nothing done) when `name` is
        already the innermost phase (a timed call inside a timed call of the same phase)."""
        if self._stack and self._stack[-1][0] == name:
            return False
        self._synchronize()
        now = time.perf_counter()
        if self._stack:  # pause the outer phase
            outer = self._stack[-1]
            self._totals[outer[0]] += now - outer[1]
        self._stack.append([name, now])
        return True

    def stop(self) -> None:
        """End the innermost phase; the one it interrupted resumes."""
        self._synchronize()
        now = time.perf_counter()
        name, started = self._stack.pop()
        self._totals[name] += now - started
        if self._stack:
            self._stack[-1][1] = now

    @contextlib.contextmanager
    def phase(self, name: str):
        started = self.start(name)
        try:
            yield
        finally:
            if started:
                self.stop()

    def time_optimizer(self, optimizer) -> None:
        """Count torch optimizer steps as "optimizer", through its step hooks (wrapping `step`
        itself after an LR scheduler was built would hide it from the scheduler's bookkeeping)."""
        started = []
        optimizer.register_step_pre_hook(lambda *_: started.append(self.start("optimizer")))
        optimizer.register_step_post_hook(lambda *_: self.stop() if started.pop() else None)

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
    """logging.timers off: the same interface, doing nothing."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def time_method(self, owner, method: str, name: str) -> None:
        pass

    def time_optimizer(self, optimizer) -> None:
        pass

    def read(self, steps: int) -> dict[str, float]:
        return {}
