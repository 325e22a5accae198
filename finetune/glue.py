"""GLUE tasks: the standard TSV layout of every task, CSV/JSON files with named columns, and
the GLUE submission format.

Standard layout (the files of the GLUE download): tab-separated, no quoting, per task
  CoLA   train/dev: no header; label column 1, sentence column 3; test: index, sentence
  SST-2  sentence, label;                                      test: index, sentence
  MRPC   Quality, #1 ID, #2 ID, #1 String, #2 String;          test: index, #1 ID, #2 ID, #1 String, #2 String
  STS-B  index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score
  QQP    id, qid1, qid2, question1, question2, is_duplicate;   test: id, question1, question2
         (rows with missing fields are skipped and counted, as every GLUE reader does)
  MNLI   sentence1 at column 8, sentence2 at 9, gold_label last; dev_matched/dev_mismatched;
         test_matched/test_mismatched
  QNLI   index, question, sentence, label;  RTE, WNLI  index, sentence1, sentence2, label
  AX     index, sentence1, sentence2 (diagnostic.tsv or AX.tsv), predicted by the MNLI model
Labels are the TSV's strings, in Hugging Face `datasets`' class order, so integer labels in
CSV/JSON files mean what they mean there (MNLI: 0 entailment, 1 neutral, 2 contradiction).
"""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass, field

csv.field_size_limit(sys.maxsize)  # some GLUE sentences are long; the default limit is 128 KiB


class GlueDataError(ValueError):
    """A GLUE file that cannot be used, with the file and row named."""


@dataclass(frozen=True)
class Columns:
    """Where the fields of a row are in a TSV file (None: absent)."""

    text_a: int
    text_b: int | None
    label: int | None = None
    index: int | None = None
    header: bool = True


@dataclass(frozen=True)
class GlueTask:
    name: str
    submission: str  # file name stem in a GLUE submission
    labels: tuple[str, ...] | None  # None: regression
    metric: str  # key of glue_metrics.METRICS
    train: Columns
    test: Columns
    train_file: str = "train.tsv"
    dev_files: tuple[str, ...] = ("dev.tsv",)
    test_files: tuple[tuple[str, str], ...] = (("test.tsv", ""),)  # (file, submission suffix)
    named: tuple[str, str | None] = ("sentence1", "sentence2")  # default CSV/JSON column names
    skip_malformed: bool = False
    label_last: bool = False  # MNLI: the label is the last column, whatever the number of columns

    @property
    def is_regression(self) -> bool:
        return self.labels is None


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", _BINARY, "matthews", Columns(3, None, 1, header=False), Columns(1, None, index=0),
             named=("sentence", None)),
    GlueTask("sst2", "SST-2", _BINARY, "accuracy", Columns(0, None, 1), Columns(1, None, index=0),
             named=("sentence", None)),
    GlueTask("mrpc", "MRPC", _BINARY, "accuracy_f1", Columns(3, 4, 0), Columns(3, 4, index=0)),
    GlueTask("stsb", "STS-B", None, "pearson_spearman", Columns(7, 8, 9), Columns(7, 8, index=0)),
    GlueTask("qqp", "QQP", _BINARY, "accuracy_f1", Columns(3, 4, 5), Columns(1, 2, index=0),
             named=("question1", "question2"), skip_malformed=True),
    GlueTask("mnli", "MNLI", ("entailment", "neutral", "contradiction"), "accuracy", Columns(8, 9, -1),
             Columns(8, 9, index=0), dev_files=("dev_matched.tsv", "dev_mismatched.tsv"),
             test_files=(("test_matched.tsv", "-m"), ("test_mismatched.tsv", "-mm")),
             named=("premise", "hypothesis"), label_last=True),
    GlueTask("qnli", "QNLI", _NLI2, "accuracy", Columns(1, 2, 3), Columns(1, 2, index=0),
             named=("question", "sentence")),
    GlueTask("rte", "RTE", _NLI2, "accuracy", Columns(1, 2, 3), Columns(1, 2, index=0)),
    GlueTask("wnli", "WNLI", _BINARY, "accuracy", Columns(1, 2, 3), Columns(1, 2, index=0)),
)}
AX_COLUMNS = Columns(1, 2, index=0)
AX_FILES = ("diagnostic.tsv", "AX.tsv")


@dataclass
class Example:
    guid: str  # the test index for test files, else file:line
    text_a: str
    text_b: str | None
    label: str | float | None  # a task label, a score (STS-B), None (test)


@dataclass
class ReadReport:
    path: str
    examples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skips: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_skips) < 3:
            self.first_skips.append(f"{where}: {reason}")

    def summary(self) -> str:
        text = f"{self.path}: {self.examples:,} examples"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n:,} ({reason})" for reason, n in self.skipped.items())
            text += " — e.g. " + "; ".join(self.first_skips)
        return text


