"""Masked-LM target selection (Devlin et al. 2019, google-research/bert create_pretraining_data).

A pure function of its arguments and the generator it is handed: the dataset seeds that generator
from (seed, sample id) for static masking or (seed, epoch, sample id) for dynamic masking, so a
sample's masks never depend on the layout, the worker that built it, or what came before.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskingConfig:
    masked_lm_prob: float  # share of candidate tokens predicted
    max_predictions: int  # cap per sequence (20 at seq 128, 80 at seq 512)
    whole_word: bool  # a word's continuations ('##' pieces, BPE pieces without 'Ġ') are masked with it, never alone
    max_ngram: int  # 1 = BERT; >1 = spans of up to n units, length n drawn with p ~ 1/n (Megatron, SpanBERT-like)
    mask_id: int
    replacement_ids: np.ndarray  # ids the 10% random replacement draws from (no special tokens)
    mask_share: float = 0.8  # a predicted token becomes [MASK] with this probability ...
    random_share: float = 0.1  # ... a random token with this one, else it stays (BERT's 80/10/10)


def mask_tokens(tokens: np.ndarray, candidate: np.ndarray, continuation: np.ndarray, rng: np.random.Generator,
                cfg: MaskingConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Choose and corrupt the predicted positions of one sequence.

    tokens: int64 [n], the unpadded sequence. candidate: bool [n], positions that may be
    predicted (not [CLS]/[SEP]/other specials). continuation: bool [n], the token continues the
    word before it (a '##' WordPiece; a byte-level BPE piece without a leading 'Ġ': the
    tokenizer's rule, special_tokens.WordBoundaries). A continuation right after a position that
    is no candidate starts a unit of its own. Returns (corrupted tokens, sorted predicted
    positions, original ids there).
    """
    positions = np.flatnonzero(candidate)
    if positions.size == 0:
        return tokens.copy(), positions, positions
    # Units are what gets chosen together: whole words (a candidate followed by its candidate
    # continuations) or single tokens.
    if cfg.whole_word:
        follows_candidate = np.zeros(positions.size, dtype=bool)
        follows_candidate[1:] = positions[1:] == positions[:-1] + 1
        unit_starts = np.flatnonzero(~(continuation[positions] & follows_candidate))
    else:
        unit_starts = np.arange(positions.size)
    unit_ends = np.append(unit_starts[1:], positions.size)
    n_units = unit_starts.size
    budget = min(cfg.max_predictions, max(1, int(round(positions.size * cfg.masked_lm_prob))))

    chosen: list[np.ndarray] = []
    count = 0
    covered = np.zeros(n_units, dtype=bool)
    if cfg.max_ngram > 1:
        ngram_p = 1.0 / np.arange(1, cfg.max_ngram + 1)
        ngram_cdf = np.cumsum(ngram_p / ngram_p.sum())
    starts, ends = unit_starts.tolist(), unit_ends.tolist()  # Python ints: this loop is the hot path
    for unit in rng.permutation(n_units).tolist():
        if count >= budget:
            break
        n = 1
        if cfg.max_ngram > 1:
            n = int(np.searchsorted(ngram_cdf, rng.random(), side="right")) + 1
            n = min(n, n_units - unit)
        # Shorten the span until it fits the budget (a unit that alone would overshoot is skipped,
        # as in the reference implementation: predictions never exceed the budget).
        while n > 0 and count + (ends[unit + n - 1] - starts[unit]) > budget:
            n -= 1
        if n == 0 or (covered[unit] if n == 1 else covered[unit:unit + n].any()):
            continue
        covered[unit:unit + n] = True
        chosen.append(positions[starts[unit]:ends[unit + n - 1]])
        count += ends[unit + n - 1] - starts[unit]
    picked = np.sort(np.concatenate(chosen)) if chosen else positions[:0]

    corrupted = tokens.copy()
    labels = tokens[picked]
    draw = rng.random(picked.size)
    to_mask = draw < cfg.mask_share  # 80% [MASK], 10% unchanged, 10% a random token (BERT's shares)
    to_random = draw >= 1.0 - cfg.random_share
    corrupted[picked[to_mask]] = cfg.mask_id
    if to_random.any():
        corrupted[picked[to_random]] = cfg.replacement_ids[rng.integers(cfg.replacement_ids.size, size=int(to_random.sum()))]
    return corrupted, picked, labels
