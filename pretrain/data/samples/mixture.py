"""How a blend of corpora shares the training samples: by samples (data.weights as Megatron reads
them), by tokens (data.weights_unit: tokens), or by temperature over the corpora's sizes in tokens
(data.sampling_temperature T, or data.sampling_alpha = 1/T: shares proportional to tokens^alpha,
as XLM-R and mmBERT state them).

Blending draws samples, so a token share w_i becomes a sample share proportional to w_i / (the
corpus's mean tokens per sample). What the blend achieves is measured on its sample index (each
drawn sample's tokens, from the segment table) and reported at start-up, with how many epochs of
each corpus the run reads; a corpus read more than data.max_epochs times is refused, by name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

UNITS = ("samples", "tokens")


@dataclass(frozen=True)
class MixtureSettings:
    unit: str = "samples"  # what data.weights are shares of
    alpha: float | None = None  # shares proportional to each corpus's tokens ** alpha (replaces the weights)
    max_epochs: float | None = None  # refuse a corpus read more often than this


def sample_tokens(table: np.ndarray, sentence_lengths: np.ndarray, max_tokens: int, pair: bool) -> np.ndarray:
    """Tokens of each sample of a segment table as the dataset builds it: its segments' tokens cut
    to max_tokens, and the special tokens ([CLS] and one [SEP] per segment)."""
    ends = np.concatenate([[0], np.cumsum(sentence_lengths, dtype=np.int64)])
    content = (ends[table[:, 1]] - ends[table[:, 0]]) + (ends[table[:, 3]] - ends[table[:, 2]])
    return np.minimum(content, max_tokens) + (3 if pair else 2)


def sample_weights(weights: list[float], tokens: list[np.ndarray], mixture: MixtureSettings) -> list[float]:
    """The blend's weights per sample for the corpora whose samples hold `tokens` (one array per
    corpus): `weights` as given (unit samples), or token shares (weights in unit tokens, or the
    corpora's sizes to the power alpha) over each corpus's mean tokens per sample."""
    if mixture.alpha is not None:
        return [float(t.sum()) ** mixture.alpha / float(t.mean()) for t in tokens]
    if mixture.unit == "tokens":
        return [w / float(t.mean()) for w, t in zip(weights, tokens)]
    return list(weights)


def token_shares(weights: list[float], tokens: list[np.ndarray], mixture: MixtureSettings) -> list[float]:
    """The token share asked of each corpus."""
    if mixture.alpha is not None:
        raw = [float(t.sum()) ** mixture.alpha for t in tokens]
    elif mixture.unit == "tokens":
        raw = list(weights)
    else:
        raw = [w * float(t.mean()) for w, t in zip(weights, tokens)]
    return [r / sum(raw) for r in raw]


SHOWN_CORPORA = 30  # the start-up report's corpora, by share asked, beyond which it summarises
MEASURED_SAMPLES = 50_000  # the start-up report measures token shares on the blend's first samples


def epochs_read(weights: list[float], num_samples: int, table_sizes: list[int]) -> list[float]:
    """How many times the run reads each corpus's samples: its draws over its table's size. The
    blend (megatron-core's build_blending_indices) keeps every corpus's draws within one sample of
    its share of num_samples, so the count needs no scan of an index that may hold billions."""
    total = sum(weights)
    return [w / total * num_samples / max(size, 1) for w, size in zip(weights, table_sizes)]


def measured_token_shares(blend_corpus: np.ndarray, blend_k: np.ndarray, tokens: list[np.ndarray],
                          row_of, limit: int = MEASURED_SAMPLES) -> tuple[list[float], int]:
    """Each corpus's share of the tokens of the blend's first `limit` samples, each drawn sample's
    own tokens (`row_of(corpus, k)`: the segment row of the corpus's k-th draw); and how many."""
    n = min(limit, blend_corpus.size)
    totals = [0] * len(tokens)
    for corpus, k in zip(blend_corpus[:n].tolist(), blend_k[:n].tolist()):
        totals[corpus] += int(tokens[corpus][row_of(corpus, k)])
    return [t / max(sum(totals), 1) for t in totals], n


def describe(names: list[str], asked: list[float], got: list[float], epochs: list[float], measured: int,
             how: str) -> str:
    """One line per corpus: its token share asked and achieved, and the epochs the run reads of it."""
    lines = [f"data mixture ({how}): token shares asked and achieved on the first {measured:,} samples"]
    rows = list(zip(names, asked, got, epochs))
    if len(rows) > SHOWN_CORPORA:  # hundreds of languages: the largest, and the most repeated
        by_share = sorted(rows, key=lambda row: -row[1])
        rows = by_share[:SHOWN_CORPORA] + [max(by_share[SHOWN_CORPORA:], key=lambda row: row[3])]
    for name, want, share, read in rows:
        lines.append(f"  {name}: {share:.1%} of tokens (asked {want:.1%}), {read:.2f} epochs in the run")
    if len(rows) < len(names):
        rest = len(names) - SHOWN_CORPORA
        lines.insert(-1, f"  ... {rest:,} smaller corpora, {sum(asked) - sum(r[1] for r in rows[:-1]):.1%} of the "
                         "tokens asked; the one of them read most often:")
    return "\n".join(lines)
