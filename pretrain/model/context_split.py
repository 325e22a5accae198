"""How context parallelism (CP) splits a row of tokens over the ranks of a CP group, and the
exchanges between the shares, with their gradients: the halo of neighbouring shares, the whole row
gathered, the tokens at given positions gathered from whichever share holds them.
context_parallel.py builds ModernBERT's attention on them; BERT's layers (layers.py) use them too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import device


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
