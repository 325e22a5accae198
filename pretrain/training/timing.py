"""The phase timers and the straggler watch that reads them (logging.timers, logging.stragglers)."""
from __future__ import annotations

from ..config.reporting import LoggingConfig
from ..distributed import device, internals
from ..distributed.parallel import Parallel
from ..observability.stragglers import StragglerWatch
from ..observability.timers import NoTimers, PhaseTimers, time_communication


def phase_timers(c: LoggingConfig, p: Parallel, engine) -> tuple[PhaseTimers | NoTimers, StragglerWatch | None]:
    """logging.timers: time each phase, also inside DeepSpeed (the calls in which a rank waits for
    the others: gradient reduction, ZeRO-3's parameter gathers, pipeline transfers; the optimizer
    wrapper's step, which the pipeline engine calls from train_batch), synchronising a GPU at every
    phase boundary. logging.stragglers alone (more than one rank): the same phases, a GPU
    synchronised only where the step's work starts and ends and around those waits (timers.py), for
    every rank's own step time; every rank's host and device are gathered once per log window (a
    collective)."""
    watches = c.stragglers and p.world_size > 1
    if not (c.timers or watches):
        return NoTimers(), None
    timers = PhaseTimers(lambda: device.synchronize(p.device), every_boundary=c.timers)
    time_communication(timers, engine)
    if c.timers:
        timers.time_optimizer(internals.client_optimizer(engine))
    watch = StragglerWatch(c.straggler_share, c.straggler_windows, p, timed_phases=c.timers) if watches else None
    return timers, watch
