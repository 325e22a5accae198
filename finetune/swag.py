"""SWAG (Zellers et al. 2018) multiple choice: CSV files with sent1, sent2, ending0..ending3 and
label (train.csv, val.csv; test.csv without labels). Each choice is scored as the sequence
[CLS] sent1 [SEP] sent2 ending_i [SEP]; the model picks the ending with the largest logit.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass

from .glue import Example, GlueDataError, ReadReport

CHOICES = 4
ENDINGS = tuple(f"ending{i}" for i in range(CHOICES))


@dataclass(frozen=True)
class SwagTask:
    """Quacks like glue.GlueTask where the runner needs it."""

    name: str = "swag"
    submission: str = "SWAG"
    labels: tuple[str, ...] = tuple(str(i) for i in range(CHOICES))
    metric: str = "accuracy"
    train_file: str = "train.csv"
    dev_files: tuple[str, ...] = ("val.csv",)
    test_files: tuple[tuple[str, str], ...] = (("test.csv", ""),)
    choices: int = CHOICES
    is_regression: bool = False


SWAG = SwagTask()


@dataclass
class ChoiceExample(Example):
    endings: tuple[str, ...] = ()


def read_swag(path: str, split: str) -> tuple[list[ChoiceExample], ReadReport]:
    with_labels = split != "test"
    report = ReadReport(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            fields = reader.fieldnames
            if not fields:
                raise GlueDataError(f"{path}: empty file")
            needed = ["sent1", "sent2", *ENDINGS] + (["label"] if with_labels else [])
            absent = [c for c in needed if c not in fields]
            if absent:
                raise GlueDataError(f"{path}: missing column(s) {', '.join(absent)} (has: {', '.join(fields)})")
            examples = []
            for line, row in enumerate(reader, start=2):
                where = f"{path}:{line}"
                if any(row.get(c) is None for c in needed):
                    raise GlueDataError(f"{where}: missing value for {', '.join(c for c in needed if row.get(c) is None)}")
                label = None
                if with_labels:
                    label = row["label"].strip()
                    if label not in SWAG.labels:
                        raise GlueDataError(f"{where}: label {row['label']!r} is not one of 0, 1, 2, 3")
                guid = row.get("fold-ind") or row.get("video-id") or str(line - 2)
                examples.append(ChoiceExample(guid, row["sent1"], row["sent2"], label,
                                              tuple(row[e] for e in ENDINGS)))
    except OSError as e:
        raise GlueDataError(f"{path}: {e.strerror}") from None
    if not examples:
        raise GlueDataError(f"{path}: no examples")
    report.examples = len(examples)
    return examples, report


def choice_pairs(example: ChoiceExample) -> list[tuple[str, str]]:
    """The (segment A, segment B) of each choice: the context, and the start of the second
    sentence followed by the ending (as the SWAG baselines and Hugging Face's run_swag build them)."""
    return [(example.text_a, f"{example.text_b} {ending}".strip()) for ending in example.endings]


def write_swag_submission(path: str, examples: list[ChoiceExample], predictions) -> None:
    """CSV: the example's index (fold-ind when the file has it) and the predicted ending."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", "pred"])
        for example, prediction in zip(examples, predictions):
            writer.writerow([example.guid, int(prediction)])
    os.replace(tmp, path)
