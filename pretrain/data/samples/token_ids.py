"""What the sample builder needs to know about a WordPiece vocabulary: ids of the special
tokens, which ids are '##' continuations, which ids a random replacement may draw.

Read with tokenizer.py's readers (Google BERT's vocab.txt, or a Hugging Face tokenizer.json),
so both halves of the pipeline accept and refuse the same files. Nothing here tokenizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..preprocess.tokenizer import TokenizerError, special_token_ids, vocabulary_tokens

VocabError = TokenizerError  # a vocabulary file that cannot be used; the message names the file


@dataclass(frozen=True)
class WordPieceVocab:
    path: str
    tokens: tuple[str, ...]  # id -> token
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_file(cls, path: str | Path) -> "WordPieceVocab":
        path = str(path)
        tokens = vocabulary_tokens(path)  # checks the special tokens
        ids = {token: i for i, token in enumerate(tokens)}
        return cls(path, tokens, ids["[PAD]"], ids["[UNK]"], ids["[CLS]"], ids["[SEP]"], ids["[MASK]"])

    @property
    def special_ids(self) -> np.ndarray:
        """Ids never chosen for masking nor drawn as random replacements: the five specials and
        any other bracketed control token ([unused0], [BOS], ...)."""
        return np.array(special_token_ids(self.tokens), dtype=np.int64)

    def continuation_flags(self) -> np.ndarray:
        """bool[size]: token i continues the previous word (a '##' WordPiece)."""
        return np.array([t.startswith("##") for t in self.tokens], dtype=bool)

    def replacement_ids(self) -> np.ndarray:
        """Ids the 10%-random replacement draws from: every non-special token."""
        keep = np.ones(self.size, dtype=bool)
        keep[self.special_ids] = False
        return np.flatnonzero(keep).astype(np.int64)

