"""Context parallelism (CP) for ModernBERT's attention: one micro-batch's tokens split over the
ranks of a CP group, each rank computing the layers for its share only (the split and the
exchanges are context_split.py's).

The model computes one row of the micro-batch's T real tokens (unpadding.py); every CP rank
holds that row's sample ids (which document each token belongs to), and `ContextSplit` gives rank
r the contiguous tokens [bounds[r], bounds[r + 1]): equal shares (at most one token apart).
`attention_work` says how even the global layers' work is, each query costing the length of its
document.

Attention of the rank's queries, with the rule of attention.py (a query sees the keys of its own
document, within half_window positions on a local layer):

- local layers: each rank receives the last half_window keys and values of the rank before it
  and the first half_window of the rank after it (`halo`, point to point; the gradients go back
  the same way): nothing else crosses ranks. A split whose shares are shorter than the halo falls
  back to the global layers' gathering (short rows only).
- global layers: every rank's keys and values are gathered (all-gather; the gradient of each
  rank's share comes back summed over the ranks), and the queries attend the span of documents
  they touch.

Both run `blocked_attention`: query blocks of `block` tokens, each attending only the keys its
documents (and window) reach, each block checkpointed, so that what a layer keeps for backward is
its operands, not [queries x keys] probabilities, and the memory per rank falls with the CP size.
Dropout on the probabilities draws per block: the same numbers as one process only without it
(ModernBERT trains without attention dropout).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .attention import _attend
from .context_split import ContextGroup, ContextSplit, gather_masked, gather_row, halo
from .micro_batch import MicroBatchCache

__all__ = ["ContextGroup", "ContextSplit", "attention_work", "blocked_attention", "context_parallel_attention",
           "gather_masked", "gather_row", "halo"]

# Query block of the global layers: memory [heads, block, span] per block in flight
GLOBAL_BLOCK = 512
LOCAL_BLOCK = 128


def attention_work(sample_ids: torch.Tensor, split: ContextSplit) -> list[int]:
    """Per rank, the global layers' query-key pairs: each query attends its whole document."""
    ids = sample_ids.reshape(-1)
    lengths = document_lengths(ids)
    return [int(lengths[a:b].sum()) for a, b in zip(split.bounds[:-1], split.bounds[1:])]


def document_lengths(ids: torch.Tensor) -> torch.Tensor:
    """Per token of a row whose documents are contiguous runs of equal ids, its document's length."""
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    return torch.repeat_interleave(counts, counts)


def _document_bounds(ids: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per token, its document's first index and one past its last (host lists: block planning)."""
    _, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0)
    starts = ends - counts
    return (torch.repeat_interleave(starts, counts).tolist(), torch.repeat_interleave(ends, counts).tolist())


# ----------------------------------------------------------------------------- attention
def blocked_attention(query, key, value, sample_ids, key_start: int, split: ContextSplit, *,
                      half_window: int | None, dropout_p: float = 0.0, scale: float | None = None,
                      block: int | None = None, cache: MicroBatchCache | None = None) -> torch.Tensor:
    """This rank's queries [L, heads, head_dim] (row tokens split.start ...) against keys and values
    [K, heads, head_dim] that hold row tokens key_start ... key_start + K, under the module's rule;
    `sample_ids` [T] or [1, T]: the whole row's. The context [L, heads, head_dim]. With `cache`, the
    documents' bounds (one host read) are taken once per micro-batch, not per layer."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    block = block or (GLOBAL_BLOCK if half_window is None else LOCAL_BLOCK)
    ids = sample_ids.reshape(-1)
    starts, ends = (_document_bounds(ids) if cache is None else
                    cache.get(sample_ids, "cp-document-bounds", lambda: _document_bounds(ids)))
    key_end = key_start + key.shape[0]
    reach = half_window if half_window is not None else ids.numel()
    outputs = []
    for q0 in range(split.start, split.end, block):
        q1 = min(q0 + block, split.end)
        lo = max(starts[q0], q0 - reach, key_start)
        hi = min(ends[q1 - 1], q1 + reach, key_end)
        q = query[q0 - split.start:q1 - split.start]
        k, v = key[lo - key_start:hi - key_start], value[lo - key_start:hi - key_start]
        args = (q, k, v, ids[q0:q1], ids[lo:hi], q0 - lo, half_window, dropout_p, scale)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            outputs.append(checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outputs.append(_attend_block(*args))
    return torch.cat(outputs)


def _attend_block(q, k, v, ids_q, ids_k, offset: int, half_window, dropout_p, scale):
    """Token-major q [B, h, d] at row positions offset + 0..B-1 relative to k's first, k and v [S, h, d]."""
    allowed = ids_q[:, None] == ids_k[None, :]
    if half_window is not None:
        distance = torch.arange(k.shape[0], device=q.device)[None, :] - offset - \
            torch.arange(q.shape[0], device=q.device)[:, None]
        allowed &= distance.abs() <= half_window
    out = _attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], allowed[None, None],
                  dropout_p, scale)
    return out[0].transpose(0, 1)


def context_parallel_attention(query, key, value, sample_ids, split: ContextSplit, *, half_window: int | None,
                               dropout_p: float = 0.0, scale: float | None = None,
                               cache: MicroBatchCache | None = None) -> torch.Tensor:
    """This rank's context [L, heads, head_dim] from its queries, keys and values [L, heads,
    head_dim] (rotary applied) and the row's sample ids ([T] or [1, T]; `cache`: see
    blocked_attention): the halo on local layers whose shares are at least the window's half, every
    share's keys otherwise (see the module docstring)."""
    if half_window is not None and split.shortest >= half_window:
        width = half_window if split.size > 1 else 0
        keys, values = halo(key, width, split), halo(value, width, split)
        key_start = split.start - (width if split.rank > 0 else 0)
    else:
        keys, values, key_start = gather_row(key, split), gather_row(value, split), 0
    return blocked_attention(query, keys, values, sample_ids, key_start, split, half_window=half_window,
                             dropout_p=dropout_p, scale=scale, cache=cache)
