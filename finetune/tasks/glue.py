"""GLUE tasks (sentence and sentence-pair classification; STS-B regression): the standard TSV
layout of every task, CSV/JSON files with named columns, the head, metrics and GLUE submission
format.

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
A first line that reads as data where a header belongs (a valid label in the label column, a
number in a test file's index column) is refused naming it: read as the header, it would be an
example lost without a word. CoLA's train/dev files have no header line; a first line naming
their columns is taken as one.
Named columns: a .tsv whose header names the task's columns (sentence1, sentence2, label by
default; task.text_a_column, text_b_column, label_column) where the standard layout has others,
as Hugging Face `datasets` exports write it (CSV quoting), is read by those names, as .csv, .json
and .jsonl files are. Every row read is an example or a counted skip (ReadReport).
Labels are the TSV's strings, in Hugging Face `datasets`' class order, so integer labels in
CSV/JSON files mean what they mean there (MNLI: 0 entailment, 1 neutral, 2 contradiction).
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.common.textfile import read_lines, read_text

from ..config import ModelSection, TaskSection
from ..inputs import TextFeatures
from .base import Dataset, Evaluation, Read, ReadReport, Task, TaskDataError, TestFile, delimited_rows

if TYPE_CHECKING:  # annotations only
    from tokenizers import Tokenizer
    from torch import nn

    from pretrain.config import ModelConfig
    from pretrain.data.preprocess.special_tokens import SpecialTokens

csv.field_size_limit(sys.maxsize)  # some GLUE sentences are long; the default limit is 128 KiB


@dataclass(frozen=True)
class Columns:
    """Where the fields of a row are in a TSV file (None: absent)."""

    text_a: int
    text_b: int | None
    label: int | None = None
    index: int | None = None
    header: bool = True
    count: int | None = None  # columns of every row (None: it varies, MNLI; the needed ones must be there)
    names: str = ""  # the GLUE download's header line, for messages ("": none, or it varies)


@dataclass(frozen=True)
class GlueTask(Task):
    """Sentence(-pair) classification, or regression (STS-B): a head on the pooled [CLS] (ModernBERT:
    the pooled vector per model.classifier_pooling)."""

    architecture: ClassVar[str] = "BertForSequenceClassification"
    modern_architecture: ClassVar[str] = "ModernBertForSequenceClassification"
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
    predicts_diagnostic: bool = False  # MNLI: its model also predicts the diagnostic set AX

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    def test_inputs(self, section: TaskSection) -> list[TestFile]:
        inputs = super().test_inputs(section)
        if self.predicts_diagnostic and section.data_dir:
            inputs += [TestFile(os.path.join(section.data_dir, file), "AX", optional=True) for file in AX_FILES]
        return inputs

    def read(self, path: str, split: str, section: TaskSection) -> Read:
        named = {k: v for k, v in (("text_a", section.text_a_column), ("text_b", section.text_b_column),
                                   ("label", section.label_column)) if v}
        examples, report = read_examples(self, path, split, **named)
        return Read(examples, report)

    def encode(self, tokenizer: Tokenizer, examples: list[Example], section: TaskSection,
               training: bool, specials: SpecialTokens | None = None) -> TextFeatures:
        texts = [(e.text_a, e.text_b) if e.text_b is not None else e.text_a for e in examples]
        return TextFeatures(tokenizer, texts, self.label_tensor(examples), section.max_seq_length, specials=specials)

    def label_tensor(self, examples: list[Example]) -> torch.Tensor | None:
        if examples[0].label is None:
            return None
        if self.is_regression:
            return torch.tensor([float(e.label) for e in examples], dtype=torch.float32)
        return torch.tensor([self.labels.index(e.label) for e in examples], dtype=torch.long)

    def build_model(self, encoder: nn.Module, model_cfg: ModelConfig, section: ModelSection, seed: int) -> nn.Module:
        from ..model import SequenceClassifier, task_head  # megatron-core: imported once a model is built

        head = task_head(model_cfg, 1 if self.is_regression else len(self.labels), section.classifier_dropout, seed)
        return SequenceClassifier(encoder, head)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.is_regression:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        return F.cross_entropy(logits.float(), labels)

    def predictions(self, logits: np.ndarray) -> np.ndarray:
        return logits[:, 0] if self.is_regression else logits.argmax(-1)

    def evaluate(self, dev: Dataset, logits: np.ndarray, section: TaskSection) -> Evaluation:
        from ..glue_metrics import METRICS  # scikit-learn and scipy: imported at the first evaluation

        predicted = self.predictions(logits)
        return Evaluation(METRICS[self.metric](dev.features.labels.numpy(), predicted),
                          {f"{dev.name}.tsv": prediction_table(predicted, self.labels)})

    def submission_files(self, test: Dataset, logits: np.ndarray, section: TaskSection) -> dict[str, str]:
        return {f"{test.name}.tsv": submission_text(self, test.examples, self.predictions(logits))}

    def export_config(self) -> dict:
        labels = self.labels or ("score",)
        return {"num_labels": len(labels), "finetuning_task": self.name, "id2label": dict(enumerate(labels)),
                "label2id": {label: i for i, label in enumerate(labels)},
                "problem_type": "regression" if self.is_regression else "single_label_classification"}


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_PAIR_TRAIN, _PAIR_TEST = "index, sentence1, sentence2, label", "index, sentence1, sentence2"
_STSB = "index, genre, filename, year, old_index, source1, source2, sentence1, sentence2"
GLUE_TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", _BINARY, "matthews", Columns(3, None, 1, header=False, count=4),
             Columns(1, None, index=0, count=2, names="index, sentence"), named=("sentence", None)),
    GlueTask("sst2", "SST-2", _BINARY, "accuracy", Columns(0, None, 1, count=2, names="sentence, label"),
             Columns(1, None, index=0, count=2, names="index, sentence"), named=("sentence", None)),
    GlueTask("mrpc", "MRPC", _BINARY, "accuracy_f1",
             Columns(3, 4, 0, count=5, names="Quality, #1 ID, #2 ID, #1 String, #2 String"),
             Columns(3, 4, index=0, count=5, names="index, #1 ID, #2 ID, #1 String, #2 String")),
    GlueTask("stsb", "STS-B", None, "pearson_spearman", Columns(7, 8, 9, count=10, names=f"{_STSB}, score"),
             Columns(7, 8, index=0, count=9, names=_STSB)),
    GlueTask("qqp", "QQP", _BINARY, "accuracy_f1",
             Columns(3, 4, 5, count=6, names="id, qid1, qid2, question1, question2, is_duplicate"),
             Columns(1, 2, index=0, count=3, names="id, question1, question2"),
             named=("question1", "question2"), skip_malformed=True),
    GlueTask("mnli", "MNLI", ("entailment", "neutral", "contradiction"), "accuracy", Columns(8, 9, -1),
             Columns(8, 9, index=0, count=10), dev_files=("dev_matched.tsv", "dev_mismatched.tsv"),
             test_files=(("test_matched.tsv", "-m"), ("test_mismatched.tsv", "-mm")),
             named=("premise", "hypothesis"), label_last=True, predicts_diagnostic=True),
    GlueTask("qnli", "QNLI", _NLI2, "accuracy", Columns(1, 2, 3, count=4, names="index, question, sentence, label"),
             Columns(1, 2, index=0, count=3, names="index, question, sentence"), named=("question", "sentence")),
    GlueTask("rte", "RTE", _NLI2, "accuracy", Columns(1, 2, 3, count=4, names=_PAIR_TRAIN),
             Columns(1, 2, index=0, count=3, names=_PAIR_TEST)),
    GlueTask("wnli", "WNLI", _BINARY, "accuracy", Columns(1, 2, 3, count=4, names=_PAIR_TRAIN),
             Columns(1, 2, index=0, count=3, names=_PAIR_TEST)),
)}
AX_COLUMNS = Columns(1, 2, index=0, count=3, names=_PAIR_TEST)
AX_FILES = ("diagnostic.tsv", "AX.tsv")


@dataclass
class Example:
    guid: str  # the test index for test files, else file:line
    text_a: str
    text_b: str | None
    label: str | float | None  # a task label, a score (STS-B), None (test)


def _label(task: GlueTask, raw, where: str):
    if task.is_regression:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise TaskDataError(f"{where}: score {raw!r} is not a number") from None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise TaskDataError(f"{where}: label {raw!r} is not one of {', '.join(task.labels)}")
    if isinstance(raw, int) or (isinstance(raw, str) and raw.strip().isdigit() and raw.strip() not in task.labels):
        index = int(raw)
        if not 0 <= index < len(task.labels):
            raise TaskDataError(f"{where}: label {raw!r} out of range for {task.name} "
                                f"(0..{len(task.labels) - 1}: {', '.join(task.labels)})")
        return task.labels[index]
    if raw.strip() not in task.labels:
        raise TaskDataError(f"{where}: unknown label {raw!r} for {task.name} (expected one of {', '.join(task.labels)})")
    return raw.strip()


def _named_columns(task: GlueTask, with_labels: bool, text_a: str | None = None, text_b: str | None = None,
                   label: str | None = None) -> dict[str, str]:
    """The column names a named-column file is read by: field -> name (the task's usual names
    unless the config names them; no label in a test file)."""
    names = {"text_a": text_a or task.named[0], "text_b": text_b if text_b is not None else task.named[1],
             "label": (label or "label") if with_labels else None}
    return {field: name for field, name in names.items() if name}


def _positions(columns: Columns, named: dict[str, str], width: int) -> dict[str, int]:
    """Where the standard layout reads each named field (the label -1: the last column)."""
    at = {"text_a": columns.text_a, "text_b": columns.text_b, "label": columns.label}
    return {field: at[field] % width for field in named if at[field] is not None}


def _data_in_header(task: GlueTask, columns: Columns, row: list[str], with_labels: bool) -> str | None:
    """What in a first row reads as data where the header belongs: a valid label in the label
    column, or a number in a test file's index column (a header has names there)."""
    if with_labels and columns.label is not None and -len(row) <= columns.label < len(row):
        raw = row[columns.label]
        try:
            _label(task, raw, "")
            return f"label {raw.strip()!r}"
        except TaskDataError:
            pass
    if columns.index is not None and columns.index < len(row) and row[columns.index].strip().isdigit():
        return f"index {row[columns.index].strip()!r}"
    return None


