"""Ring attention for the global layers under context parallelism (`parallel.context_attention:
ring`): instead of all-gathering every share's keys and values, each rank passes its keys and
values around the CP group, one hop per step, while it attends its queries to the share it holds
(the next share's transfer overlaps that computation). After `size` steps every query has seen
every key of its documents; the partial results are merged by their log-sum-exp (the online
softmax), so the context equals one process's attention.

What a rank keeps for backward is its own queries, keys, values, context and log-sum-exp, not the
whole row's keys and values: memory per rank falls with the CP size for the keys and values too.
Backward runs the ring again: each share's keys and values travel with the gradient accumulated
for them so far, and one last hop returns each share's gradient to its owner.

Each step attends the rank's query blocks (context_parallel.GLOBAL_BLOCK tokens within each run of
its share) to the keys of the held share that lie in the blocks' documents (a contiguous range
of that share: its positions are sorted), with the document mask. The arithmetic is spelled out
(no fused kernel returns the log-sum-exp through a public API), in at least float32; keys and
values travel in the model's dtype, their gradients in float32. Attention
dropout is not supported (ModernBERT trains without it; the config refuses it).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..distributed import device
from .context_split import ContextSplit


@dataclass(frozen=True)
class RingPlan:
    """Per micro-batch: each rank's share as sorted row positions and sample ids, and this rank's
    query blocks (share indices q0..q1 and the row span lo..hi of their documents)."""

    positions: tuple[list[int], ...]
    ids: tuple[torch.Tensor, ...]
    blocks: tuple[tuple[int, int, int, int], ...]
    longest: int

    @classmethod
    def build(cls, split: ContextSplit, sample_ids: torch.Tensor, starts: list[int], ends: list[int],
              block: int) -> "RingPlan":
        ids = sample_ids.reshape(-1)
        positions = tuple([p for a, b in runs for p in range(a, b)] for runs in split.runs)
        shares = tuple(ids.index_select(0, torch.tensor(p, dtype=torch.long, device=ids.device)) for p in positions)
        blocks, offset = [], 0
        for a, b in split.mine:
            for q0 in range(a, b, block):
                q1 = min(q0 + block, b)
                blocks.append((offset + q0 - a, offset + q1 - a, starts[q0], ends[q1 - 1]))
            offset += b - a
        return cls(positions, shares, tuple(blocks), max(len(p) for p in positions))

    def key_range(self, source: int, lo: int, hi: int) -> tuple[int, int]:
        """The indices in rank `source`'s share of its positions within [lo, hi)."""
        positions = self.positions[source]
        return bisect.bisect_left(positions, lo), bisect.bisect_left(positions, hi)


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, rows - tensor.shape[0]))


def _scores(q, k, allowed, scale):
    """Head-major q [h, Q, d] and k [h, K, d]: the masked scores [h, Q, K]."""
    return torch.matmul(q, k.transpose(1, 2)).mul_(scale).masked_fill_(~allowed[None], float("-inf"))


