"""Stragglers: the rank that slows a whole job, named.

In data- and pipeline-parallel training every rank waits for the slowest one at each collective,
so one slow GPU, node or loader slows every step, and rank 0's timings alone do not show which.
Once per log window every rank's own figures travel in the window's one metric collective
(pretrain/training/metrics.py `reduce_window`: each rank writes its row of a [world_size, k]
zero table that the sum all-reduce turns into everyone's table):

- step_ms: its own step time, the time it spent on its own work (forward, backward, optimizer)
  without the time it waited for the other ranks inside DeepSpeed's communication (the gradient
  reduction, ZeRO-3's parameter gathers, the pipeline's transfers: pretrain/observability/
  timers.py WORK_PHASES and WAIT_PHASES), per step of the window;
- data_wait_ms: its wait for its data loader, per step;
- wait_ms: its time inside those waiting calls, per step;
- with logging.timers, every phase of timers.PHASES, per step.

A rank whose step_ms is above the median of its peers by more than logging.straggler_share in
logging.straggler_windows consecutive windows is named once in a warning line (with its host and
device, gathered once at start-up), and in an information line when it is back. Its peers are the
ranks of its pipeline stage, whose work is the same; a stage of one rank (no data or tensor
parallelism) is compared with every rank.

`StragglerDetector` and the line builders are plain Python (tests/test_stragglers.py);
`StragglerWatch` is what the trainer holds.
"""
from __future__ import annotations

import socket
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .timers import PHASE_LABELS, PHASES, own_ms, wait_ms

# the figures every rank contributes per window, in its row's order (then PHASES with logging.timers)
FIGURES = ("step_ms", "data_wait_ms", "wait_ms")


@dataclass(frozen=True)
class Place:
    """Where a rank runs."""

    host: str
    device: str
    stage: int  # its pipeline stage


@dataclass(frozen=True)
class Named:
    """A rank above its peers' median for `windows` log windows in a row."""

    rank: int
    ms: float
    median: float
    peers: int  # how many ranks the median is over
    windows: int


class StragglerDetector:
    """Consecutive log windows in which each rank's own step time is above the median of its
    peers by more than `share`; `update` names a rank once per such streak, at its `windows`-th
    window, and says when a named rank is back within the share."""

    def __init__(self, share: float, windows: int, stages: Sequence[int]):
        self.share, self.windows = share, windows
        self.stages = list(stages)
        self.streaks = [0] * len(self.stages)
        self._peers = self._peer_groups()

    def _peer_groups(self) -> list[list[int]]:
        """Per rank, the ranks its figure is compared with: its stage's, or all for a stage of one."""
        everyone = list(range(len(self.stages)))
        by_stage: dict[int, list[int]] = {}
        for rank, stage in enumerate(self.stages):
            by_stage.setdefault(stage, []).append(rank)
        return [by_stage[stage] if len(by_stage[stage]) > 1 else everyone for stage in self.stages]

    def medians(self, step_ms: Sequence[float]) -> list[float]:
        """Per rank, the median of its peers' figures (its own among them)."""
        return [statistics.median(step_ms[r] for r in peers) for peers in self._peers]

    def update(self, step_ms: Sequence[float]) -> tuple[list[Named], list[int]]:
        """One window's figures (ms, one per rank): (the ranks named now, the named ones back)."""
        if len(step_ms) != len(self.stages):
            raise ValueError(f"{len(step_ms)} figures for {len(self.stages)} ranks")
        named, back = [], []
        for rank, (ms, median) in enumerate(zip(step_ms, self.medians(step_ms))):
            if median > 0 and ms > median * (1 + self.share):
                self.streaks[rank] += 1
                if self.streaks[rank] == self.windows:
                    named.append(Named(rank, ms, median, len(self._peers[rank]), self.windows))
            else:
                if self.streaks[rank] >= self.windows:
                    back.append(rank)
                self.streaks[rank] = 0
        return named, back


