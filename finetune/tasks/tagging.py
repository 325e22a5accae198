"""Tagged text for token classification (ner.py's files): the CoNLL-2003 file format and JSON lines, and the IOB
tag schemes.

CoNLL format: one token per line with its columns separated by whitespace (CoNLL-2003: word, POS
tag, chunk tag, NER tag), a blank line after each sentence, and a `-DOCSTART-` line before each
document. The word is column 0; the tag column is chosen (default: the last). A file whose lines
hold only the word is untagged (a test file to predict).

JSON lines: one sentence per line, {"tokens": [...], "tags": [...]} (or "ner_tags", as in Hugging
Face's datasets export; integer tags index the task's label list). A line whose tokens are
["-DOCSTART-"] starts a document, as in that export.

Tag schemes (entities are "chunks" as the CoNLL evaluation script conlleval defines them): IOB2
(BIO) marks every entity's first token B-TYPE; IOB1 (the original CoNLL-2003 files) uses B-TYPE
only for an entity that directly follows one of the same type, and I-TYPE otherwise. A token
starts an entity when its tag is B-X, or I-X after O, after the sentence start or after another
type. The model is trained on IOB2 tags; predictions are written back in the file's scheme.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from pretrain.common.textfile import read_lines

from .base import ReadReport, TaskDataError

DOCSTART = "-DOCSTART-"
CONLL2003_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")
"""CoNLL-2003's entity tags in Hugging Face `datasets`' order (integer tags of its export mean these)."""
SCHEMES = ("auto", "iob1", "iob2")


@dataclass
class Sentence:
    words: list[str]
    tags: list[str] | None  # as in the file (its scheme); None in an untagged file
    lines: list[int]  # the file line of each word (JSON lines: the sentence's line, repeated)


@dataclass
class Document:
    sentences: list[Sentence] = field(default_factory=list)
    docstart: bool = False  # the file marked its start with -DOCSTART-

    @property
    def words(self) -> list[str]:
        return [w for s in self.sentences for w in s.words]

    @property
    def num_words(self) -> int:
        return sum(len(s.words) for s in self.sentences)


# ----------------------------------------------------------------------------- tag schemes
def split_tag(tag: str) -> tuple[str, str | None]:
    """("O", None), ("B", type) or ("I", type); ValueError for anything else."""
    if tag == "O":
        return "O", None
    prefix, dash, kind = tag.partition("-")
    if dash and prefix in ("B", "I") and kind:
        return prefix, kind
    raise ValueError(f"tag {tag!r} is not O, B-TYPE or I-TYPE")


def chunk_starts(tags: Sequence[str]) -> list[bool]:
    """Whether each token starts an entity, by conlleval's rules (IOB1 and IOB2 alike)."""
    starts, previous = [], None  # previous token's type (None: O or the sentence start)
    for tag in tags:
        prefix, kind = split_tag(tag)
        starts.append(prefix == "B" or (prefix == "I" and kind != previous))
        previous = kind
    return starts


def to_iob2(tags: Sequence[str]) -> list[str]:
    """The same entities with every first token tagged B- (model predictions may start an entity with I-)."""
    return [tag if tag == "O" else ("B-" if start else "I-") + split_tag(tag)[1]
            for tag, start in zip(tags, chunk_starts(tags))]


def to_iob1(tags: Sequence[str]) -> list[str]:
    """The same entities with B- only where an entity directly follows one of its type."""
    out, previous = [], None
    for tag, start in zip(tags, chunk_starts(tags)):
        kind = split_tag(tag)[1]
        out.append("O" if kind is None else ("B-" if start and previous == kind else "I-") + kind)
        previous = kind
    return out


def in_scheme(tags: Sequence[str], scheme: str) -> list[str]:
    return to_iob1(tags) if scheme == "iob1" else to_iob2(tags)


def iob1_evidence(sentences: Sequence[Sentence]) -> int | None:
    """The file line of the first entity that starts with I- (only IOB1 does that), or None."""
    for sentence in sentences:
        if sentence.tags:
            for tag, start, line in zip(sentence.tags, chunk_starts(sentence.tags), sentence.lines):
                if start and tag.startswith("I-"):
                    return line
    return None


def detect_scheme(sentences: Sequence[Sentence]) -> str:
    return "iob1" if iob1_evidence(sentences) is not None else "iob2"


def iob2_labels(labels: Sequence[str]) -> list[str]:
    """Problems with a label list the model predicts: it must hold O and, for every type, B- and I-."""
    problems, kinds = [], {}
    for label in labels:
        try:
            prefix, kind = split_tag(label)
        except ValueError as e:
            problems.append(f"task.labels: {e}")
            continue
        if kind is not None:
            kinds.setdefault(kind, set()).add(prefix)
    if "O" not in labels:
        problems.append("task.labels must include O")
    if len(set(labels)) != len(labels):
        problems.append("task.labels has duplicates")
    incomplete = sorted(k for k, prefixes in kinds.items() if prefixes != {"B", "I"})
    if incomplete:
        problems.append(f"task.labels needs both B- and I- for every type (IOB2); missing for {', '.join(incomplete)}")
    return problems