def _head_major(tensor: torch.Tensor, rows: int, dtype) -> torch.Tensor:
    """Token-major [L, h, d] as head-major [h, rows, d] in `dtype`, zero-padded to `rows`."""
    return _padded(tensor, rows).to(dtype).transpose(0, 1).contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, split: ContextSplit, plan: RingPlan, scale: float, overlap: bool):
        size, rank, group = split.size, split.rank, split.group
        acc = torch.promote_types(query.dtype, torch.float32)
        after, before = (rank + 1) % size, (rank - 1) % size
        mine_ids = plan.ids[rank]
        q_h = _head_major(query, query.shape[0], acc)
        out = torch.zeros(q_h.shape, dtype=acc, device=query.device)  # head-major
        lse = torch.full(q_h.shape[:2], float("-inf"), dtype=acc, device=query.device)
        held = torch.stack([_head_major(key, plan.longest, key.dtype), _head_major(value, plan.longest, key.dtype)])
        for step in range(size):
            source = (rank - step) % size
            transfer, incoming = None, None
            if step < size - 1:
                incoming = torch.empty_like(held)
                transfer = device.start_exchange([(after, held)], [(before, incoming)], group)
                if not overlap:
                    transfer.wait()
            for q0, q1, lo, hi in plan.blocks:
                k0, k1 = plan.key_range(source, lo, hi)
                if k0 == k1:
                    continue
                allowed = mine_ids[q0:q1, None] == plan.ids[source][None, k0:k1]
                scores = _scores(q_h[:, q0:q1], held[0, :, k0:k1].to(acc), allowed, scale)
                part_lse = torch.logsumexp(scores, -1)  # [heads, q]; -inf where no key of this share
                finite = torch.isfinite(part_lse)
                probs = scores.sub_(torch.where(finite, part_lse, 0)[..., None]).exp_()
                part = torch.matmul(probs, held[1, :, k0:k1].to(acc))
                merged = torch.logaddexp(lse[:, q0:q1], part_lse)
                safe = torch.where(torch.isfinite(merged), merged, 0)
                keep = torch.exp(lse[:, q0:q1] - safe)[..., None]
                add = torch.exp(part_lse - safe)[..., None]
                out[:, q0:q1] = out[:, q0:q1] * keep + part * add
                lse[:, q0:q1] = merged
            if transfer is not None:
                transfer.wait()
                held = incoming
        result = out.transpose(0, 1).to(query.dtype)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.split, ctx.plan, ctx.scale, ctx.overlap = split, plan, scale, overlap
        return result

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        split, plan, scale = ctx.split, ctx.plan, ctx.scale
        size, rank, group = split.size, split.rank, split.group
        acc = lse.dtype
        after, before = (rank + 1) % size, (rank - 1) % size
        mine_ids = plan.ids[rank]
        rows = query.shape[0]
        g_h, q_h = _head_major(grad, rows, acc), _head_major(query, rows, acc)
        delta = (g_h * _head_major(out, rows, acc)).sum(-1)  # [heads, q]: rowsum(dO * O)
        dq = torch.zeros(q_h.shape, dtype=acc, device=query.device)
        held = torch.stack([_head_major(key, plan.longest, key.dtype), _head_major(value, plan.longest, key.dtype)])
        sent_grad = None  # the gradient for the keys held at the previous step, passed on with them
        for step in range(size):
            source = (rank - step) % size
            sends, receives, incoming, arriving = [], [], None, None
            if step < size - 1:
                incoming = torch.empty_like(held)
                sends.append((after, held))
                receives.append((before, incoming))
            if step > 0:
                arriving = torch.empty_like(held, dtype=acc)
                sends.append((after, sent_grad))
                receives.append((before, arriving))
            transfer = device.start_exchange(sends, receives, group)
            if not ctx.overlap:
                transfer.wait()
            local = torch.zeros_like(held, dtype=acc)
            for q0, q1, lo, hi in plan.blocks:
                k0, k1 = plan.key_range(source, lo, hi)
                if k0 == k1:
                    continue
                allowed = mine_ids[q0:q1, None] == plan.ids[source][None, k0:k1]
                k, v, q, g = held[0, :, k0:k1].to(acc), held[1, :, k0:k1].to(acc), q_h[:, q0:q1], g_h[:, q0:q1]
                probs = _scores(q, k, allowed, scale).sub_(lse[:, q0:q1, None]).exp_()
                local[1, :, k0:k1] += torch.matmul(probs.transpose(1, 2), g)
                dscores = probs.mul_(torch.matmul(g, v.transpose(1, 2)).sub_(delta[:, q0:q1, None])).mul_(scale)
                dq[:, q0:q1] += torch.matmul(dscores, k)
                local[0, :, k0:k1] += torch.matmul(dscores.transpose(1, 2), q)
            transfer.wait()
            sent_grad = local if arriving is None else local + arriving
            if incoming is not None:
                held = incoming
        # the last hop: each share's complete gradient to its owner
        own = sent_grad
        if size > 1:
            own = torch.empty_like(sent_grad)
            device.start_exchange([(after, sent_grad)], [(before, own)], group).wait()
        keys = key.shape[0]
        return (dq.transpose(0, 1).to(query.dtype), own[0, :, :keys].transpose(0, 1).to(key.dtype),
                own[1, :, :keys].transpose(0, 1).to(value.dtype), None, None, None, None)


def ring_attention(query, key, value, split: ContextSplit, plan: RingPlan, *, scale: float | None = None,
                   overlap: bool = True) -> torch.Tensor:
    """This rank's context [L, heads, head_dim] of a global layer from its queries, keys and values
    [L, heads, head_dim] (rotary applied): every share's keys passed around the ring. `overlap`
    False waits for each transfer before computing (the benchmark's measure of the overlap)."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if split.size == 1:
        overlap = False
    return _RingAttention.apply(query, key, value, split, plan, scale, overlap)
