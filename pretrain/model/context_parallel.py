"""Context parallelism (CP) for ModernBERT's attention: one micro-batch's tokens split over the
ranks of a CP group, each rank computing the layers for its share only (the split and the
exchanges are context_split.py's).

The model computes one row of the micro-batch's T real tokens (unpadding.py); every CP rank
holds that row's sample ids (which document each token belongs to), and `ContextSplit.balanced`
gives each rank an equal share of the tokens and of the global layers' work (each long document
cut into one piece per rank, the short ones filling the rest). `attention_work` says how even
that work is, each query costing the length of its document.

Attention of the rank's queries, with the rule of attention.py (a query sees the keys of its own
document, within half_window positions on a local layer):

- local layers: each rank receives the keys and values its queries' windows reach in other
  shares (`neighbours`, point to point, planned per micro-batch from the split and the documents;
  the gradients go back the same way): half a window on each side of each cut, within the
  document. Nothing else crosses ranks.
- global layers: every rank's keys and values are gathered (all-gather; the gradient of each
  rank's share comes back summed over the ranks), and the queries attend the span of documents
  they touch.

Both run `blocked_attention`: query blocks of at most `block` tokens within each run of the
rank's share, each attending only the keys its documents (and window) reach, each block
checkpointed, so that what a layer keeps for backward is its operands, not [queries x keys]
probabilities, and the memory per rank falls with the CP size. Dropout on the probabilities
draws per block: the same numbers as one process only without it (ModernBERT trains without
attention dropout).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .attention import _attend
from .context_split import (ContextGroup, ContextSplit, KeyLayout, NeighbourPlan, gather_masked, gather_row,
                            neighbours)
from .micro_batch import MicroBatchCache
from .ring_attention import RingPlan, ring_attention

__all__ = ["ContextGroup", "ContextSplit", "attention_work", "blocked_attention", "context_parallel_attention",
           "gather_masked", "gather_row", "neighbours"]

# Query block of the global layers: memory [heads, block, span] per block in flight
GLOBAL_BLOCK = 512
LOCAL_BLOCK = 128


def attention_work(sample_ids: torch.Tensor, split: ContextSplit) -> list[int]:
    """Per rank, the global layers' query-key pairs: each query attends its whole document."""
    lengths = document_lengths(sample_ids.reshape(-1))
    return [sum(int(lengths[a:b].sum()) for a, b in runs) for runs in split.runs]


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
def blocked_attention(query, key, value, sample_ids, keys: KeyLayout, split: ContextSplit, *,
                      half_window: int | None, dropout_p: float = 0.0, scale: float | None = None,
                      block: int | None = None, cache: MicroBatchCache | None = None) -> torch.Tensor:
    """This rank's queries [L, heads, head_dim] (its share: row positions split.mine) against keys
    and values [K, heads, head_dim] at the row positions `keys` says, under the module's rule;
    `sample_ids` [T] or [1, T]: the whole row's. The context [L, heads, head_dim]. With `cache`,
    the documents' bounds (one host read) are taken once per micro-batch, not per layer."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    block = block or (GLOBAL_BLOCK if half_window is None else LOCAL_BLOCK)
    ids = sample_ids.reshape(-1)
    starts, ends = document_bounds(sample_ids, cache)
    reach = half_window if half_window is not None else ids.numel()
    pieces, offset = [], 0  # (first and one-past-last query of the share, first row position, key span)
    for a, b in split.mine:
        for q0 in range(a, b, block):
            q1 = min(q0 + block, b)
            pieces.append((offset + q0 - a, offset + q1 - a, q0, max(starts[q0], q0 - reach),
                           min(ends[q1 - 1], q1 + reach)))
        offset += b - a
    share_ids = None
    if half_window is None and len(pieces) > len(split.mine) // 2 + 1:
        # global layers over many short runs (pieces of short documents): consecutive runs attend
        # as one block while it stays within `block` queries and twice their own key spans
        pieces, share_ids = _merged(pieces, block), split.local(ids)
    outputs = []
    for first, last, q0, lo, hi in pieces:
        at = keys.locate(lo, hi)
        q, k, v = query[first:last], key[at:at + hi - lo], value[at:at + hi - lo]
        ids_q = ids[q0:q0 + last - first] if share_ids is None else share_ids[first:last]
        args = (q, k, v, ids_q, ids[lo:hi], q0 - lo, half_window, dropout_p, scale)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            outputs.append(checkpoint(_attend_block, *args, use_reentrant=False))
        else:
            outputs.append(_attend_block(*args))
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def _merged(pieces: list[tuple], block: int) -> list[tuple]:
    """Consecutive query pieces of a global layer as fewer blocks: a piece joins the block before
    it while the block holds at most `block` queries and its key span at most twice its pieces'
    spans (the keys between two runs' documents are computed and masked)."""
    out, own = [], 0
    for first, last, q0, lo, hi in pieces:
        if out:
            f, l, s, blo, bhi = out[-1]
            span = max(bhi, hi) - min(blo, lo)
            if last - f <= block and span <= 2 * (own + hi - lo):
                out[-1], own = (f, last, s, min(blo, lo), max(bhi, hi)), own + hi - lo
                continue
        out.append((first, last, q0, lo, hi))
        own = hi - lo
    return out


def document_bounds(sample_ids: torch.Tensor, cache: MicroBatchCache | None = None) -> tuple[list[int], list[int]]:
    """_document_bounds of the row, once per micro-batch with `cache`."""
    ids = sample_ids.reshape(-1)
    if cache is None:
        return _document_bounds(ids)
    return cache.get(sample_ids, "cp-document-bounds", lambda: _document_bounds(ids))


def _attend_block(q, k, v, ids_q, ids_k, offset: int, half_window, dropout_p, scale):
    """Token-major q [B, h, d] at row positions offset + 0..B-1 relative to k's first (a local
    layer's; a global layer's block may gather several runs), k and v [S, h, d]."""
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
                               cache: MicroBatchCache | None = None, ring: bool = False) -> torch.Tensor:
    """This rank's context [L, heads, head_dim] from its queries, keys and values [L, heads,
    head_dim] (rotary applied) and the row's sample ids ([T] or [1, T]; `cache`: see
    blocked_attention): on local layers the keys its windows reach from the other shares, on
    global layers every share's, all-gathered or, with `ring`, passed around the ring
    (ring_attention.py; no attention dropout)."""
    if half_window is None and ring:
        if dropout_p > 0:
            raise ValueError("ring attention has no attention dropout (parallel.context_attention: ring)")
        def ring_plan():
            starts, ends = document_bounds(sample_ids, cache)
            return RingPlan.build(split, sample_ids, starts, ends, GLOBAL_BLOCK)
        planned = ring_plan() if cache is None else cache.get(sample_ids, ("cp-ring", split), ring_plan)
        return ring_attention(query, key, value, split, planned, scale=scale)
    if half_window is not None:
        def plan():
            starts, ends = document_bounds(sample_ids, cache)
            return NeighbourPlan.build(split, starts, ends, half_window, key.device)
        planned = plan() if cache is None else cache.get(sample_ids, ("cp-neighbours", split, half_window), plan)
        keys, values, layout = neighbours(key, split, planned), neighbours(value, split, planned), planned.layout
    else:
        keys, values = gather_row(key, split), gather_row(value, split)
        layout = KeyLayout.of(((0, split.tokens),))
    return blocked_attention(query, keys, values, sample_ids, layout, split, half_window=half_window,
                             dropout_p=dropout_p, scale=scale, cache=cache)
