"""Context parallelism (CP) for bidirectional encoder attention: one micro-batch's tokens split
over the ranks of a CP group, each rank computing the layers for its share only.

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

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..distributed import device
from .attention import _attend

# Query block of the global layers: memory [heads, block, span] per block in flight
GLOBAL_BLOCK = 512
LOCAL_BLOCK = 128


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its CP group (Parallel.cp_rank, cp_size, cp_group)."""

    rank: int
    size: int
    group: object = None

    def split(self, tokens: int) -> "ContextSplit":
        return ContextSplit.even(tokens, self.rank, self.size, self.group)


@dataclass(frozen=True)
class ContextSplit:
    """Rank `rank` of a CP group of `size` holds tokens [bounds[rank], bounds[rank + 1]) of the row."""

    bounds: tuple[int, ...]
    rank: int
    size: int
    group: object = None

    @classmethod
    def even(cls, tokens: int, rank: int, size: int, group=None) -> "ContextSplit":
        """Equal shares, the first tokens % size ranks one token more."""
        base, extra = divmod(tokens, size)
        bounds = [0]
        for r in range(size):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        return cls(tuple(bounds), rank, size, group)

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def shortest(self) -> int:
        return min(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    def local(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a full-row tensor (a view)."""
        return tensor.narrow(dim, self.start, self.end - self.start)


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


# ----------------------------------------------------------------------------- exchanges
class _Halo(torch.autograd.Function):
    """[left neighbour's last `width`; this rank's tokens; right neighbour's first `width`] along
    dim 0 (none beyond the group's ends); backward sends each halo's gradient back to its owner."""

    @staticmethod
    def forward(ctx, tensor, width: int, split: ContextSplit):
        left = split.rank - 1 if split.rank > 0 else None
        right = split.rank + 1 if split.rank < split.size - 1 else None
        ctx.width, ctx.split, ctx.left, ctx.right, ctx.length = width, split, left, right, tensor.shape[0]
        sends, receives = {}, {}
        if left is not None:
            sends[left] = tensor[:width]
            receives[left] = torch.empty((width, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        if right is not None:
            sends[right] = tensor[-width:]
            receives[right] = torch.empty((width, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        device.exchange(sends, receives, split.group)
        pieces = ([receives[left]] if left is not None else []) + [tensor] + \
            ([receives[right]] if right is not None else [])
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        width, left, right, length = ctx.width, ctx.left, ctx.right, ctx.length
        offset = width if left is not None else 0
        own = grad[offset:offset + length].clone()
        sends, receives = {}, {}
        if left is not None:
            sends[left] = grad[:width]
            receives[left] = torch.empty_like(own[:width])
        if right is not None:
            sends[right] = grad[offset + length:]
            receives[right] = torch.empty_like(own[:width])
        device.exchange(sends, receives, ctx.split.group)
        if left is not None:
            own[:width] += receives[left]
        if right is not None:
            own[-width:] += receives[right]
        return own, None, None


def halo(tensor: torch.Tensor, width: int, split: ContextSplit) -> torch.Tensor:
    """This rank's tokens (dim 0) with `width` tokens of each neighbour around them."""
    if split.size == 1 or width == 0:
        return tensor
    return _Halo.apply(tensor, width, split)


def gather_row(tensor: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The whole row (dim 0) from every rank's share, with gradients back to each share."""
    if split.size == 1:
        return tensor
    longest = max(b - a for a, b in zip(split.bounds[:-1], split.bounds[1:]))
    padded = torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, longest - tensor.shape[0]))
    gathered = device.all_gather_with_grad(padded, split.group)
    keep = torch.cat([torch.arange(r * longest, r * longest + b - a, device=tensor.device)
                      for r, (a, b) in enumerate(zip(split.bounds[:-1], split.bounds[1:]))])
    return gathered.index_select(0, keep)


def gather_masked(hidden: torch.Tensor, masked_positions: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The vectors [*masked_positions.shape, hidden] of the row's tokens at `masked_positions`
    (flat indices into the whole row) from every rank's share `hidden` [L, hidden]: each rank fills
    the positions it holds, a sum over the group completes them (its backward sums every rank's
    gradient, which the data-parallel averaging over context x data turns into the mean's)."""
    flat = masked_positions.reshape(-1)
    mine = (flat >= split.start) & (flat < split.end)
    local = (flat - split.start).clamp(0, hidden.shape[0] - 1)
    picked = hidden.index_select(0, local) * mine[:, None].to(hidden.dtype)
    return device.all_reduce_with_grad(picked, split.group).view(*masked_positions.shape, hidden.shape[-1])


# ----------------------------------------------------------------------------- attention
def blocked_attention(query, key, value, sample_ids, key_start: int, split: ContextSplit, *,
                      half_window: int | None, dropout_p: float = 0.0, scale: float | None = None,
                      block: int | None = None) -> torch.Tensor:
    """This rank's queries [L, heads, head_dim] (row tokens split.start ...) against keys and values
    [K, heads, head_dim] that hold row tokens key_start ... key_start + K, under the module's rule;
    `sample_ids` [T]: the whole row's. The context [L, heads, head_dim]."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    block = block or (GLOBAL_BLOCK if half_window is None else LOCAL_BLOCK)
    ids = sample_ids.reshape(-1)
    starts, ends = _document_bounds(ids)
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
                               dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """This rank's context [L, heads, head_dim] from its queries, keys and values [L, heads,
    head_dim] (rotary applied) and the row's sample ids [T]: the halo on local layers whose shares
    are at least the window's half, every share's keys otherwise (see the module docstring)."""
    if half_window is not None and split.shortest >= half_window:
        width = half_window if split.size > 1 else 0
        keys, values = halo(key, width, split), halo(value, width, split)
        key_start = split.start - (width if split.rank > 0 else 0)
    else:
        keys, values, key_start = gather_row(key, split), gather_row(value, split), 0
    return blocked_attention(query, keys, values, sample_ids, key_start, split, half_window=half_window,
                             dropout_p=dropout_p, scale=scale)