_NAMED_HINT = ".csv/.jsonl or a .tsv whose header names its columns (docs/finetuning.md)"


def read_tsv(task: GlueTask, path: str, columns: Columns, with_labels: bool,
             **named: str | None) -> tuple[list[Example], ReadReport]:
    """Examples of a GLUE TSV file in the task's standard layout, or (its header naming the
    task's columns where the standard layout has others) read by those names."""
    text = read_text(path, TaskDataError).removeprefix("\ufeff")
    rows = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    first = next(rows, None)
    if first is None:
        raise TaskDataError(f"{path}: empty file")
    names = _named_columns(task, with_labels, **named)
    if all(name in first for name in names.values()):  # a header naming the columns
        if any(first.index(names[f]) != at for f, at in _positions(columns, names, len(first)).items()):
            return read_named(task, path, with_labels=with_labels, text=text, **named)
        header = True
    elif columns.header:
        if columns.count is not None and len(first) != columns.count:
            raise TaskDataError(_layout_mismatch(task, columns, first, f"{path}:1 (header)", names))
        data = _data_in_header(task, columns, first, with_labels)
        if data:
            split = "test" if columns in (task.test, AX_COLUMNS) else "train/dev"
            glue = f" (GLUE's: {columns.names})" if columns.names else ""
            raise TaskDataError(f"{path}:1: this row is data ({data}) where the {task.name} {split} layout has its "
                                f"header line{glue}; add a header line, or give the rows as {_NAMED_HINT}")
        header = True
    else:
        header = False
        rows = itertools.chain([first], rows)
    report = ReadReport(path, header=header)
    examples: list[Example] = []
    for line, row in enumerate(rows, start=2 if header else 1):
        report.rows += 1
        try:
            example = _tsv_example(task, columns, row, f"{path}:{line}", with_labels, report, names)
        except TaskDataError as error:
            if line == 1:  # a layout without a header line (CoLA's train/dev): was this a header?
                raise TaskDataError(f"{error}; the {task.name} train/dev layout has no header line: is this one?") from None
            raise
        if example is not None:
            examples.append(example)
    return _checked(examples, report)


