"""The sweep's results in the BERT paper's Table 1 layout, written as Markdown, CSV and JSON.

GLUE (Table 1's columns): MNLI-m, MNLI-mm (the selected MNLI model's matched and mismatched
accuracy), QQP (F1), QNLI (accuracy), SST-2 (accuracy), CoLA (Matthews), STS-B (Spearman), MRPC (F1),
RTE (accuracy), Average. Values are dev-set numbers x100 with one decimal, as the paper prints them.

Average: as in the paper, the mean of the nine columns MNLI-m, MNLI-mm, QQP, QNLI, SST-2, CoLA,
STS-B, MRPC and RTE, MNLI counted twice (once per column) and WNLI left out (the paper's
"problematic WNLI set"); this reproduces the paper's own averages (BERT-base: 716.4 / 9 = 79.6,
BERT-large: 738.7 / 9 = 82.1). It is taken over the unrounded values, and shown only when every
column has a value (otherwise "-"). WNLI appears in the per-task details, not in Table 1.

Other tasks (squad, squad2, swag, conll2003) go in a second table with their own metrics (SQuAD's
F1 and exact match are already percentages; SWAG's accuracy and CoNLL's F1 are x100).

A task with no finished trial shows "failed" (its trials ran and failed) or "not run", never a number.
Per task the details give the selected configuration, its dev score, the mean ± std of the score
over the restarts of that configuration, the counts of trials and the failed trials with their errors.
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Sequence

from pretrain.common.atomic import atomic_outputs

from .selection import Selection

# (column, task, metric key) in Table 1's order
GLUE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("MNLI-m", "mnli", "dev_matched/accuracy"), ("MNLI-mm", "mnli", "dev_mismatched/accuracy"),
    ("QQP", "qqp", "f1"), ("QNLI", "qnli", "accuracy"), ("SST-2", "sst2", "accuracy"),
    ("CoLA", "cola", "matthews_corr"),
    ("STS-B", "stsb", "spearman"), ("MRPC", "mrpc", "f1"), ("RTE", "rte", "accuracy"))
AVERAGE = "Average"
# task -> (its name in the table, [(column, metric key, scale)])
OTHER_TASKS: dict[str, tuple[str, tuple[tuple[str, str, float], ...]]] = {
    "squad": ("SQuAD 1.1", (("F1", "f1", 1.0), ("EM", "exact_match", 1.0))),
    "squad2": ("SQuAD 2.0", (("F1", "f1", 1.0), ("EM", "exact", 1.0))),
    "swag": ("SWAG", (("Accuracy", "accuracy", 100.0),)),
    "conll2003": ("CoNLL-2003 NER", (("F1", "f1", 100.0),)),
}
SCALE = {"squad": 1.0, "squad2": 1.0}  # of the official score; others x100


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _missing(selection: Selection | None) -> str:
    return "not run" if selection is None else selection.status


def glue_row(selections: Sequence[Selection]) -> dict[str, float | str | None]:
    """{column: value x100, or "failed" / "not run", or None when the metric is absent}; Average
    when every column has a number (None otherwise)."""
    by_task = {s.task: s for s in selections}
    row: dict[str, float | str | None] = {}
    for column, task, key in GLUE_COLUMNS:
        s = by_task.get(task)
        if s is None or s.best is None:
            row[column] = _missing(s)
        else:
            row[column] = 100.0 * s.metrics[key] if key in s.metrics else None
    values = [row[c] for c, _, _ in GLUE_COLUMNS]
    row[AVERAGE] = (sum(values) / len(values)) if all(isinstance(v, float) for v in values) else None
    return row


def other_rows(selections: Sequence[Selection]) -> list[dict[str, Any]]:
    rows = []
    for s in selections:
        if s.task not in OTHER_TASKS:
            continue
        name, columns = OTHER_TASKS[s.task]
        values: dict[str, float | str | None] = {}
        for column, key, scale in columns:
            if s.best is None:
                values[column] = s.status
            else:
                values[column] = scale * s.metrics[key] if key in s.metrics else None
        rows.append({"task": name, "values": values})
    return rows


def _cell(value: float | str | None) -> str:
    return value if isinstance(value, str) else fmt(value)


def _scale(task: str) -> float:
    return SCALE.get(task, 100.0)


def _point_text(point: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in point.items()) or "(no grid)"


def details(selection: Selection) -> dict[str, Any]:
    """The per-task entry of results.json (scores on the metrics' own scale, as in metrics.json)."""
    s = selection
    return {"task": s.task, "status": s.status, "metric": s.metric, "score": s.score, "mean": s.mean, "std": s.std,
            "restart_scores": list(s.restart_scores), "selected": s.best.id if s.best else None, "point": s.point,
            "restart": s.best.restart if s.best else None, "seed": s.best.seed if s.best else None,
            "metrics": dict(s.metrics), "done": s.done, "failed": len(s.failed), "planned": s.planned,
            "failed_trials": [{"id": i, "error": e} for i, e in s.failed]}


def _mean_std(s: Selection) -> str:
    if s.mean is None:
        return "-"
    k = _scale(s.task)
    if s.std is None:  # one restart: no spread to report
        return f"{fmt(k * s.mean)} (n=1)"
    return f"{fmt(k * s.mean)} ± {fmt(k * s.std)} (n={len(s.restart_scores)})"


def markdown(selections: Sequence[Selection]) -> str:
    out = []
    glue_tasks = {t for _, t, _ in GLUE_COLUMNS}
    if any(s.task in glue_tasks for s in selections):
        row = glue_row(selections)
        columns = [c for c, _, _ in GLUE_COLUMNS] + [AVERAGE]
        out += ["## GLUE (dev)", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
                "| " + " | ".join(_cell(row[c]) for c in columns) + " |", ""]
    others = other_rows(selections)
    if others:
        out += ["## Other tasks (dev)", "", "| Task | Metrics |", "|---|---|"]
        out += [f"| {r['task']} | " + ", ".join(f"{c} {_cell(v)}" for c, v in r["values"].items()) + " |"
                for r in others]
        out.append("")
    out += ["## Selected configurations", "",
            "| Task | Official metric | Selected | Dev score | Mean ± std over restarts "
            "| Trials done / failed / planned |",
            "|---|---|---|---|---|---|"]
    for s in selections:
        chosen = f"{_point_text(s.point)}, restart {s.best.restart} (seed {s.best.seed})" if s.best else s.status
        score = fmt(_scale(s.task) * s.score) if s.score is not None else s.status
        planned = "?" if s.planned is None else str(s.planned)
        counts = f"{s.done} / {len(s.failed)} / {planned}"
        out.append(f"| {s.task} | {s.metric} | {chosen} | {score} | {_mean_std(s)} | {counts} |")
    failures = [(s.task, i, e) for s in selections for i, e in s.failed]
    if failures:
        out += ["", "## Failed trials", ""] + [f"- {i}: {e or 'no error recorded'}" for _, i, e in failures]
    return "\n".join(out) + "\n"


CSV_FIELDS = ("task", "status", "metric", "selected", "point", "score", "mean", "std", "restarts", "done", "failed",
              "planned", "reported")


def csv_text(selections: Sequence[Selection]) -> str:
    """One row per task: the selection, scores x100 (SQuAD as is) with one decimal, and "reported":
    the task's Table 1 column(s) (or other-task metrics) as column=value."""
    row = glue_row(selections)
    others = {r["task"]: r["values"] for r in other_rows(selections)}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for s in selections:
        k = _scale(s.task)
        if s.task in OTHER_TASKS:
            reported = others[OTHER_TASKS[s.task][0]]
        else:
            reported = {c: row[c] for c, t, _ in GLUE_COLUMNS if t == s.task}
        writer.writerow([s.task, s.status, s.metric, s.best.id if s.best else "",
                         _point_text(s.point) if s.best else "",
                         fmt(k * s.score) if s.score is not None else "", fmt(k * s.mean) if s.mean is not None else "",
                         fmt(k * s.std) if s.std is not None else "", len(s.restart_scores), s.done, len(s.failed),
                         "" if s.planned is None else s.planned,
                         "; ".join(f"{c}={_cell(v)}" for c, v in reported.items())])
    return buffer.getvalue()


def results_json(selections: Sequence[Selection]) -> dict[str, Any]:
    glue_tasks = {t for _, t, _ in GLUE_COLUMNS}
    return {"glue": glue_row(selections) if any(s.task in glue_tasks for s in selections) else None,
            "other": other_rows(selections), "tasks": [details(s) for s in selections]}


def write_results(selections: Sequence[Selection], out_dir: str) -> list[str]:
    """results.md, results.csv and results.json in out_dir (each atomically); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    texts = {"results.md": markdown(selections), "results.csv": csv_text(selections),
             "results.json": json.dumps(results_json(selections), indent=1) + "\n"}
    paths = [os.path.join(out_dir, name) for name in texts]
    with atomic_outputs(paths) as temps:
        for path, text in zip(paths, texts.values()):
            with open(temps[path], "w", encoding="utf-8") as f:
                f.write(text)
    return paths
