"""What a dataset records about how it was made, and the checks that read it back.

Preprocessing and merging write two members into ``<prefix>.fingerprint.json`` (fingerprint.py)
beside the sizes and checksums:

- ``vocabulary``: the file the text was tokenized with (absolute path), its size, the SHA-256 of
  its tokens in id order (each followed by a newline: a canonical vocab.txt's own sha256sum), and
  whether the normaliser lowercases. Ids only mean something with their vocabulary: a run whose
  ``data.vocab_file`` has other tokens trains the embedding of one token on another's ids, and a
  merge of datasets made with two vocabularies mixes both meanings.
- ``token_counts``: all tokens, the special ones among them (the tokenizer's control tokens:
  [PAD] [UNK] [CLS] [SEP] [MASK] and any other bracketed token of a BERT vocabulary, the special
  tokens of a tokenizer.json: special_tokens.py) and the padding tokens. A dataset made mostly of them teaches nothing: a
  tokenizer.json that pads every sentence to 128, a vocabulary that turns the text into [UNK].

Datasets without a record (Megatron-LM's own tools, older runs) keep the structural checks; their
share of special tokens is estimated from a few MB read at evenly spread places of the .bin.
Torch-free: ``python -m pretrain --check-config`` runs these checks before any rank starts.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from .fingerprint import fingerprint_path
from .tokenizer import TokenizerError, special_token_ids, vocabulary_difference, vocabulary_tokens

__all__ = [
    "VOCABULARY",
    "TOKEN_COUNTS",
    "MAX_SPECIAL_SHARE",
    "VocabularyRecord",
    "TokenCounts",
    "vocabulary_sha256",
    "special_table",
    "count_tokens",
    "record_members",
    "read_record",
    "sampled_token_counts",
    "dataset_problems",
]

VOCABULARY, TOKEN_COUNTS = "vocabulary", "token_counts"
MAX_SPECIAL_SHARE = 0.5  # above it, a dataset is refused
SAMPLE_BYTES = 4 << 20  # read from a .bin without a record
SAMPLE_PIECES = 64
# megatron-core's .idx header and integer dtype codes (indexed.py reads them through megatron-core,
# which needs torch; this module must not)
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def vocabulary_sha256(tokens: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for token in tokens:
        digest.update(token.encode("utf-8") + b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class VocabularyRecord:
    file: str
    size: int
    sha256: str
    lowercase: bool

    @classmethod
    def of(cls, tokens: Sequence[str], lowercase: bool, file: str) -> "VocabularyRecord":
        return cls(os.path.abspath(file), len(tokens), vocabulary_sha256(tokens), lowercase)

    @classmethod
    def from_json(cls, saved: dict) -> "VocabularyRecord":
        return cls(str(saved["file"]), int(saved["size"]), str(saved["sha256"]), bool(saved["lowercase"]))

    def describe(self) -> str:
        return f"{self.file} ({self.size:,} tokens, {'lowercased' if self.lowercase else 'cased'})"


@dataclass(frozen=True)
class TokenCounts:
    total: int = 0
    special: int = 0  # pad included
    pad: int = 0

    @classmethod
    def from_json(cls, saved: dict) -> "TokenCounts":
        return cls(int(saved["total"]), int(saved["special"]), int(saved["pad"]))

    def __add__(self, other: "TokenCounts") -> "TokenCounts":
        return TokenCounts(self.total + other.total, self.special + other.special, self.pad + other.pad)

    @property
    def share(self) -> float:
        return self.special / self.total if self.total else 0.0

    def refusal(self, subject: str) -> str | None:
        """One line when most tokens are special: `subject` names the file."""
        if self.special <= MAX_SPECIAL_SHARE * self.total:
            return None
        return (f"{subject}: {self.share:.1%} of its {self.total:,} tokens are padding or special tokens "
                f"({self.pad:,} [PAD], {self.special - self.pad:,} others such as [UNK], [CLS], [SEP], [MASK]; more "
                f"than {MAX_SPECIAL_SHARE:.0%} is refused): a model learns nothing from them")


def special_table(tokens: Sequence[str]) -> np.ndarray:
    """bool per id: a special token (special_token_ids)."""
    table = np.zeros(len(tokens), dtype=bool)
    table[special_token_ids(tokens)] = True
    return table


def count_tokens(ids: np.ndarray, special: np.ndarray, pad_id: int) -> TokenCounts:
    known = ids[(ids >= 0) & (ids < len(special))]  # an id outside the vocabulary is not a special token
    return TokenCounts(int(ids.size), int(np.count_nonzero(special[known])), int(np.count_nonzero(ids == pad_id)))


def record_members(vocabulary: VocabularyRecord | None, counts: TokenCounts | None) -> dict:
    """The fingerprint's members for what is known (fingerprint.write_fingerprint's `extra`)."""
    members = {}
    if vocabulary is not None:
        members[VOCABULARY] = asdict(vocabulary)
    if counts is not None:
        members[TOKEN_COUNTS] = asdict(counts)
    return members


def read_record(prefix: str) -> tuple[VocabularyRecord | None, TokenCounts | None]:
    """What `<prefix>.fingerprint.json` records; (None, None) without one (an unreadable one is
    the fingerprint check's to report)."""
    try:
        with open(fingerprint_path(prefix), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None, None
    return _member(saved, VOCABULARY, VocabularyRecord), _member(saved, TOKEN_COUNTS, TokenCounts)


def _member(saved, key: str, cls):
    try:
        return cls.from_json(saved[key])
    except (KeyError, TypeError, ValueError):
        return None  # a fingerprint written before the record existed


def _index_dtype(idx_path: str) -> type | None:
    try:
        with open(idx_path, "rb") as f:
            head = f.read(len(_INDEX_MAGIC) + 9)
    except OSError:
        return None
    if len(head) < len(_INDEX_MAGIC) + 9 or not head.startswith(_INDEX_MAGIC):
        return None  # opening the dataset names the problem
    return _DTYPE_CODES.get(struct.unpack("<B", head[-1:])[0])


def sampled_token_counts(prefix: str, special: np.ndarray, pad_id: int, budget: int = SAMPLE_BYTES,
                         pieces: int = SAMPLE_PIECES) -> TokenCounts | None:
    """Counts over at most `budget` bytes of `<prefix>.bin`, read in `pieces` evenly spread
    pieces (the whole file when smaller); None when the .idx gives no integer dtype."""
    dtype = _index_dtype(prefix + ".idx")
    if dtype is None:
        return None
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(prefix + ".bin") // itemsize * itemsize
    piece = max(itemsize, budget // pieces // itemsize * itemsize)
    if size <= budget:
        starts, piece = [0], size
    else:
        starts = [i * (size - piece) // (pieces - 1) // itemsize * itemsize for i in range(pieces)]
    counts = TokenCounts()
    with open(prefix + ".bin", "rb") as f:
        for start in starts:
            f.seek(start)
            counts += count_tokens(np.frombuffer(f.read(piece), dtype=dtype), special, pad_id)
    return counts


def dataset_problems(prefix: str, where: str, tokens: Sequence[str] | None, vocab_file: str | None,
                     accept_vocab: bool, special_ids: Sequence[int] | None = None,
                     pad_id: int | None = None) -> list[str]:
    """One line per problem of the dataset `prefix` (listed under config key `where`) against the
    run's vocabulary (`tokens` of `vocab_file`, its control ids `special_ids` and padding id
    `pad_id`, by default a BERT vocabulary's bracketed tokens and [PAD]; None when it cannot be
    read, which the caller reports): mostly special tokens; made with another vocabulary (unless
    `accept_vocab`)."""
    vocabulary, counts = read_record(prefix)
    sampled = ""
    if counts is None and tokens is not None:
        if special_ids is None:
            special = special_table(tokens)
        else:
            special = np.zeros(len(tokens), dtype=bool)
            special[np.asarray(special_ids, dtype=np.int64)] = True
        counts = sampled_token_counts(prefix, special, tokens.index("[PAD]") if pad_id is None else pad_id)
        sampled = f" (a sample of {counts.total:,} tokens read over the file)" if counts else ""
    problems = []
    refusal = counts.refusal(f"{where}: {prefix}.bin{sampled}") if counts else None
    if refusal:
        problems.append(f"{refusal}; make it again with tools/preprocess_data.py (which switches a "
                        "tokenizer.json's padding off)")
    if vocabulary is not None and tokens is not None and not accept_vocab:
        problems += _vocabulary_problems(prefix, where, vocabulary, tokens, vocab_file)
    return problems


def _vocabulary_problems(prefix: str, where: str, vocabulary: VocabularyRecord, tokens: Sequence[str],
                         vocab_file: str) -> list[str]:
    if vocabulary_sha256(tokens) == vocabulary.sha256:
        return []
    recorded = _recorded_tokens(vocabulary)
    if recorded is not None:
        how = vocabulary_difference(tokens, recorded, here="in data.vocab_file", there="in the dataset's")
    else:  # the file preprocessing read has gone or changed since: only the record's size and hash
        how = (f"{len(tokens):,} tokens in data.vocab_file, {vocabulary.size:,} in the dataset's "
               f"(SHA-256 {vocabulary_sha256(tokens)[:12]}... and {vocabulary.sha256[:12]}...)")
    return [f"{where}: {prefix} was preprocessed with another vocabulary than data.vocab_file {vocab_file}: "
            f"{vocabulary.file}; {how}; preprocess it with data.vocab_file, or set data.accept_dataset_vocab=true "
            "to train on it deliberately"]


def _recorded_tokens(vocabulary: VocabularyRecord) -> Sequence[str] | None:
    """The tokens of the file the record names, if it still holds the recorded vocabulary."""
    try:
        tokens = vocabulary_tokens(vocabulary.file)
    except (TokenizerError, OSError):
        return None
    return tokens if vocabulary_sha256(tokens) == vocabulary.sha256 else None