def _tsv_example(task: GlueTask, columns: Columns, row: list[str], where: str, with_labels: bool,
                 report: ReadReport, names: dict[str, str]) -> Example | None:
    """One row of the standard layout as an example; None when it is skipped (and counted)."""
    if not row or row == [""]:
        report.skip("blank line", where)
        return None
    if columns.count is not None and len(row) != columns.count:
        if task.skip_malformed:
            report.skip("missing fields" if len(row) < columns.count else "extra fields", where)
            return None
        raise TaskDataError(_layout_mismatch(task, columns, row, where, names))
    wanted = [c for c in (columns.text_a, columns.text_b, columns.index) if c is not None]
    label_column = columns.label if with_labels else None
    needed = max(wanted + ([label_column] if label_column not in (None, -1) else []))
    if len(row) <= needed or (label_column == -1 and len(row) <= max(wanted) + 1):
        if task.skip_malformed:
            report.skip("missing fields", where)
            return None
        raise TaskDataError(f"{where}: {len(row)} column(s), the {task.name} layout needs at least "
                            f"{needed + 1} (is this the task's standard TSV?)")
    label = _label(task, row[label_column], where) if label_column is not None else None
    guid = row[columns.index] if columns.index is not None else where
    return Example(guid, row[columns.text_a], row[columns.text_b] if columns.text_b is not None else None, label)


