"""What the sample builder needs to know about a vocabulary: the ids of its special tokens by
role, the control ids never predicted, which ids continue a word (for whole-word masking), which
ids a random replacement may draw.

Read with tokenizer.py's readers (Google BERT's vocab.txt, or any Hugging Face tokenizer.json:
WordPiece, byte-level BPE, ...), so both halves of the pipeline accept and refuse the same files;
the roles and word boundaries come from the tokenizer (preprocess/special_tokens.py), never from
assumed names. Nothing here tokenizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..preprocess.special_tokens import SpecialTokens, WordBoundaries
from ..preprocess.tokenizer import TokenizerError, vocabulary_description

VocabError = TokenizerError  # a vocabulary file that cannot be used; the message names the file


@dataclass(frozen=True)
class Vocabulary:
    path: str
    tokens: tuple[str, ...]  # id -> token ("" for an id no token has)
    specials: SpecialTokens
    words: WordBoundaries

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def pad_id(self) -> int:
        return self.specials.pad_id

    @property
    def unk_id(self) -> int | None:
        return self.specials.unk_id

    @property
    def cls_id(self) -> int:
        return self.specials.cls_id

    @property
    def sep_id(self) -> int:
        return self.specials.sep_id

    @property
    def mask_id(self) -> int:
        return self.specials.mask_id

    @classmethod
    def from_file(cls, path: str | Path) -> "Vocabulary":
        path = str(path)
        tokens, specials, words = vocabulary_description(path)  # refuses a tokenizer without a needed role
        return cls(path, tokens, specials, words)

    @property
    def special_ids(self) -> np.ndarray:
        """Ids never chosen for masking nor drawn as random replacements: the special tokens' roles
        and every other control token ([unused0], <|endoftext|>, ...)."""
        return np.array(self.specials.control_ids, dtype=np.int64)

    def continuation_flags(self) -> np.ndarray:
        """bool[size]: token i continues the word before it ('##' for WordPiece, no leading 'Ġ'
        for a byte-level BPE, ...: special_tokens.WordBoundaries)."""
        return self.words.continuation_flags(self.tokens, self.specials.control_ids)

    def replacement_ids(self) -> np.ndarray:
        """Ids the 10%-random replacement draws from: every token but the control ones (and ids
        no token has)."""
        keep = np.array([bool(t) for t in self.tokens], dtype=bool)
        keep[self.special_ids] = False
        return np.flatnonzero(keep).astype(np.int64)


WordPieceVocab = Vocabulary  # its name from when only WordPiece vocabularies were read
