"""How context parallelism (CP) splits a row of tokens over the ranks of a CP group, and the
exchanges between the shares, with their gradients: the keys a rank's local-window queries reach
in other shares, the whole row gathered, the tokens at given positions gathered from whichever
share holds them. context_parallel.py builds ModernBERT's attention on them; BERT's layers
(layers.py) use them too.

Two splits:

- `ContextSplit.even`: contiguous equal shares (BERT's columns).
- `ContextSplit.balanced` (ModernBERT's packed row): equal shares of tokens *and* of the global
  layers' work. A query of a global layer costs its document's length, so a contiguous split of a
  row with one long document and many short ones gives the rank holding the long one many times
  the work of the others. Balanced, each document of at least size x min_piece tokens is cut into
  `size` contiguous pieces, piece r on rank r (each rank then holds 1/size of its queries); the
  short documents, in row order, fill what each rank's quota of tokens leaves, contiguously.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import torch

from ..distributed import device

Intervals = tuple[tuple[int, int], ...]  # sorted, disjoint, non-empty [start, end) of row positions


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place in its CP group (Parallel.cp_rank, cp_size, cp_group)."""

    rank: int
    size: int
    group: object = None
    ring: bool = False  # global layers pass keys around the ring (ring_attention.py) instead of gathering

    def split(self, tokens: int) -> "ContextSplit":
        """Contiguous equal shares of a row of `tokens`."""
        return ContextSplit.even(tokens, self.rank, self.size, self.group)

    def balanced(self, sample_ids: torch.Tensor, min_piece: int) -> "ContextSplit":
        """Equal shares of tokens and of global-attention work (see the module docstring)."""
        return ContextSplit.balanced(sample_ids, self.rank, self.size, self.group, min_piece)