def _checked(examples: list[Example], report: ReadReport) -> tuple[list[Example], ReadReport]:
    if not examples:
        raise TaskDataError(f"{report.path}: no examples" + (f" ({report.summary()})" if report.skipped else ""))
    report.examples = len(examples)
    return examples, report


def _layout_mismatch(task: GlueTask, columns: Columns, row: list[str], where: str, names: dict[str, str]) -> str:
    """A row (or header) of the wrong width: name the layout mismatch, and the tasks whose layout
    has that width, before any symptom of it (a label out of range) could be reported; and how a
    file of other columns is given."""
    split = "test" if columns in (task.test, AX_COLUMNS) else "train/dev"
    alike = sorted({t.name for t in GLUE_TASKS.values() for c in (t.train, t.test) if c.count == len(row)} - {task.name})
    guess = f"; {len(row)} is the layout of {', '.join(alike)}: is this another task's file?" if alike else "."
    keys = ", ".join(f"task.{field}_column" for field in ("text_a", "text_b", "label") if field in names)
    return (f"{where}: {len(row)} column(s), the {task.name} {split} layout has {columns.count} "
            f"(tab-separated, no quoting){guess} Other columns: a header line naming them "
            f"({', '.join(names.values())}; or set {keys}) in a .tsv, .csv or .jsonl file")