@dataclass
class WindowFigures:
    """Every rank's figures of one log window (ms per step), with what the detector made of them."""

    step_ms: list[float]
    data_wait_ms: list[float]
    wait_ms: list[float]
    phases: list[dict[str, float]] = field(default_factory=list)  # per rank, with logging.timers
    warnings: list[str] = field(default_factory=list)
    back: list[str] = field(default_factory=list)

    @classmethod
    def from_table(cls, table: Sequence[Sequence[float]], phases: Sequence[str] = ()) -> WindowFigures:
        """From the gathered [world_size][FIGURES + phases] rows."""
        width = len(FIGURES)
        return cls([row[0] for row in table], [row[1] for row in table], [row[2] for row in table],
                   [dict(zip(phases, row[width:])) for row in table] if phases else [])

    def spread(self) -> tuple[float, float, float, int]:
        """(min, median, max, the slowest rank) of the own step times."""
        ms = self.step_ms
        slowest = max(range(len(ms)), key=lambda r: ms[r])
        return min(ms), statistics.median(ms), ms[slowest], slowest

    def line(self) -> str:
        """The log line's figure: `step ms min 410 med 415 max 980 (rank 1)`."""
        low, median, high, slowest = self.spread()
        return f"step ms min {low:.0f} med {median:.0f} max {high:.0f} (rank {slowest})"

    def scalars(self) -> dict[str, float]:
        """TensorBoard's stragglers/*: each rank's figures, and the spread of the own step times."""
        low, median, high, _ = self.spread()
        values = {"min_ms": low, "median_ms": median, "max_ms": high}
        for rank, ms in enumerate(self.step_ms):
            values[f"rank_{rank}_ms"] = ms
            values[f"rank_{rank}_data_wait_ms"] = self.data_wait_ms[rank]
            values[f"rank_{rank}_wait_ms"] = self.wait_ms[rank]
            for phase, value in (self.phases[rank] if self.phases else {}).items():
                values[f"rank_{rank}_{phase}_ms"] = value
        return values


def warning_line(named: Named, place: Place, figures: WindowFigures, step: int, share: float) -> str:
    """The warning that names a straggler (see docs/troubleshooting.md#stragglers)."""
    peers = f"its pipeline stage's {named.peers} ranks" if named.peers < len(figures.step_ms) else \
        f"all {named.peers} ranks"
    line = (f"straggler: rank {named.rank} (host {place.host}, device {place.device}) worked "
            f"{named.ms:.0f} ms/step against a median of {named.median:.0f} over {peers} "
            f"(+{100 * (named.ms / named.median - 1):.0f}%, more than logging.straggler_share={share:g}) "
            f"in {named.windows} log windows in a row, to step {step}: the other ranks wait for it. "
            f"Its data wait {figures.data_wait_ms[named.rank]:.0f} ms/step "
            f"(median {statistics.median(figures.data_wait_ms):.0f})")
    if figures.phases:
        mine = figures.phases[named.rank]
        line += "; its phases (median): " + " ".join(
            f"{PHASE_LABELS[p]} {mine[p]:.0f} ({statistics.median(f[p] for f in figures.phases):.0f})"
            for p in PHASES if mine.get(p))
    return line


def back_line(rank: int, figures: WindowFigures, median: float, step: int, share: float) -> str:
    return (f"straggler: rank {rank} is back within logging.straggler_share={share:g} of the median "
            f"({figures.step_ms[rank]:.0f} against {median:.0f} ms/step) at step {step}")


def place_of(parallel) -> Place:
    return Place(socket.gethostname(), str(parallel.device), parallel.pp_rank)


class StragglerWatch:
    """The trainer's part: this rank's row of a window's collective, and what every rank's rows
    say (the lines are the logging rank's to print). Built on every rank at start-up, where it
    gathers every rank's place (one all_gather_object, once)."""

    def __init__(self, share: float, windows: int, parallel, timed_phases: bool):
        from ..distributed import device  # here: the rest of the module is plain Python, no torch

        self.share = share
        self.phases = PHASES if timed_phases else ()
        self.places = [Place(**p) for p in device.all_gather_object(asdict(place_of(parallel)))]
        self.detector = StragglerDetector(share, windows, [p.stage for p in self.places])

    def row(self, phase_ms: dict[str, float], data_wait_ms: float) -> list[float]:
        """This rank's figures of the window (ms per step), from the timers' read()."""
        return [own_ms(phase_ms), data_wait_ms, wait_ms(phase_ms), *(phase_ms.get(p, 0.0) for p in self.phases)]

    def judge(self, table: Sequence[Sequence[float]], step: int) -> WindowFigures:
        """Every rank's figures of the window ending at `step`, with the warnings they call for."""
        figures = WindowFigures.from_table(table, self.phases)
        medians = self.detector.medians(figures.step_ms)
        named, back = self.detector.update(figures.step_ms)
        figures.warnings = [warning_line(n, self.places[n.rank], figures, step, self.share) for n in named]
        figures.back = [back_line(r, figures, medians[r], step, self.share) for r in back]
        return figures