@dataclass(frozen=True)
class ContextSplit:
    """Rank r of a CP group of `size` holds the row positions `runs[r]` (sorted intervals); its
    share of a row tensor is those positions in row order."""

    runs: tuple[Intervals, ...]
    rank: int
    size: int
    group: object = None

    @classmethod
    def even(cls, tokens: int, rank: int, size: int, group=None) -> "ContextSplit":
        """Equal contiguous shares, the first tokens % size ranks one token more."""
        base, extra = divmod(tokens, size)
        runs, start = [], 0
        for r in range(size):
            end = start + base + (1 if r < extra else 0)
            runs.append(((start, end),) if end > start else ())
            start = end
        return cls(tuple(runs), rank, size, group)

    @classmethod
    def balanced(cls, sample_ids: torch.Tensor, rank: int, size: int, group=None,
                 min_piece: int = 1) -> "ContextSplit":
        """Each document of at least size x min_piece tokens cut into `size` pieces (lengths at most
        one apart, the longer pieces rotating over the ranks), piece r to rank r; the shorter
        documents, in row order, cut contiguously into what each rank's quota of tokens leaves.
        Shares are equal to one token; with min_piece at least a local window's half, a cut
        document's halo comes from the neighbouring ranks only."""
        _, counts = torch.unique_consecutive(sample_ids.reshape(-1), return_counts=True)
        lengths = counts.tolist()
        total = sum(lengths)
        quota = [total // size + (1 if r < total % size else 0) for r in range(size)]
        runs: list[list[tuple[int, int]]] = [[] for _ in range(size)]
        held, short, start, turn = [0] * size, [], 0, 0
        for length in lengths:
            if size > 1 and length >= size * max(min_piece, 1):
                base, extra = divmod(length, size)
                at = start
                for r in range(size):
                    n = base + (1 if (r - turn) % size < extra else 0)
                    runs[r].append((at, at + n))
                    held[r] += n
                    at += n
                turn = (turn + extra) % size
            else:
                short.append((start, start + length))
            start += length
        # the short documents as one stream, each rank taking the next (quota - held) tokens of it
        pieces = iter(short)
        piece = next(pieces, None)
        for r in range(size):
            want = quota[r] - held[r]  # >= 0: the pieces' extra tokens rotate in the quota's order
            while want > 0 and piece is not None:
                a, b = piece
                take = min(want, b - a)
                runs[r].append((a, a + take))
                want -= take
                piece = (a + take, b) if a + take < b else next(pieces, None)
        return cls(tuple(_merge(r) for r in runs), rank, size, group)

    # ------------------------------------------------------------------------- this rank's share
    @property
    def mine(self) -> Intervals:
        return self.runs[self.rank]

    def share(self, rank: int | None = None) -> int:
        """Tokens held by `rank` (this rank by default)."""
        return sum(b - a for a, b in self.runs[self.rank if rank is None else rank])

    @property
    def tokens(self) -> int:
        return sum(self.share(r) for r in range(self.size))

    @property
    def start(self) -> int:
        """First row position of a contiguous share (even splits)."""
        return self._contiguous()[0]

    @property
    def end(self) -> int:
        return self._contiguous()[1]

    def _contiguous(self) -> tuple[int, int]:
        if len(self.mine) > 1:
            raise ValueError(f"CP rank {self.rank} holds {len(self.mine)} runs of the row, not one")
        return self.mine[0] if self.mine else (0, 0)

    def local(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a full-row tensor (a view when they are one run)."""
        pieces = [tensor.narrow(dim, a, b - a) for a, b in self.mine]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat(pieces, dim) if pieces else tensor.narrow(dim, 0, 0)

    def placement(self, on: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row position: the rank holding it, and its index in that rank's share ([T] each, on
        `on`; copied there once per split, which the model builds once per micro-batch)."""
        key = str(on)
        if key not in self._placements:
            self._placements[key] = tuple(t.to(on) for t in self._placement())
        return self._placements[key]

    @cached_property
    def _placements(self) -> dict:
        return {}

    def _placement(self) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.empty(self.tokens, dtype=torch.long)
        index = torch.empty(self.tokens, dtype=torch.long)
        for r, runs in enumerate(self.runs):
            offset = 0
            for a, b in runs:
                owner[a:b] = r
                index[a:b] = torch.arange(offset, offset + b - a)
                offset += b - a
        return owner, index

    def local_indices(self, intervals: Intervals, rank: int | None = None) -> torch.Tensor:
        """The indices in `rank`'s share (this rank's by default) of the row positions `intervals`, which it holds."""
        runs = self.runs[self.rank if rank is None else rank]
        offsets = [0]
        for a, b in runs:
            offsets.append(offsets[-1] + b - a)
        pieces = []
        for x, y in intervals:
            i = bisect.bisect_right([a for a, _ in runs], x) - 1
            a, b = runs[i]
            assert a <= x and y <= b, (x, y, runs)
            pieces.append(torch.arange(offsets[i] + x - a, offsets[i] + y - a))
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


# ----------------------------------------------------------------------------- interval sets
def _merge(intervals) -> Intervals:
    out: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _intersect(first: Intervals, second: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        a, b = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if a < b:
            out.append((a, b))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _subtract(first: Intervals, second: Intervals) -> Intervals:
    out = []
    for a, b in first:
        for x, y in second:
            if y <= a or x >= b:
                continue
            if x > a:
                out.append((a, x))
            a = max(a, y)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return tuple(out)


def _count(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


def _positions(intervals: Intervals) -> torch.Tensor:
    pieces = [torch.arange(a, b) for a, b in intervals]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class KeyLayout:
    """Where row positions sit in a buffer of keys: disjoint (row_start, row_end, buffer_start)
    spans in row order. A span of positions the attention reads lies within one of them."""

    spans: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, intervals: Intervals) -> "KeyLayout":
        spans, at = [], 0
        for a, b in intervals:
            spans.append((a, b, at))
            at += b - a
        return cls(tuple(spans))

    @cached_property
    def _starts(self) -> list[int]:
        return [a for a, _, _ in self.spans]

    def locate(self, lo: int, hi: int) -> int:
        """The buffer index of row position lo, the positions [lo, hi) following it."""
        i = bisect.bisect_right(self._starts, lo) - 1
        a, b, at = self.spans[i]
        assert a <= lo and hi <= b, (lo, hi, self.spans[i])
        return at + lo - a


# ----------------------------------------------------------------------------- exchanges
@dataclass(frozen=True)
class NeighbourPlan:
    """What a rank's local-window queries reach outside its share: the positions it receives from
    each peer and sends to each, the buffer's layout (its share and what it receives, in row order)
    and `order`, the permutation of [share; received by peer] into that layout."""

    sends: dict
    receives: dict
    layout: KeyLayout
    order: torch.Tensor
    send_index: dict  # peer -> the indices in this rank's share of what it sends there (on the model's device)

    @classmethod
    def build(cls, split: ContextSplit, starts: list[int], ends: list[int], width: int,
              on: torch.device | None = None) -> "NeighbourPlan":
        """`starts`/`ends`: per row position, its document's first and one-past-last positions;
        the plan's index tensors are made on `on` (the CPU by default)."""
        def needed(r: int) -> Intervals:
            reach = []
            for a, b in split.runs[r]:
                reach += [(max(starts[a], a - width), a), (b, min(ends[b - 1], b + width))]
            return _subtract(_merge(reach), split.runs[r])

        wanted = needed(split.rank)
        peers = [s for s in range(split.size) if s != split.rank]
        receives = {s: iv for s in peers if (iv := _intersect(wanted, split.runs[s]))}
        sends = {s: iv for s in peers if (iv := _intersect(needed(s), split.mine))}
        positions = torch.cat([_positions(split.mine), *(_positions(receives[s]) for s in sorted(receives))])
        order = torch.argsort(positions, stable=True).to(on)
        send_index = {s: split.local_indices(iv).to(on) for s, iv in sends.items()}
        return cls(sends, receives, KeyLayout.of(_merge(split.mine + wanted)), order, send_index)


class _Exchange(torch.autograd.Function):
    """[this rank's share; the positions received from each peer (in peer order)] along dim 0;
    backward sends each received position's gradient back to its owner, which adds it."""

    @staticmethod
    def forward(ctx, tensor, split: ContextSplit, plan: NeighbourPlan):
        index = {s: i.to(tensor.device) for s, i in plan.send_index.items()}
        sends = {s: tensor.index_select(0, i) for s, i in index.items()}
        receives = {s: tensor.new_empty((_count(iv), *tensor.shape[1:])) for s, iv in plan.receives.items()}
        device.exchange(sends, receives, split.group)
        ctx.index, ctx.plan, ctx.group, ctx.length = index, plan, split.group, tensor.shape[0]
        return torch.cat([tensor, *(receives[s] for s in sorted(receives))])

    @staticmethod
    def backward(ctx, grad):
        own = grad[:ctx.length].clone()
        sends, at = {}, ctx.length
        for s in sorted(ctx.plan.receives):
            n = _count(ctx.plan.receives[s])
            sends[s], at = grad[at:at + n], at + n
        receives = {s: own.new_empty((i.numel(), *own.shape[1:])) for s, i in ctx.index.items()}
        device.exchange(sends, receives, ctx.group)
        for s, i in ctx.index.items():
            own.index_add_(0, i, receives[s])
        return own, None, None


def neighbours(tensor: torch.Tensor, split: ContextSplit, plan: NeighbourPlan) -> torch.Tensor:
    """This rank's share (dim 0) with the positions its plan receives, in row order (plan.layout)."""
    if not plan.sends and not plan.receives:
        return tensor
    return _Exchange.apply(tensor, split, plan).index_select(0, plan.order.to(tensor.device))


def gather_row(tensor: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The whole row (dim 0) from every rank's share, in row order, with gradients back to each share."""
    if split.size == 1:
        return tensor
    longest = max(split.share(r) for r in range(split.size))
    padded = torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, longest - tensor.shape[0]))
    gathered = device.all_gather_with_grad(padded, split.group)
    owner, index = split.placement(tensor.device)
    return gathered.index_select(0, owner * longest + index)


def gather_masked(hidden: torch.Tensor, masked_positions: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The vectors [*masked_positions.shape, hidden] of the row's tokens at `masked_positions`
    (flat indices into the whole row) from every rank's share `hidden` [L, hidden]: each rank fills
    the positions it holds, a sum over the group completes them (its backward sums every rank's
    gradient, which the data-parallel averaging over context x data turns into the mean's)."""
    flat = masked_positions.reshape(-1)
    owner, index = split.placement(hidden.device)
    mine = owner.index_select(0, flat) == split.rank
    local = index.index_select(0, flat).clamp(0, max(hidden.shape[0] - 1, 0))
    picked = hidden.index_select(0, local) * mine[:, None].to(hidden.dtype)
    return device.all_reduce_with_grad(picked, split.group).view(*masked_positions.shape, hidden.shape[-1])