def read_named(task: GlueTask, path: str, text_a: str | None = None, text_b: str | None = None,
               label: str | None = None, index: str = "idx", with_labels: bool = True,
               text: str | None = None) -> tuple[list[Example], ReadReport]:
    """Examples of a file with named columns: .csv, .tsv (a header line naming the columns; CSV
    quoting, as pandas and `datasets` write them), .json (a list of objects) or .jsonl.
    `text`: the file's text when the caller has read it already."""
    names = _named_columns(task, with_labels, text_a, text_b, label)
    rows, fields, report = _named_rows(path, text)
    absent = [c for c in names.values() if c not in fields]
    if absent:
        raise TaskDataError(f"{path}: missing column(s) {', '.join(absent)} (has: {', '.join(map(str, fields))})")
    examples = []
    for where, row in rows:
        report.rows += 1
        missing = [c for c in names.values() if not isinstance(row, dict) or row.get(c) is None]
        if missing:
            if task.skip_malformed:
                report.skip("missing fields", where)
                continue
            raise TaskDataError(f"{where}: missing value for {', '.join(missing)}")
        examples.append(Example(str(row[index]) if index in row else where, str(row[names["text_a"]]),
                                str(row[names["text_b"]]) if "text_b" in names else None,
                                _label(task, row[names["label"]], where) if with_labels else None))
    return _checked(examples, report)


def _named_rows(path: str, text: str | None) -> tuple[list[tuple[str, dict]], list[str], ReadReport]:
    """(where, row as a dict) of a named-column file, its column names, and its report (the
    rows given back are counted by the caller; blank lines of a .csv/.tsv are counted here)."""
    try:
        if path.endswith((".csv", ".tsv")):
            text = read_text(path, TaskDataError) if text is None else text
            report = ReadReport(path, header=True)
            rows, fields = delimited_rows(path, text, "\t" if path.endswith(".tsv") else ",", report)
            return rows, fields, report
        if path.endswith(".jsonl"):
            lines = read_lines(path, TaskDataError)
            rows = [(f"{path}:{n}", json.loads(line)) for n, line in enumerate(lines, start=1) if line.strip()]
            unit = "lines"
        elif path.endswith(".json"):
            data = json.loads(read_text(path, TaskDataError))
            if isinstance(data, dict) and isinstance(data.get("data"), list):
                data = data["data"]
            if not isinstance(data, list):
                raise TaskDataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
            rows = [(f"{path}[{n}]", r) for n, r in enumerate(data)]
            unit = "entries"
        else:
            raise TaskDataError(f"{path}: unknown file type; use .tsv (standard GLUE layout), .csv, .json or .jsonl")
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{path}: not valid JSON ({e})") from None
    if not rows:
        raise TaskDataError(f"{path}: empty file")
    return rows, sorted({k for _, r in rows if isinstance(r, dict) for k in r}), ReadReport(path, unit=unit)


def read_examples(task: GlueTask, path: str, split: str, **named) -> tuple[list[Example], ReadReport]:
    """A split ("train", "dev", "test") from a standard TSV or a named-column file."""
    with_labels = split != "test"
    if path.endswith(".tsv"):
        columns = task.train if with_labels else task.test
        if os.path.basename(path) in AX_FILES:
            columns = AX_COLUMNS
        return read_tsv(task, path, columns, with_labels, **named)
    return read_named(task, path, with_labels=with_labels, **named)


def prediction_table(predicted, labels: tuple[str, ...] | None) -> str:
    """The dev predictions file: `index<TAB>prediction`, a label, or (labels None) a score to 4 decimals."""
    lines = ["index\tprediction\n"]
    for i, value in enumerate(predicted):
        lines.append(f"{i}\t{value:.4f}\n" if labels is None else f"{i}\t{labels[int(value)]}\n")
    return "".join(lines)


def submission_text(task: GlueTask, examples: list[Example], predictions) -> str:
    """GLUE submission file: a header `index<TAB>prediction`, then one row per test example."""
    if len(examples) != len(predictions):
        raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    lines = ["index\tprediction\n"]
    for example, prediction in zip(examples, predictions):
        value = f"{float(prediction):.3f}" if task.is_regression else task.labels[int(prediction)]
        lines.append(f"{example.guid}\t{value}\n")
    return "".join(lines)
