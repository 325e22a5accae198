"""Each task's official dev score (the GLUE and SQuAD leaderboards' definitions): the one number that
picks a fine-tuning run's best epoch (finetune/finetuner.py, finetune/feature_tagger.py) and a
sweep's best trial (finetune/sweep/selection.py), so the two never disagree.

- cola: matthews_corr; sst2, qnli, rte, wnli, swag: accuracy;
- mrpc, qqp: the mean of f1 and accuracy (GLUE averages them);
- stsb: the mean of pearson and spearman;
- mnli: the matched dev set's accuracy (dev_matched/accuracy), the mismatched one reported;
- squad, squad2: f1 (exact match reported); conll2003: f1.

Metrics of several dev sets are keyed `<dev set>/<metric>`, of one dev set `<metric>`. The score
reads the task's own dev set where it names one (MNLI: dev_matched), else the only dev set, else
the mean over the dev sets given (a user's extra dev files). Torch-free: the sweep's table uses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from pretrain.common.errors import UserError


class SelectionError(UserError, ValueError):
    """A metrics dict lacks a key the task's official metric needs."""


@dataclass(frozen=True)
class OfficialMetric:
    keys: tuple[str, ...]  # metric names, averaged
    description: str
    reported: tuple[str, ...] = ()  # also shown (exact match, MNLI mismatched)
    dev_set: str | None = None  # the dev set that counts when there are several (MNLI: matched)


OFFICIAL_METRICS: Mapping[str, OfficialMetric] = {
    "cola": OfficialMetric(("matthews_corr",), "Matthews correlation"),
    "sst2": OfficialMetric(("accuracy",), "accuracy"),
    "mrpc": OfficialMetric(("f1", "accuracy"), "mean of F1 and accuracy", ("f1", "accuracy")),
    "stsb": OfficialMetric(("pearson", "spearman"), "mean of Pearson and Spearman", ("pearson", "spearman")),
    "qqp": OfficialMetric(("f1", "accuracy"), "mean of F1 and accuracy", ("f1", "accuracy")),
    "mnli": OfficialMetric(("accuracy",), "matched accuracy", ("dev_matched/accuracy", "dev_mismatched/accuracy"),
                           dev_set="dev_matched"),
    "qnli": OfficialMetric(("accuracy",), "accuracy"),
    "rte": OfficialMetric(("accuracy",), "accuracy"),
    "wnli": OfficialMetric(("accuracy",), "accuracy"),
    "squad": OfficialMetric(("f1",), "F1", ("f1", "exact_match")),
    "squad2": OfficialMetric(("f1",), "F1", ("f1", "exact")),
    "swag": OfficialMetric(("accuracy",), "accuracy"),
    "conll2003": OfficialMetric(("f1",), "F1"),
}


def official_metric(task: str) -> OfficialMetric:
    if task not in OFFICIAL_METRICS:
        raise SelectionError(f"no official metric for task {task!r}; tasks: {', '.join(OFFICIAL_METRICS)}")
    return OFFICIAL_METRICS[task]


def _value(official: OfficialMetric, name: str, metrics: Mapping[str, float]) -> float | None:
    if name in metrics:  # one dev set
        return float(metrics[name])
    if official.dev_set is not None:
        key = f"{official.dev_set}/{name}"
        return float(metrics[key]) if key in metrics else None
    per_set = [float(v) for k, v in metrics.items() if "/" in k and k.rsplit("/", 1)[1] == name]
    return sum(per_set) / len(per_set) if per_set else None


def official_score(task: str, metrics: Mapping[str, float]) -> float:
    """The task's official dev score of a metrics dict; SelectionError naming the missing key."""
    official = official_metric(task)
    values = {name: _value(official, name, metrics) for name in official.keys}
    missing = [name if official.dev_set is None else f"{official.dev_set}/{name}"
               for name, value in values.items() if value is None]
    if missing:
        raise SelectionError(f"{task}: the metrics lack {', '.join(missing)} (the official metric is "
                             f"{official.description}); they have: {', '.join(metrics) or 'none'}")
    return sum(values.values()) / len(values)