# ----------------------------------------------------------------------------- reading
def read_tagged(path: str, tag_column: int, labels: Sequence[str]) -> tuple[list[Document], ReadReport]:
    """Documents of a CoNLL-format file, or of JSON lines (.jsonl/.json). Raises TaskDataError
    naming file:line for a line that cannot be read; empty sentences of JSON lines are skipped and
    counted."""
    lines = read_lines(path, TaskDataError)
    report = ReadReport(path, unit="sentences")
    reader = _read_json_lines if path.endswith((".jsonl", ".json")) else _read_conll
    documents = [d for d in reader(path, lines, tag_column, labels, report) if d.sentences]
    sentences = [s for d in documents for s in d.sentences]
    if not sentences:
        raise TaskDataError(f"{path}: no sentences")
    if len({s.tags is None for s in sentences}) > 1:
        untagged = next(s for s in sentences if s.tags is None)
        raise TaskDataError(f"{path}:{untagged.lines[0]}: this sentence has no tags but others have: "
                            "every line needs the same columns")
    for sentence in sentences:
        for tag, line in zip(sentence.tags or (), sentence.lines):
            try:
                split_tag(tag)
            except ValueError as e:
                raise TaskDataError(f"{path}:{line}: {e} (token classification scores entities; "
                                    "is task.tag_column the entity column?)") from None
    report.examples = len(sentences)
    report.rows = report.examples + sum(report.skipped.values())  # every sentence is kept or skipped by reason
    return documents, report


def _read_conll(path, lines, tag_column, labels, report) -> list[Document]:
    documents, document, sentence, columns = [], Document(), None, None

    def end_sentence():
        nonlocal sentence
        if sentence is not None:
            document.sentences.append(sentence)
            sentence = None

    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields:
            end_sentence()
            continue
        if fields[0] == DOCSTART:
            end_sentence()
            documents.append(document)
            document = Document(docstart=True)
            continue
        if columns is None:
            columns = len(fields)
            if columns > 1 and (not -columns <= tag_column < columns or tag_column % columns == 0):
                raise TaskDataError(f"{path}:{number}: task.tag_column {tag_column} is not a tag column of a "
                                    f"line with {columns} columns (column 0 is the word)")
        if len(fields) != columns:
            raise TaskDataError(f"{path}:{number}: {len(fields)} columns where the file's first token line has "
                                f"{columns}: {line.strip()!r}")
        if sentence is None:
            sentence = Sentence([], [] if columns > 1 else None, [])
        sentence.words.append(fields[0])
        sentence.lines.append(number)
        if columns > 1:
            sentence.tags.append(fields[tag_column])
    end_sentence()
    documents.append(document)
    return documents


def _read_json_lines(path, lines, tag_column, labels, report) -> list[Document]:
    documents, document = [], Document()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("tokens"), list):
            raise TaskDataError(f"{where}: expected an object with a \"tokens\" list (and \"tags\")")
        tokens = row["tokens"]
        tags = row.get("tags", row.get("ner_tags"))
        if tokens == [DOCSTART]:
            documents.append(document)
            document = Document(docstart=True)
            continue
        if not all(isinstance(t, str) and t and not any(c.isspace() for c in t) for t in tokens):
            raise TaskDataError(f"{where}: every token must be a non-empty string without whitespace")
        if not tokens:
            report.skip("no tokens", where)
            continue
        if tags is not None:
            if not isinstance(tags, list) or len(tags) != len(tokens):
                raise TaskDataError(f"{where}: {len(tokens)} tokens but "
                                    f"{len(tags) if isinstance(tags, list) else 'no list of'} tags")
            try:
                tags = [labels[t] if isinstance(t, int) else t for t in tags]
            except IndexError:
                raise TaskDataError(f"{where}: integer tags index task.labels ({len(labels)} labels): "
                                    f"{max(tags, key=lambda t: t if isinstance(t, int) else -1)} is out of range") from None
            if not all(isinstance(t, str) for t in tags):
                raise TaskDataError(f"{where}: tags must be strings or integers")
        document.sentences.append(Sentence(list(tokens), tags, [number] * len(tokens)))
    documents.append(document)
    return documents


def conll_text(documents: Sequence[Document], predicted: Sequence[Sequence[str]]) -> str:
    """The CoNLL evaluation script's input: "word gold predicted" per token ("word predicted"
    without gold), a blank line after each sentence, `-DOCSTART- -X- O O` lines kept."""
    out, sentences = [], iter(predicted)
    gold = any(s.tags is not None for d in documents for s in d.sentences)
    for document in documents:
        if document.docstart:
            out += [f"{DOCSTART} O O" if gold else f"{DOCSTART} O", ""]
        for sentence in document.sentences:
            tags = next(sentences)
            for i, (word, tag) in enumerate(zip(sentence.words, tags)):
                out.append(f"{word} {sentence.tags[i]} {tag}" if sentence.tags is not None else f"{word} {tag}")
            out.append("")
    return "\n".join(out) + "\n"
