"""The trials a sweep spec expands to, and the record (trial.json) a runner writes for each.

A trial is one ``python -m finetune TASK`` run: a task, one point of the grid, one restart (0-based;
seed = sweep.first_seed + restart). Its directory, relative to sweep.output_dir, is
``<task>/<point>/restart-<r>``, e.g. ``mrpc/lr-5e-05_global_batch_size-32_epochs-3/restart-0``:
a grid key is named by its field (``lr``) unless two grid keys share a field name (train.lr and
features.lr), then by its dotted name; a value by its YAML text made filesystem-safe (a float with
no fraction without ``.0``). A spec with no grid has the one point ``default``. The trial's id is its
directory (unique, stable across runs of the same spec).

trial.json, written by the runner when the trial ended (write_trial_record: atomically)::

    {"id", "task", "point": {key: value}, "restart", "seed", "status": "done" | "failed",
     "error": one line or null, "seconds"}

A done trial's directory also holds the fine-tuning run's metrics.json (its "best" entry is what
selection reads) and submission/ folder. A missing or unreadable trial.json, or a "done" one whose
metrics.json cannot be read, reads as None: the trial has not finished.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from pretrain.common.atomic import replace_durably
from pretrain.config import ConfigError

from .spec import SweepSpec

logger = logging.getLogger(__name__)

TRIAL_FILE = "trial.json"
STATUSES = ("done", "failed")


def yaml_text(value: Any) -> str:
    """A value as the YAML text of a dotted override (JSON is YAML: strings quoted, tuples as lists)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def value_name(value: Any) -> str:
    """A grid value in a directory name: 5e-05, 32, 3 (for 3.0), true, a-string, 1,2 for a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(value_name(v) for v in value)
    if value is None:
        return "null"
    return _safe(str(value))


def key_names(keys: list[str]) -> dict[str, str]:
    """Each grid key's name in a directory: its field, or its dotted name when fields clash."""
    fields = [k.split(".", 1)[-1] for k in keys]
    return {k: f if fields.count(f) == 1 else k for k, f in zip(keys, fields)}


@dataclass(frozen=True)
class Trial:
    task: str
    point: tuple[tuple[str, Any], ...]  # (dotted key, value) in grid order
    restart: int  # 0-based
    seed: int
    id: str
    directory: str  # relative to sweep.output_dir, '/'-separated

    def overrides(self, spec: SweepSpec) -> list[str]:
        """The dotted overrides of ``python -m finetune TASK``: data_root's task.data_dir, the sweep's
        overrides, the task's, the grid point, then train.seed and train.output_dir (later ones win)."""
        return [*spec.task_data_overrides(self.task), *spec.overrides, *spec.task_overrides.get(self.task, ()),
                *(f"{key}={yaml_text(value)}" for key, value in self.point),
                f"train.seed={self.seed}", f"train.output_dir={yaml_text(self.output_dir(spec))}"]

    def output_dir(self, spec: SweepSpec) -> str:
        return os.path.join(spec.output_dir, *self.directory.split("/"))

    def point_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.point}


def point_directory(point: tuple[tuple[str, Any], ...], names: Mapping[str, str]) -> str:
    return "_".join(f"{_safe(names[k])}-{value_name(v)}" for k, v in point) or "default"


def expand(spec: SweepSpec) -> list[Trial]:
    """Every trial: tasks in the spec's order, then the grid's cartesian product in key order (the
    last key varying fastest), then the restarts. Deterministic; a ConfigError if two points would
    share a directory (values that differ only in characters a file name cannot hold)."""
    keys = [k for k, _ in spec.grid]
    names = key_names(keys)
    points = [tuple(zip(keys, values)) for values in itertools.product(*(v for _, v in spec.grid))]
    trials, seen = [], {}
    for task in spec.tasks:
        for point in points:
            for restart in range(spec.restarts):
                directory = f"{task}/{point_directory(point, names)}/restart-{restart}"
                if directory in seen:
                    raise ConfigError(f"sweep.grid: points {dict(seen[directory])} and {dict(point)} would share "
                                      f"the directory {directory}: give values that differ in letters or digits")
                seen[directory] = point
                trials.append(Trial(task, point, restart, spec.seed(restart), directory, directory))
    return trials


@dataclass(frozen=True)
class TrialRecord:
    id: str
    task: str
    point: dict[str, Any]
    restart: int
    seed: int
    status: str  # done | failed
    error: str | None = None
    seconds: float | None = None
    # read, not written: where the record was read from, and a done trial's best dev metrics
    directory: str | None = field(default=None, compare=False)
    metrics: dict[str, float] | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "task": self.task, "point": self.point, "restart": self.restart, "seed": self.seed,
                "status": self.status, "error": self.error, "seconds": self.seconds}


def record_for(trial: Trial, status: str, error: str | None = None, seconds: float | None = None) -> TrialRecord:
    """The record of a trial that ended; the error is kept to its first line."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} must be one of {', '.join(STATUSES)}")
    line = None if error is None else (str(error).strip().splitlines() or [""])[0]
    return TrialRecord(trial.id, trial.task, trial.point_dict(), trial.restart, trial.seed, status, line, seconds)


def write_trial_record(directory: str, record: TrialRecord) -> None:
    """trial.json in the trial's directory, atomically (a temporary sibling renamed over it)."""
    os.makedirs(directory, exist_ok=True)
    replace_durably(os.path.join(directory, TRIAL_FILE), json.dumps(record.to_json(), indent=1) + "\n")


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_trial_record(directory: str) -> TrialRecord | None:
    """The trial's record, with a done trial's best dev metrics (metrics.json's "best"."metrics");
    None when trial.json is absent or unreadable, or the trial is done but its metrics are not
    readable: that trial counts as not finished (logged)."""
    path = os.path.join(directory, TRIAL_FILE)
    if not os.path.exists(path):
        return None
    try:
        d = _read_json(path)
        record = TrialRecord(id=str(d["id"]), task=str(d["task"]), point=dict(d["point"]), restart=int(d["restart"]),
                             seed=int(d["seed"]), status=str(d["status"]), error=d.get("error"),
                             seconds=d.get("seconds"), directory=directory)
        if record.status not in STATUSES:
            raise ValueError(f"status {record.status!r} is not one of {', '.join(STATUSES)}")
        if record.status == "done":
            metrics = _read_json(os.path.join(directory, "metrics.json"))["best"]["metrics"]
            if not isinstance(metrics, dict):
                raise ValueError("metrics.json: best.metrics is not a mapping")
            record = TrialRecord(**{**record.__dict__, "metrics": {str(k): float(v) for k, v in metrics.items()}})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning(f"{directory}: unreadable trial record ({type(e).__name__}: {e}); counted as not finished")
        return None
    return record


def read_records(spec: SweepSpec, trials: list[Trial] | None = None) -> list[tuple[Trial, TrialRecord | None]]:
    """Each trial (expand order) with its record, None for a trial that has not finished."""
    return [(t, read_trial_record(t.output_dir(spec))) for t in (trials if trials is not None else expand(spec))]
