"""The GLUE leaderboard bundle and the other tasks' prediction files, from the selected trials.

GLUE: each selected GLUE trial's ``submission/`` folder holds ``<stem><suffix>.tsv`` per test file
it was given (finetune/tasks/glue.py: the task's `submission` stem, MNLI's "-m"/"-mm" suffixes, and
AX.tsv predicted by MNLI's model). Each file is checked (first line ``index<TAB>prediction``, at
least one row after it) and the good ones are zipped, at the top level, into
``glue_submission.zip`` (written atomically). Files the selected runs do not have (no test file was
given, or the task was not selected) are listed as missing, never faked; a bad file is left out and
named in the problems.

SQuAD / SWAG: the selected run's test predictions (submission/SQuAD.json, submission/SWAG.csv)
and dev predictions (predictions/<dev>/predictions.json and SQuAD 2.0's null_odds.json;
predictions/<dev>.tsv for SWAG) are copied to ``<out_dir>/<task>/`` under the same relative names.
"""
from __future__ import annotations

import glob
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from pretrain.common.atomic import atomic_outputs

from .selection import Selection

HEADER = "index\tprediction"
# GLUE submission file -> the task whose selected trial writes it (stems of finetune/tasks/glue.py)
GLUE_FILES: Mapping[str, str] = {
    "CoLA.tsv": "cola", "SST-2.tsv": "sst2", "MRPC.tsv": "mrpc", "STS-B.tsv": "stsb", "QQP.tsv": "qqp",
    "MNLI-m.tsv": "mnli", "MNLI-mm.tsv": "mnli", "QNLI.tsv": "qnli", "RTE.tsv": "rte", "WNLI.tsv": "wnli",
    "AX.tsv": "mnli",
}
ZIP_NAME = "glue_submission.zip"
# task -> glob patterns, relative to the trial directory, of the files copied
PREDICTION_FILES: Mapping[str, tuple[str, ...]] = {
    "squad": ("submission/*.json", "predictions/*/predictions.json"),
    "squad2": ("submission/*.json", "predictions/*/predictions.json", "predictions/*/null_odds.json"),
    "swag": ("submission/*.csv", "predictions/*.tsv"),
}


@dataclass
class Bundle:
    zip_path: str | None  # None: no good file to zip
    included: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # (file: why)
    problems: list[str] = field(default_factory=list)  # bad files left out, one line each
    copied: list[str] = field(default_factory=list)  # the SQuAD/SWAG files, under out_dir


def check_submission_file(path: str) -> str | None:
    """None when the file is a GLUE submission file (header, then >= 1 row); else one line why not."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        return f"{path}: cannot be read ({e})"
    if not lines or lines[0] != HEADER:
        first = lines[0] if lines else ""
        return f"{path}: first line must be the header {HEADER!r}, got {first!r}"
    rows = [line for line in lines[1:] if line.strip()]
    if not rows:
        return f"{path}: no prediction rows after the header"
    bad = next((n for n, line in enumerate(lines[1:], 2) if line.strip() and len(line.split("\t")) != 2), None)
    if bad is not None:
        return f"{path}: line {bad} is not index<TAB>prediction"
    return None


def glue_bundle(selections: Sequence[Selection], out_dir: str) -> Bundle:
    """glue_submission.zip in out_dir from the selected GLUE trials' submission/ files."""
    by_task = {s.task: s for s in selections}
    bundle = Bundle(zip_path=None)
    sources: dict[str, str] = {}
    for name, task in GLUE_FILES.items():
        s = by_task.get(task)
        if s is None or s.best is None or not s.best.directory:
            bundle.missing.append(f"{name}: no selected {task} trial ({'not in the sweep' if s is None else s.status})")
            continue
        path = os.path.join(s.best.directory, "submission", name)
        if not os.path.exists(path):
            bundle.missing.append(f"{name}: the selected {task} trial {s.best.id} has no submission/{name} "
                                  "(no test file given)")
            continue
        problem = check_submission_file(path)
        if problem:
            bundle.problems.append(problem)
        else:
            sources[name] = path
    if sources:
        os.makedirs(out_dir, exist_ok=True)
        zip_path = os.path.join(out_dir, ZIP_NAME)
        with atomic_outputs([zip_path]) as temps:
            with zipfile.ZipFile(temps[zip_path], "w", compression=zipfile.ZIP_DEFLATED) as z:
                for name, path in sources.items():
                    z.write(path, arcname=name)
        bundle.zip_path = zip_path
        bundle.included = list(sources)
    return bundle


def copy_predictions(selections: Sequence[Selection], out_dir: str) -> list[str]:
    """The selected SQuAD/SWAG runs' prediction files under out_dir/<task>/ (each atomically); their paths."""
    copied = []
    for s in selections:
        if s.task not in PREDICTION_FILES or s.best is None or not s.best.directory:
            continue
        for pattern in PREDICTION_FILES[s.task]:
            for source in sorted(glob.glob(os.path.join(s.best.directory, pattern))):
                relative = os.path.relpath(source, s.best.directory)
                target = os.path.join(out_dir, s.task, relative)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with atomic_outputs([target]) as temps:
                    shutil.copyfile(source, temps[target])
                copied.append(target)
    return copied


def write_bundle(selections: Sequence[Selection], out_dir: str) -> Bundle:
    """glue_bundle and copy_predictions together."""
    bundle = glue_bundle(selections, out_dir)
    bundle.copied = copy_predictions(selections, out_dir)
    return bundle
