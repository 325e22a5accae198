"""Contrastive training data: (anchor, positive) pairs and (anchor, positive, negative, ...) tuples
read from JSON lines, TSV or Parquet files with a column mapping, and the batches they are trained in.

Reading (`read_examples`): every row is kept or counted under the reason it was skipped (invalid
JSON, a missing or non-text column, an empty text, a TSV row with too few fields), with the first
few skipped rows named by file and line (a Parquet file: row number, read in record batches with
flat memory); a file that yields no example at all is an error naming it.
Negatives come from several columns (`negatives: [neg1, neg2]`) or from one column holding a list.
A `source` column names the dataset a row comes from (mixtures of sources).

Batching (`contrastive_batches`), as sentence-transformers' NoDuplicatesBatchSampler and its
round-robin-free "one source per batch" practice: in-batch negatives are only useful when they
are true negatives, so
- no text appears twice in a batch (a row whose anchor, positive or negative is already in the
  batch waits for a later one), and
- with sources named, every batch comes from one source (a query is never scored against another
  dataset's easy negatives);
- a batch is always full (the gradient of the global batch needs every rank's share): the rows
  left over at the end of an epoch (per source) are carried into the next epoch's shuffle, and the
  count is reported.
"""
from __future__ import annotations

import csv
import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field

from pretrain.common.errors import UserError

FORMATS = ("jsonl", "tsv", "parquet")
PARQUET_BATCH_ROWS = 8192  # rows read at a time: memory stays flat on a large file


class ContrastiveDataError(UserError, ValueError):
    """A training or evaluation file that cannot be used, named with its problem."""


@dataclass(frozen=True)
class Columns:
    """Which column holds what (JSON keys, or TSV header names)."""
    anchor: str = "anchor"
    positive: str = "positive"
    negatives: tuple[str, ...] = ()  # columns of one negative each, or one column holding a list
    source: str | None = None  # the column naming each row's dataset (one source per batch)


@dataclass(frozen=True)
class ContrastiveExample:
    anchor: str
    positive: str
    negatives: tuple[str, ...] = ()
    source: str | None = None

    def texts(self) -> tuple[str, ...]:
        return (self.anchor, self.positive, *self.negatives)


@dataclass
class ReadReport:
    path: str
    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples_of_skips: list[str] = field(default_factory=list)  # "file:line: reason", the first few

    def skip(self, line: int, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.examples_of_skips) < 5:
            self.examples_of_skips.append(f"{self.path}:{line}: {reason}")

    def summary(self) -> str:
        text = f"{self.path}: {self.rows:,} rows, {self.kept:,} examples"
        if self.skipped:
            reasons = ", ".join(f"{reason} {count:,}" for reason, count in sorted(self.skipped.items()))
            text += f"; skipped {sum(self.skipped.values()):,} ({reasons}), e.g. " + "; ".join(self.examples_of_skips)
        return text


