"""Selection on dev by each task's official metric (finetune/official_metrics.py: the GLUE and SQuAD
leaderboards' definitions, the same that picks a run's best epoch). The score of a trial is computed
from its best epoch's dev metrics (metrics.json "best"."metrics").

`select(task, records)` picks the task's best finished trial: the highest score, a tie going to the
earlier grid point, then the lower restart (records are given in expand() order, which fixes the
grid points' order). It reports mean and sample standard deviation (n-1; 0 for one run) of the
score over the finished restarts of the selected point, and lists the failed trials with their errors.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..official_metrics import OFFICIAL_METRICS, SelectionError, official_score
from .trials import TrialRecord

__all__ = ["OFFICIAL_METRICS", "Selection", "SelectionError", "official_score", "select", "select_all"]


@dataclass(frozen=True)
class Selection:
    task: str
    metric: str  # the official metric's description
    best: TrialRecord | None  # None: no finished trial
    score: float | None  # the best trial's official dev score (the metrics' own scale)
    mean: float | None  # over the finished restarts of the selected point
    std: float | None  # sample standard deviation (n-1); None with one restart (undefined)
    restart_scores: tuple[float, ...] = ()
    done: int = 0
    failed: tuple[tuple[str, str | None], ...] = ()  # (trial id, one-line error)
    planned: int | None = None  # trials of the task in the sweep, when known
    metrics: Mapping[str, float] = field(default_factory=dict)  # the best trial's dev metrics

    @property
    def point(self) -> dict[str, Any]:
        return dict(self.best.point) if self.best else {}

    @property
    def status(self) -> str:
        """done (a trial finished), failed (trials ran, every one failed) or not run."""
        if self.best is not None:
            return "done"
        return "failed" if self.failed else "not run"

    @property
    def not_finished(self) -> int | None:
        return None if self.planned is None else self.planned - self.done - len(self.failed)


def _point_key(point: Mapping[str, Any]) -> str:
    return repr(sorted(point.items()))


def select(task: str, records: Sequence[TrialRecord | None], planned: int | None = None) -> Selection:
    """The task's selection over its records (in expand() order; other tasks' records and None,
    a trial that has not finished, are skipped)."""
    mine = [r for r in records if r is not None and r.task == task]
    order: dict[str, int] = {}
    for r in mine:
        order.setdefault(_point_key(r.point), len(order))
    failed = tuple((r.id, r.error) for r in mine if r.status == "failed")
    done = []
    for r in mine:
        if r.status == "done":
            try:
                done.append((official_score(task, r.metrics or {}), r))
            except SelectionError as e:
                raise SelectionError(f"trial {r.id}: {e}") from None
    metric = OFFICIAL_METRICS[task].description
    if not done:
        return Selection(task, metric, None, None, None, None, (), 0, failed, planned)
    score, best = min(done, key=lambda sr: (-sr[0], order[_point_key(sr[1].point)], sr[1].restart))
    same = sorted((r.restart, s) for s, r in done if _point_key(r.point) == _point_key(best.point))
    scores = tuple(s for _, s in same)
    std = statistics.stdev(scores) if len(scores) > 1 else None
    return Selection(task, metric, best, score, statistics.fmean(scores), std, scores, len(done), failed, planned,
                     dict(best.metrics or {}))


def select_all(tasks: Sequence[str], records: Sequence[TrialRecord | None],
               planned: Mapping[str, int] | None = None) -> list[Selection]:
    """select() for each task, in the given order."""
    return [select(t, records, (planned or {}).get(t)) for t in tasks]
