"""SWAG (Zellers et al. 2018) multiple choice: CSV files with sent1, sent2, ending0..ending3 and
label (train.csv, val.csv; test.csv without labels). Each choice is scored as the sequence
[CLS] sent1 [SEP] sent2 ending_i [SEP]; the model picks the ending with the largest logit.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.common.textfile import read_text

from ..config import ModelSection, TaskSection
from ..inputs import TextFeatures
from .base import Dataset, Evaluation, Read, ReadReport, Task, TaskDataError, delimited_rows
from .glue import Example, prediction_table

if TYPE_CHECKING:  # annotations only
    from tokenizers import Tokenizer
    from torch import nn

    from pretrain.config import ModelConfig
    from pretrain.data.preprocess.special_tokens import SpecialTokens

CHOICES = 4
ENDINGS = tuple(f"ending{i}" for i in range(CHOICES))
LABELS = tuple(str(i) for i in range(CHOICES))


@dataclass(frozen=True)
class SwagTask(Task):
    """One logit per choice from a head on each choice's pooled [CLS] (ModernBERT: per
    model.classifier_pooling); softmax over choices."""

    architecture: ClassVar[str] = "BertForMultipleChoice"
    modern_architecture: ClassVar[str] = "ModernBertForMultipleChoice"
    name: str = "swag"
    submission: str = "SWAG"
    train_file: str = "train.csv"
    dev_files: tuple[str, ...] = ("val.csv",)
    test_files: tuple[tuple[str, str], ...] = (("test.csv", ""),)

    def read(self, path: str, split: str, section: TaskSection) -> Read:
        examples, report = read_swag(path, split)
        return Read(examples, report)

    def encode(self, tokenizer: Tokenizer, examples: list[ChoiceExample], section: TaskSection,
               training: bool, specials: SpecialTokens | None = None) -> TextFeatures:
        labels = None if examples[0].label is None else \
            torch.tensor([LABELS.index(e.label) for e in examples], dtype=torch.long)
        pairs = [pair for e in examples for pair in choice_pairs(e)]
        return TextFeatures(tokenizer, pairs, labels, section.max_seq_length, CHOICES, specials)

    def build_model(self, encoder: nn.Module, model_cfg: ModelConfig, section: ModelSection, seed: int) -> nn.Module:
        from ..model import MultipleChoiceClassifier, task_head  # megatron-core: imported once a model is built

        return MultipleChoiceClassifier(encoder, task_head(model_cfg, 1, section.classifier_dropout, seed))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels)

    def evaluate(self, dev: Dataset, logits: np.ndarray, section: TaskSection) -> Evaluation:
        from ..glue_metrics import accuracy  # scikit-learn: imported at the first evaluation

        predicted = logits.argmax(-1)
        return Evaluation(accuracy(dev.features.labels.numpy(), predicted),
                          {f"{dev.name}.tsv": prediction_table(predicted, LABELS)})

    def submission_files(self, test: Dataset, logits: np.ndarray, section: TaskSection) -> dict[str, str]:
        return {f"{test.name}.csv": submission_text(test.examples, logits.argmax(-1))}


SWAG = SwagTask()
SWAG_TASKS = {SWAG.name: SWAG}


@dataclass
class ChoiceExample(Example):
    endings: tuple[str, ...] = ()


def read_swag(path: str, split: str) -> tuple[list[ChoiceExample], ReadReport]:
    """Examples of a SWAG CSV (a header line naming the columns): every row an example, a blank
    line counted as skipped, a row wider than the header or short of a needed value refused."""
    with_labels = split != "test"
    report = ReadReport(path, header=True)
    rows, fields = delimited_rows(path, read_text(path, TaskDataError), ",", report)
    needed = ["sent1", "sent2", *ENDINGS] + (["label"] if with_labels else [])
    absent = [c for c in needed if c not in fields]
    if absent:
        raise TaskDataError(f"{path}: missing column(s) {', '.join(absent)} (has: {', '.join(fields)})")
    examples = []
    for n, (where, row) in enumerate(rows):
        report.rows += 1
        if any(row.get(c) is None for c in needed):
            raise TaskDataError(f"{where}: missing value for {', '.join(c for c in needed if row.get(c) is None)}")
        label = None
        if with_labels:
            label = row["label"].strip()
            if label not in LABELS:
                raise TaskDataError(f"{where}: label {row['label']!r} is not one of 0, 1, 2, 3")
        guid = row.get("fold-ind") or row.get("video-id") or str(n)
        examples.append(ChoiceExample(guid, row["sent1"], row["sent2"], label, tuple(row[e] for e in ENDINGS)))
    if not examples:
        raise TaskDataError(f"{path}: no examples")
    report.examples = len(examples)
    return examples, report


def choice_pairs(example: ChoiceExample) -> list[tuple[str, str]]:
    """The (segment A, segment B) of each choice: the context, and the start of the second
    sentence followed by the ending (as the SWAG baselines and Hugging Face's run_swag build them)."""
    return [(example.text_a, f"{example.text_b} {ending}".strip()) for ending in example.endings]


def submission_text(examples: list[ChoiceExample], predictions) -> str:
    """CSV: the example's index (fold-ind when the file has it) and the predicted ending."""
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(["index", "pred"])
    for example, prediction in zip(examples, predictions):
        writer.writerow([example.guid, int(prediction)])
    return out.getvalue()