def file_format(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    if name.endswith((".tsv", ".txt")):
        return "tsv"
    if name.endswith(".parquet"):
        return "parquet"
    raise ContrastiveDataError(f"{path}: unknown format (the name must end in .jsonl, .json, .tsv or .parquet)")


def _parquet_rows(path: str, report: ReadReport):
    """(row number from 1, dict of the row's columns), read in record batches (pyarrow)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ContrastiveDataError(f"{path}: reading Parquet needs pyarrow, which is not installed: "
                                   "pip install 'bert-pretrain[parquet]'") from None
    try:
        source = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ContrastiveDataError(f"{path}: not a readable Parquet file ({error})") from None
    number = 0
    try:
        for batch in source.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                number += 1
                report.rows += 1
                yield number, row
    except (pa.ArrowException, OSError) as error:
        raise ContrastiveDataError(f"{path}: unreadable after row {number} ({error})") from None


def _rows(path: str, report: ReadReport):
    """(line number, or row number of a Parquet file, dict of the row's columns) for each row;
    unreadable rows counted."""
    if file_format(path) == "parquet":
        yield from _parquet_rows(path, report)
        return
    if file_format(path) == "jsonl":
        with open(path, encoding="utf-8", errors="strict") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                report.rows += 1
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    report.skip(number, "invalid JSON")
                    continue
                if not isinstance(row, dict):
                    report.skip(number, "not a JSON object")
                    continue
                yield number, row
        return
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if not header:
            raise ContrastiveDataError(f"{path}: empty (a TSV file starts with a header row naming its columns)")
        for row in reader:
            report.rows += 1
            number = reader.line_num
            if len(row) < len(header):
                report.skip(number, f"{len(row)} fields of the header's {len(header)}")
                continue
            yield number, dict(zip(header, row))


def _text(row: dict, column: str):
    value = row.get(column)
    if value is None:
        return None, f"no '{column}'"
    if not isinstance(value, str):
        return None, f"'{column}' is not text"
    if not value.strip():
        return None, f"empty '{column}'"
    return value, None


def _negatives(row: dict, columns: Columns):
    """The row's negatives, or (None, reason)."""
    if len(columns.negatives) == 1 and isinstance(row.get(columns.negatives[0]), list):
        values = row[columns.negatives[0]]
        if not values:
            return None, f"empty '{columns.negatives[0]}'"
        if not all(isinstance(v, str) and v.strip() for v in values):
            return None, f"'{columns.negatives[0]}' holds an empty or non-text entry"
        return tuple(values), None
    negatives = []
    for column in columns.negatives:
        value, problem = _text(row, column)
        if problem:
            return None, problem
        negatives.append(value)
    return tuple(negatives), None


def _example(row: dict, columns: Columns):
    """(the row's example, None) or (None, why it is skipped)."""
    anchor, problem = _text(row, columns.anchor)
    if problem:
        return None, problem
    positive, problem = _text(row, columns.positive)
    if problem:
        return None, problem
    negatives, problem = _negatives(row, columns)
    if problem:
        return None, problem
    if positive in negatives:  # trained to be both near and far
        return None, "a negative equals the positive"
    source = None
    if columns.source:
        source, problem = _text(row, columns.source)
        if problem:
            return None, problem
    return ContrastiveExample(anchor, positive, negatives, source), None


def read_examples(path: str, columns: Columns = Columns()) -> tuple[list[ContrastiveExample], ReadReport]:
    """The examples of one file and what was skipped (ContrastiveDataError when none is left)."""
    if not os.path.isfile(path):
        raise ContrastiveDataError(f"{path}: no such file")
    report = ReadReport(path)
    examples = []
    try:
        for number, row in _rows(path, report):
            example, problem = _example(row, columns)
            if problem:
                report.skip(number, problem)
            else:
                examples.append(example)
    except UnicodeDecodeError as error:
        raise ContrastiveDataError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    report.kept = len(examples)
    if not examples:
        raise ContrastiveDataError(f"{report.summary()}: no example left (columns: anchor '{columns.anchor}', "
                                   f"positive '{columns.positive}'"
                                   + (f", negatives {list(columns.negatives)}" if columns.negatives else "") + ")")
    widths = {len(e.negatives) for e in examples}
    if len(widths) > 1:  # a list column of varying length: the loss needs one count per batch
        raise ContrastiveDataError(f"{path}: rows hold {sorted(widths)} negatives; give every row the same number")
    return examples, report


def contrastive_batches(examples: list[ContrastiveExample], batch_size: int, seed: int, epoch: int,
                        carried: list[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """(batches of example indices for one epoch, the indices left over for the next). Shuffled by
    (seed, epoch); each batch full, duplicate-free and (with sources) of one source. `carried`: the
    previous epoch's leftovers, placed first."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1 (got {batch_size})")
    rng = random.Random(seed * 1_000_003 + epoch)
    by_source: dict[str | None, list[int]] = {}
    carried = list(carried or [])
    order = list(range(len(examples)))
    rng.shuffle(order)
    carried_set = set(carried)
    for index in carried + [i for i in order if i not in carried_set]:
        by_source.setdefault(examples[index].source, []).append(index)
    batches, leftover = [], []
    for source in sorted(by_source, key=lambda s: (s is None, s or "")):
        pending = by_source[source]
        while pending:
            batch, texts, deferred = [], set(), []
            for index in pending:
                if len(batch) == batch_size:
                    deferred.append(index)
                    continue
                row_texts = examples[index].texts()
                if texts.isdisjoint(row_texts):
                    batch.append(index)
                    texts.update(row_texts)
                else:
                    deferred.append(index)
            if len(batch) < batch_size:  # not enough distinct rows left: they wait for the next epoch
                leftover.extend(batch + deferred)
                break
            batches.append(batch)
            pending = deferred
    rng.shuffle(batches)  # sources interleaved, each batch of one
    return batches, leftover
