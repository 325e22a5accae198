"""A deterministic synthetic pretraining dataset with learnable structure.

Stands in for the real corpus until the indexed-dataset pipeline exists, and keeps tests free of
data files. Each "document" is a run of consecutive token ids from a random start (wrapping
around the word range), so a masked token is its left neighbour + 1: learnable in a few hundred
steps by a tiny model. Segment B continues A's run for IsNext and starts elsewhere for NotNext. Special ids follow Google
BERT's vocab.txt: [PAD]=0, [UNK]=100, [CLS]=101, [SEP]=102, [MASK]=103 when the vocabulary is
large enough, otherwise 0..4.
"""
from __future__ import annotations

import numpy as np

from .batches import SAMPLE_FIELDS


class SyntheticDataset:
    def __init__(self, vocab_size: int, seq_length: int, max_predictions: int, num_samples: int, seed: int,
                 masked_lm_prob: float = 0.15, min_fraction: float = 0.5, mask_share: float = 0.8,
                 random_share: float = 0.1):
        if vocab_size > 1000:
            self.pad, self.cls, self.sep, self.mask, self.first_word = 0, 101, 102, 103, 1000
        else:
            self.pad, self.cls, self.sep, self.mask, self.first_word = 0, 1, 2, 3, 5
        if vocab_size - self.first_word < 8:
            raise ValueError(f"synthetic data needs a vocabulary larger than {self.first_word + 8}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.max_predictions = max_predictions
        self.num_samples = num_samples
        self.seed = seed
        self.masked_lm_prob = masked_lm_prob
        self.mask_share, self.random_share = mask_share, random_share
        self.min_length = max(8, int(min_fraction * seq_length))  # 0.5: seq // 2, the draws of old

    def __len__(self) -> int:
        return self.num_samples

    def _progression(self, rng: np.random.Generator, length: int, start: int | None = None, step: int | None = None):
        words = self.vocab_size - self.first_word
        start = int(rng.integers(words)) if start is None else start
        step = 1 if step is None else step
        return self.first_word + (start + step * np.arange(length)) % words, start, step

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        seq = self.seq_length
        total = int(rng.integers(self.min_length, seq + 1)) - 3  # room for [CLS] [SEP] [SEP]
        len_a = int(rng.integers(1, total))
        len_b = total - len_a
        a, start, step = self._progression(rng, len_a)
        not_next = int(rng.integers(2))
        if not_next:
            b, _, _ = self._progression(rng, len_b)
        else:
            b, _, _ = self._progression(rng, len_b, start=start + step * len_a, step=step)

        tokens = np.full(seq, self.pad, dtype=np.int64)
        body = np.concatenate([[self.cls], a, [self.sep], b, [self.sep]])
        tokens[: len(body)] = body
        token_types = np.zeros(seq, dtype=np.int64)
        token_types[len_a + 2: len(body)] = 1
        padding_mask = np.zeros(seq, dtype=np.int64)
        padding_mask[: len(body)] = 1

        candidates = np.flatnonzero(tokens >= self.first_word)
        n_predict = min(self.max_predictions, max(1, int(round(len(candidates) * self.masked_lm_prob))))
        positions = np.sort(rng.choice(candidates, size=n_predict, replace=False))
        labels = tokens[positions].copy()
        draw = rng.random(n_predict)
        random_words = rng.integers(self.first_word, self.vocab_size, size=n_predict)
        tokens[positions] = np.where(draw < self.mask_share, self.mask,
                                     np.where(draw < self.mask_share + self.random_share, random_words, labels))

        pad_predictions = self.max_predictions - n_predict
        sample = {
            "input_ids": tokens,
            "token_type_ids": token_types,
            "padding_mask": padding_mask,
            "masked_positions": np.pad(positions, (0, pad_predictions)),
            "masked_labels": np.pad(labels, (0, pad_predictions)),
            "masked_weights": np.pad(np.ones(n_predict, dtype=np.float32), (0, pad_predictions)),
            "nsp_label": np.array(not_next, dtype=np.int64),
        }
        return {name: sample[name].astype(dtype) for name, dtype in SAMPLE_FIELDS.items()}
