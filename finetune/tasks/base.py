"""What the trainer needs from a fine-tuning task, and the pieces every task shares.

A task kind (GLUE classification/regression, SWAG multiple choice, SQuAD span extraction) is one
module with one `Task` subclass: it reads its data files, turns examples into model inputs, builds
the task model (the shared encoder plus its head), computes the loss, the metrics and the
prediction and submission files, and names the transformers architecture of the exported weights
(by encoder family: BertFor... or ModernBertFor...).
The trainer (finetune/finetuner.py) only calls these methods; it knows no task by name.
"""
from __future__ import annotations

import csv
import io
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import nn

from pretrain.common.errors import UserError

from ..config import ModelSection, TaskSection
from ..inputs import Batches
from ..official_metrics import official_score

if TYPE_CHECKING:  # annotations only
    from tokenizers import Tokenizer

    from pretrain.config import ModelConfig
    from pretrain.data.preprocess.special_tokens import SpecialTokens



class TaskDataError(UserError, ValueError):
    """A data file that cannot be used, with the file and row named."""


@dataclass
class ReadReport:
    """What reading a file found: every record read (`rows`, a header line not counted), each an
    example or skipped for a reason (counted, never silent)."""

    path: str
    unit: str = "rows"  # what the file's records are: rows, lines, entries, questions, sentences
    header: bool | None = None  # whether a header line came before the rows (None: a file without lines of data)
    rows: int = 0
    examples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skips: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.first_skips) < 3:
            self.first_skips.append(f"{where}: {reason}")

    def summary(self) -> str:
        header = {True: " after the header line", False: " (no header line)", None: ""}[self.header]
        text = f"{self.path}: {self.rows:,} {self.unit}{header}, {self.examples:,} examples"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n:,} ({reason})" for reason, n in self.skipped.items())
            text += " — e.g. " + "; ".join(self.first_skips)
        return text


def delimited_rows(path: str, text: str, delimiter: str,
                    report: ReadReport) -> tuple[list[tuple[str, dict]], list[str]]:
    """The rows of a CSV (or tab-separated) file with a header line, as dicts (blank lines counted
    in `report`); a row wider than the header is refused naming its line, and in a .tsv so is a
    quoted field that runs over several lines (a stray quote would swallow the rows after it)."""
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""), delimiter=delimiter)
    fields = next(reader, None)
    if fields is None:
        raise TaskDataError(f"{path}: empty file")
    rows, end = [], reader.line_num
    for row in reader:
        start, end = end + 1, reader.line_num
        where = f"{path}:{start}"
        if delimiter == "\t" and end > start:
            raise TaskDataError(f"{where}: a quoted field runs over {end - start + 1} lines (a named-column .tsv is "
                                'read with CSV quoting: a field that starts with " must end with ")')
        if not row:
            report.rows += 1
            report.skip("blank line", where)
        elif len(row) > len(fields):
            raise TaskDataError(f"{where}: {len(row)} column(s), the header line has {len(fields)}")
        else:
            rows.append((where, dict(zip(fields, row))))  # a shorter row lacks the last columns' values
    return rows, fields


class Read(NamedTuple):
    """One data file as a task read it."""

    examples: list
    report: ReadReport
    reference: Any = None  # what the official evaluation reads besides the examples (SQuAD: the articles)


@dataclass
class Dataset:
    """A dev or test file, read and encoded."""

    name: str  # dev: the metrics' prefix and the prediction files' name; test: the submission file's stem
    examples: list
    features: Batches
    reference: Any = None


@dataclass(frozen=True)
class TestFile:
    path: str
    submission: str  # file stem in <output_dir>/submission
    optional: bool = False  # absent without a log line (MNLI's diagnostic set goes by two names)


@dataclass
class Evaluation:
    metrics: dict[str, float]
    files: dict[str, str]  # path under <output_dir>/predictions -> content, written for the best epoch only


class Task(ABC):
    """One fine-tuning task. Subclasses are frozen dataclasses holding the task's constants."""

    architecture: ClassVar[str]  # transformers class of the exported best weights (a BERT encoder)
    modern_architecture: ClassVar[str]  # the same for a ModernBERT encoder
    feature_based: ClassVar[bool] = False  # a BiLSTM tagger over frozen features can learn it (finetune/feature_tagger.py)
    name: str
    submission: str  # stem of the submission file (GLUE's official names: CoLA, MNLI, ...)
    train_file: str  # default file names inside task.data_dir
    dev_files: tuple[str, ...]
    test_files: tuple[tuple[str, str], ...]  # (file, submission suffix)

    def score(self, metrics: dict[str, float]) -> float:
        """The dev score that picks the best epoch: the task's official one (finetune/official_metrics.py),
        the same a sweep selects trials by."""
        return official_score(self.name, metrics)

    def configured(self, section: TaskSection) -> Task:
        """This task with what the config decides about it (token classification: its label set);
        called once with the validated config, before any data is read."""
        return self

    def config_problems(self, section: TaskSection) -> list[str]:
        """Problems with the task section that only this task has (checked with the config)."""
        return []

    def test_inputs(self, section: TaskSection) -> list[TestFile]:
        """The files to predict: the user's task.test_files, else the task's own in data_dir."""
        if section.test_files:
            return [TestFile(path, self.submission) for path in section.test_files]
        if not section.data_dir:
            return []
        return [TestFile(os.path.join(section.data_dir, file), self.submission + suffix)
                for file, suffix in self.test_files]

    @abstractmethod
    def read(self, path: str, split: str, section: TaskSection) -> Read:
        """The examples of a "train", "dev" or "test" file; raises TaskDataError."""

    def exported_architecture(self, model_cfg: ModelConfig) -> str:
        """The transformers class the best weights are written as, by the encoder's family."""
        return self.modern_architecture if model_cfg.modern else self.architecture

    @abstractmethod
    def encode(self, tokenizer: Tokenizer, examples: list, section: TaskSection,
               training: bool, specials: SpecialTokens | None = None) -> Batches:
        """Model inputs (and labels, where the examples have them) padded to task.max_seq_length.
        `specials`: the tokenizer's special tokens by role (pad, cls, sep, unk), as the checkpoint's
        tokenizer files name them; None: read from `tokenizer` itself (finetune.inputs.special_tokens)."""

    @abstractmethod
    def build_model(self, encoder: nn.Module, model_cfg: ModelConfig, section: ModelSection, seed: int) -> nn.Module:
        """The encoder with this task's head; the result has `.bert` and `.head` and maps
        (input_ids, token_type_ids, attention_mask) to logits."""

    @abstractmethod
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of a micro-batch, in fp32."""

    @abstractmethod
    def evaluate(self, dev: Dataset, logits: np.ndarray, section: TaskSection) -> Evaluation:
        """Metrics of one dev set (keys without a prefix) and its prediction files."""

    @abstractmethod
    def submission_files(self, test: Dataset, logits: np.ndarray, section: TaskSection) -> dict[str, str]:
        """Path under <output_dir>/submission -> content."""

    def export_config(self) -> dict:
        """Entries of the exported config.json beyond the encoder's."""
        return {"finetuning_task": self.name}
