"""Where a training step's time goes: data, forward, backward, gradient reduction, optimizer.

Each phase's time is exclusive: when a phase starts inside another (the gradient all-reduce that
DeepSpeed runs inside `engine.backward`, the optimizer step inside the pipeline engine's
`train_batch`), the outer one's clock stops until it ends. With pipeline parallelism forward and
backward interleave inside the engine and are reported together as `forward_backward`.

The phases are of two kinds. WORK_PHASES are the rank's own work; WAIT_PHASES are the DeepSpeed
calls in which a rank waits for the others (`time_communication`: the data-parallel gradient
reduction, ZeRO-3's parameter gathers, the pipeline's transfers). The sum of the work phases,
which being exclusive leave the waits nested in them out, is a rank's own step time (`own_ms`),
which pretrain/observability/stragglers.py compares over the ranks.

On a GPU the device is synchronised at phase boundaries, so that the times are the device's
work, not the launch of its kernels. With logging.timers at every boundary, as Megatron-LM's
timers do (it costs some overlap: the timers are off by default). For the straggler figures
alone (`every_boundary=False`, logging.stragglers) only where a rank's time changes
kind: where the step's top-level work phases begin and end, and around the waiting calls, except
the ones marked unsynchronised (ZeRO-3's per-module parameter gathers, whose prefetch overlap a
synchronisation would cost, and the bucket reductions that overlap_comm overlaps with backward):
there, on a GPU, waiting counts as work. Nothing is synchronised on the CPU.
"""
from __future__ import annotations

import contextlib
import time
import types
from collections import defaultdict
from typing import Callable

PHASES = ("data", "forward", "backward", "forward_backward", "param_gather", "pipe_comm", "grad_reduce", "optimizer")
WORK_PHASES = ("forward", "backward", "forward_backward", "optimizer")  # the rank's own work
WAIT_PHASES = ("param_gather", "pipe_comm", "grad_reduce")  # communication: waiting for the other ranks
# how the log line names each phase
PHASE_LABELS = {"data": "data", "forward": "fwd", "backward": "bwd", "forward_backward": "fwd+bwd",
                "param_gather": "gather", "pipe_comm": "p2p", "grad_reduce": "reduce", "optimizer": "opt"}


class PhaseTimers:
    def __init__(self, synchronize: Callable[[], None], every_boundary: bool = True):
        self._synchronize = synchronize
        self._every_boundary = every_boundary
        self._totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [phase, started, synchronised] of the phases running, innermost last

    def _synchronizes(self, name: str, synced: bool) -> bool:
        """Whether phase `name` synchronises the device at its boundaries: all do with
        every_boundary; otherwise the waits marked synced and the step's top-level work phases."""
        if self._every_boundary:
            return True
        if name in WAIT_PHASES:
            return synced
        return name in WORK_PHASES and not self._stack

    def start(self, name: str, synced: bool = True) -> bool:
        """Begin phase `name`, pausing the one running; False (and nothing done) when `name` is
        already the innermost phase (a timed call inside a timed call of the same phase)."""
        if self._stack and self._stack[-1][0] == name:
            return False
        synchronizes = self._synchronizes(name, synced)
        if synchronizes:
            self._synchronize()
        now = time.perf_counter()
        if self._stack:  # pause the outer phase
            outer = self._stack[-1]
            self._totals[outer[0]] += now - outer[1]
        self._stack.append([name, now, synchronizes])
        return True

    def stop(self) -> None:
        """End the innermost phase; the one it interrupted resumes."""
        name, started, synchronizes = self._stack[-1]
        if synchronizes:
            self._synchronize()
        now = time.perf_counter()
        self._stack.pop()
        self._totals[name] += now - started
        if self._stack:
            self._stack[-1][1] = now

    @contextlib.contextmanager
    def phase(self, name: str, synced: bool = True):
        started = self.start(name, synced)
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

    def time_method(self, owner, method: str, name: str, synced: bool = True) -> None:
        """Count every call of owner.<method> (an instance method) made inside a phase as phase
        `name`; a call outside the step's phases (an evaluation's, a save's) is not timed."""
        inner = getattr(owner, method)

        def timed(self_, *args, **kwargs):
            if not self._stack:
                return inner(*args, **kwargs)
            with self.phase(name, synced):
                return inner(*args, **kwargs)

        setattr(owner, method, types.MethodType(timed, owner))

    def time_function(self, table: dict, key, name: str, synced: bool = True) -> None:
        """The same for the plain function table[key] (called with its owner as first argument)."""
        inner = table[key]

        def timed(*args, **kwargs):
            if not self._stack:
                return inner(*args, **kwargs)
            with self.phase(name, synced):
                return inner(*args, **kwargs)

        table[key] = timed

    def read(self, steps: int) -> dict[str, float]:
        """Milliseconds per step of each phase that ran since the last read; resets."""
        totals, self._totals = self._totals, defaultdict(float)
        return {name: 1e3 * totals[name] / steps for name in PHASES if name in totals}


def own_ms(phase_ms: dict[str, float]) -> float:
    """A rank's own step time from what `read` returned: its work, without its waits."""
    return sum(phase_ms.get(name, 0.0) for name in WORK_PHASES)


def wait_ms(phase_ms: dict[str, float]) -> float:
    return sum(phase_ms.get(name, 0.0) for name in WAIT_PHASES)


class NoTimers:
    """logging.timers and logging.stragglers off: the same interface, doing nothing."""

    def phase(self, name: str, synced: bool = True):
        return contextlib.nullcontext()

    def time_method(self, owner, method: str, name: str, synced: bool = True) -> None:
        pass

    def time_function(self, table: dict, key, name: str, synced: bool = True) -> None:
        pass

    def time_optimizer(self, optimizer) -> None:
        pass

    def read(self, steps: int) -> dict[str, float]:
        return {}


# ----------------------------------------------------------------------------- DeepSpeed's waits
def time_communication(timers: PhaseTimers, engine) -> None:
    """Time every waiting call of `engine` (internals.waiting_calls: DeepSpeed's own names) as its
    WAIT_PHASES phase."""
    from ..distributed.internals import waiting_calls

    for call in waiting_calls(engine):
        if isinstance(call.owner, dict):
            timers.time_function(call.owner, call.name, call.phase, call.synced)
        else:
            timers.time_method(call.owner, call.name, call.phase, call.synced)