def _label(task: GlueTask, raw, where: str):
    if task.is_regression:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise GlueDataError(f"{where}: score {raw!r} is not a number") from None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise GlueDataError(f"{where}: label {raw!r} is not one of {', '.join(task.labels)}")
    if isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit() and raw.strip() not in task.labels):
        index = int(raw)
        if not 0 <= index < len(task.labels):
            raise GlueDataError(f"{where}: label {raw!r} out of range for {task.name} "
                                f"(0..{len(task.labels) - 1}: {', '.join(task.labels)})")
        return task.labels[index]
    if raw.strip() not in task.labels:
        raise GlueDataError(f"{where}: unknown label {raw!r} for {task.name} (expected one of {', '.join(task.labels)})")
    return raw.strip()


def read_tsv(task: GlueTask, path: str, columns: Columns, with_labels: bool) -> tuple[list[Example], ReadReport]:
    """Examples of a GLUE TSV file in the task's standard layout."""
    report = ReadReport(path)
    examples: list[Example] = []
    try:
        f = open(path, encoding="utf-8", newline="")
    except OSError as e:
        raise GlueDataError(f"{path}: {e.strerror}") from None
    with f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        if columns.header:
            header = next(rows, None)
            if header is None:
                raise GlueDataError(f"{path}: empty file")
        wanted = [c for c in (columns.text_a, columns.text_b, columns.index) if c is not None]
        label_column = columns.label if with_labels else None
        for line, row in enumerate(rows, start=2 if columns.header else 1):
            where = f"{path}:{line}"
            if not row or row == [""]:
                continue
            needed = max(wanted + ([label_column] if label_column not in (None, -1) else []))
            if len(row) <= needed or (label_column == -1 and len(row) <= max(wanted) + 1):
                if task.skip_malformed:
                    report.skip("missing fields", where)
                    continue
                raise GlueDataError(f"{where}: {len(row)} column(s), the {task.name} layout needs at least "
                                    f"{needed + 1} (is this the task's standard TSV?)")
            label = _label(task, row[label_column], where) if label_column is not None else None
            guid = row[columns.index] if columns.index is not None else where
            examples.append(Example(guid, row[columns.text_a], row[columns.text_b] if columns.text_b is not None
                                    else None, label))
    if not examples:
        raise GlueDataError(f"{path}: no examples" + (f" ({report.summary()})" if report.skipped else ""))
    report.examples = len(examples)
    return examples, report


def read_named(task: GlueTask, path: str, text_a: str | None = None, text_b: str | None = None,
               label: str = "label", index: str = "idx", with_labels: bool = True) -> tuple[list[Example], ReadReport]:
    """Examples of a .csv, .json (a list of objects) or .jsonl file with named columns."""
    text_a = text_a or task.named[0]
    text_b = text_b if text_b is not None else task.named[1]
    report = ReadReport(path)
    try:
        if path.endswith(".csv"):
            with open(path, encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                rows = [(f"{path}:{n}", r) for n, r in enumerate(reader, start=2)]
                fields = reader.fieldnames or []
        elif path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                rows = [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(f, start=1) if line.strip()]
            fields = sorted({k for _, r in rows for k in r})
        elif path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                data = data["data"]
            if not isinstance(data, list):
                raise GlueDataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
            rows = [(f"{path}[{n}]", r) for n, r in enumerate(data)]
            fields = sorted({k for _, r in rows if isinstance(r, dict) for k in r})
        else:
            raise GlueDataError(f"{path}: unknown file type; use .tsv (standard GLUE layout), .csv, .json or .jsonl")
    except OSError as e:
        raise GlueDataError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise GlueDataError(f"{path}: not valid JSON ({e})") from None
    if not rows:
        raise GlueDataError(f"{path}: empty file")
    needed = [c for c in (text_a, text_b, label if with_labels else None) if c is not None]
    absent = [c for c in needed if c not in fields]
    if absent:
        raise GlueDataError(f"{path}: missing column(s) {', '.join(absent)} (has: {', '.join(map(str, fields))})")
    examples = []
    for where, row in rows:
        if not isinstance(row, dict) or any(row.get(c) is None for c in needed):
            if task.skip_malformed:
                report.skip("missing fields", where)
                continue
            raise GlueDataError(f"{where}: missing value for {', '.join(c for c in needed if not isinstance(row, dict) or row.get(c) is None)}")
        guid = str(row[index]) if index in row else where
        examples.append(Example(guid, str(row[text_a]), str(row[text_b]) if text_b else None,
                                _label(task, row[label], where) if with_labels else None))
    report.examples = len(examples)
    return examples, report


def read_examples(task: GlueTask, path: str, split: str, **named) -> tuple[list[Example], ReadReport]:
    """A split ("train", "dev", "test") from a standard TSV or a named-column file."""
    with_labels = split != "test"
    if path.endswith(".tsv"):
        columns = task.train if with_labels else task.test
        if os.path.basename(path) in AX_FILES:
            columns = AX_COLUMNS
        return read_tsv(task, path, columns, with_labels)
    return read_named(task, path, with_labels=with_labels, **named)


def write_submission(task: GlueTask, path: str, examples: list[Example], predictions) -> None:
    """GLUE submission file: a header `index<TAB>prediction`, then one row per test example."""
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for example, prediction in zip(examples, predictions):
            value = f"{float(prediction):.3f}" if task.is_regression else task.labels[int(prediction)]
            f.write(f"{example.guid}\t{value}\n")
    os.replace(tmp, path)
