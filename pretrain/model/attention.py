"""The attention core of the encoders (ModernBERT's global or sliding-window layers, BERT's global
ones): over packed rows.

The model computes real tokens only (unpadding.py): what reaches attention is packed rows, a
document number per token (`sample_ids`; 0 = padding, which the model's own rows never hold).
Semantics (transformers' ModernBertForMaskedLM, per document; masking_utils'
sliding_window_bidirectional_overlay): query i may attend key j when j has i's number, and
|i - j| <= half_window on a local layer. Padding attends padding only, so every query reaches at
least itself: no row is fully masked and nothing is NaN.

No path builds a dense [seq x seq] mask per layer unless it was measured faster at that size
(short rows; tools/benchmarks/attention.py holds the measurements, `choose_path` the outcome):

- "banded": local layers. Query blocks of BAND_BLOCK tokens attend the key band [block start -
  half_window, block end + half_window) only, a strided view of the keys; the window and the
  document/padding rule become a [block, block + 2 half_window] mask per block. Memory and work
  O(seq (block + 2 half_window)) instead of O(seq^2).
- "documents": global layers. The tokens of each document are gathered into
  [documents, heads, length, head_dim] batches, documents of similar length together (lengths
  rounded up a ladder of 1x and 1.5x powers of two: at most 2.25x the work of exact lengths, a
  handful of SDPA calls), and attend within themselves: O(sum of squared document lengths).
- "dense": SDPA with the full additive [batch, 1, seq, seq] mask: local layers whose band would
  be no narrower than the row (seq <= BAND_BLOCK + 2 half_window), global rows up to
  DENSE_DOCUMENTS_MAX_SEQ tokens; there it was measured faster.

Attention dropout: off CUDA, each path spells its softmax out and draws the keep mask with
`dropout.dropout` (SDPA's CPU dropout has its own draw); the probabilities then exist in full,
[block, block + 2 half_window] per block on the banded path, [seq, keys] on the global ones.

The models (modernbert.py, and layers.py's BERT outside context parallelism) call
`packed_attention` with one packed row per micro-batch, token-major. Each path's masks and plans (the dense and banded masks, the documents' gather plan)
are a function of the sample ids alone: with a `MicroBatchCache` they
are built once per micro-batch and shared by every layer and recomputation.

On CUDA without attention dropout, one of two kernels (model.attention_kernel, `cuda_kernel`):
torch's variable-length flash attention (`varlen_attn`: each document a sequence of cu_seqlens,
the window as (half_window, half_window); bf16/fp16, torch >= 2.10), or FlexAttention with a
BlockMask of the same rule, compiled with dynamic shapes, the BlockMask built once per micro-batch
and window. Checked by the GPU tier (tests/test_attention_kernels.py); on the CPU, our side of
each against the reference (varlen with a stand-in kernel, FlexAttention's mask uncompiled). With
dropout, CUDA takes the paths above with SDPA's own dropout.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config.choices import ATTENTION_KERNELS
from .cpu_bf16 import upcast_bf16
from .dropout import dropout as _dropout
from .micro_batch import MicroBatchCache

# Query block of the banded path. Measured (tools/benchmarks/attention.py, BERT-tiny width,
# half_window 64, 8,192 tokens): 64 and 128 equally fast at every length, 128 with less memory
# (its key band copies are 2x the keys, not 3x); 256 slower.
BAND_BLOCK = 128
# Packed global rows up to this length take the dense mask: there the per-document gathers cost
# more than the cross-document work they save (measured: dense 16 ms against 22 at seq 128,
# 21 against 26 at 256; documents ahead from 512, 2x at 1,024, 7x at 8,192).
DENSE_DOCUMENTS_MAX_SEQ = 256

PATHS = ("dense", "banded", "documents")


def encoder_attention(query, key, value, sample_ids, *, half_window=None, dropout_p=0.0, scale=None,
                      cache: MicroBatchCache | None = None) -> torch.Tensor:
    """softmax(q k^T scale + mask) v over [batch, heads, seq, head_dim] (already rotary-embedded),
    the context in the same shape and dtype; see the module docstring for which key each query
    may attend (`sample_ids` [batch, seq] integers); half_window None for a global layer; dropout
    on the probabilities when dropout_p > 0 (on CPU `dropout.dropout` draws the keep mask from the
    default generator, so the RNG tracker's forks govern it); scale defaults to head_dim ** -0.5.
    With `cache`, the masks and plans derived from the sample ids are built once per micro-batch
    and shared by every layer that passes the same tensor (micro_batch.py)."""
    if half_window is not None and half_window < 0:
        raise ValueError(f"half_window must be >= 0 (or None for global attention), got {half_window}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if upcast_bf16(query):
        # bf16 batched products are slower than fp32 ones on this CPU: attend in fp32, as
        # layers.self_attention does, and hand back bf16
        return encoder_attention(query.float(), key.float(), value.float(), sample_ids, half_window=half_window,
                                 dropout_p=dropout_p, scale=scale, cache=cache).to(query.dtype)
    seq = query.shape[2]
    if half_window is not None and half_window >= seq - 1:
        half_window = None  # the window holds the whole row: the same as global attention
    if query.device.type == "cuda" and dropout_p == 0.0:
        return _flex_attention(query, key, value, sample_ids, half_window, scale, cache)
    return run_path(choose_path(seq, half_window), query, key, value, sample_ids, half_window=half_window,
                    dropout_p=dropout_p, scale=scale, cache=cache)


def choose_path(seq: int, half_window: int | None) -> str:
    """The path encoder_attention takes off CUDA (or on CUDA with dropout): the fastest measured for
    the case (tools/benchmarks/attention.py), a pure function of the shapes so that a recomputed
    forward takes the same one (and draws the same dropout masks)."""
    if half_window is not None:
        # the band is BAND_BLOCK + 2 half_window keys wide: no narrower than the row, it does the
        # dense path's work with more copying (measured at half_window 64: dense 2x faster up to
        # seq 256, banded ahead from 512, 30x at 8,192)
        return "dense" if seq <= BAND_BLOCK + 2 * half_window else "banded"
    return "dense" if seq <= DENSE_DOCUMENTS_MAX_SEQ else "documents"


def run_path(path: str, query, key, value, sample_ids, *, half_window=None, dropout_p=0.0, scale=None,
             block: int | None = None, cache: MicroBatchCache | None = None) -> torch.Tensor:
    """One named path (the benchmark and the tests call each; encoder_attention calls the chosen);
    `block`: the banded path's query block (default BAND_BLOCK); `cache`: see encoder_attention."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if path == "dense":
        def dense_bias():
            allowed = _dense_allowed(sample_ids, half_window, query.shape[2])[:, None]
            return torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill_(~allowed,
                                                                                                    float("-inf"))
        bias = _shared(cache, sample_ids, ("dense", half_window, query.dtype), dense_bias)
        return _attend(query, key, value, bias, dropout_p, scale)
    if path == "banded":
        if half_window is None:
            raise ValueError("the banded path is for local layers (half_window set)")
        return _banded(query, key, value, sample_ids, half_window, dropout_p, scale, block, cache)
    if path == "documents":
        if half_window is not None:
            raise ValueError("the documents path is for global layers")
        plan = _shared(cache, sample_ids, "documents", lambda: _document_plan(sample_ids))
        return _documents(query, key, value, plan, dropout_p, scale)
    raise ValueError(f"unknown attention path {path!r}: one of {', '.join(PATHS)}")


def _shared(cache: MicroBatchCache | None, mask: torch.Tensor, name, build):
    """build(), or the value the cache holds for this micro-batch's `mask` and `name`."""
    return build() if cache is None else cache.get(mask, name, build)


def _attend(query, key, value, mask, dropout_p: float, scale: float) -> torch.Tensor:
    """softmax(q k^T scale + mask) v for a boolean (True = attend) or additive float mask that leaves
    every query at least one key (None: every key). SDPA (fused kernels) unless dropout runs off
    CUDA: then the same arithmetic spelled out, with `dropout.dropout`'s mask from the default generator."""
    if dropout_p == 0.0 or query.device.type == "cuda":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(_dropout(probs, dropout_p, True), value)


def _near(rows: int, cols: int, offset: int, half_window: int | None, device) -> torch.Tensor:
    """[rows, cols] True where |(col - offset) - row| <= half_window (all True without a window)."""
    if half_window is None:
        return torch.ones(rows, cols, dtype=torch.bool, device=device)
    distance = torch.arange(cols, device=device)[None, :] - offset - torch.arange(rows, device=device)[:, None]
    return distance.abs() <= half_window


def _dense_allowed(sample_ids, half_window, seq: int) -> torch.Tensor:
    """The [batch, seq, seq] boolean mask of the module docstring's rule."""
    near = _near(seq, seq, 0, half_window, sample_ids.device)
    return (sample_ids[:, :, None] == sample_ids[:, None, :]) & near


def _banded(query, key, value, sample_ids, half_window: int, dropout_p: float, scale: float,
            block: int | None = None, cache: MicroBatchCache | None = None) -> torch.Tensor:
    """Local attention by query blocks: block n (queries [nC, nC + C)) attends the keys
    [nC - w, nC + C + w) only, an unfold view of the keys padded by w on both sides. Query c of
    the block sits at nC + c and band entry j at nC - w + j: their distance j - w - c is within
    +-w iff c <= j <= c + 2w, whatever the block, so one [C, C + 2w] window mask serves all."""
    block = block or BAND_BLOCK
    batch, heads, seq, dim = query.shape
    w, device = half_window, query.device
    blocks = -(-seq // block)
    tail = blocks * block - seq
    width = block + 2 * w
    q = (F.pad(query, (0, 0, 0, tail)) if tail else query).reshape(batch, heads, blocks, block, dim)
    k = F.pad(key, (0, 0, w, tail + w)).unfold(2, width, block)  # [batch, heads, blocks, dim, width], a view
    v = F.pad(value, (0, 0, w, tail + w)).unfold(2, width, block)
    # allowed: [batch, blocks, block, width], the same for every head
    allowed = _shared(cache, sample_ids, ("banded", w, block), lambda: _banded_allowed(sample_ids, w, block, blocks, tail))
    if dropout_p == 0.0 or device.type == "cuda":
        # SDPA takes 4-d operands: (row, block) pairs as its batch, so that one additive mask per
        # pair serves all heads (a broadcast, not a copy per head)
        bias = _shared(cache, sample_ids, ("banded-bias", w, block, query.dtype), lambda: torch.zeros(
            allowed.shape, dtype=query.dtype, device=device).masked_fill_(~allowed, float("-inf")))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).reshape(batch * blocks, heads, block, dim),
            k.permute(0, 2, 1, 4, 3).reshape(batch * blocks, heads, width, dim),
            v.permute(0, 2, 1, 4, 3).reshape(batch * blocks, heads, width, dim),
            attn_mask=bias.view(batch * blocks, 1, block, width), dropout_p=dropout_p, scale=scale)
        out = out.view(batch, blocks, heads, block, dim).transpose(1, 2)
    else:
        scores = torch.matmul(q, k).mul_(scale).masked_fill_(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(_dropout(probs, dropout_p, True), v.transpose(-1, -2))
    return out.reshape(batch, heads, blocks * block, dim)[:, :, :seq]


def _banded_allowed(sample_ids, w: int, block: int, blocks: int, tail: int) -> torch.Tensor:
    """The banded path's [batch, blocks, block, block + 2w] mask: who in a query block sees whom in its band."""
    batch, width = sample_ids.shape[0], block + 2 * w
    near = _near(block, width, w, w, sample_ids.device)
    # alignment padding gets number -1: it meets only itself (the extra queries attend their own
    # zero key and are cut off), never a real document or the row's padding
    key_ids = F.pad(sample_ids, (w, tail + w), value=-1).unfold(1, width, block)
    query_ids = F.pad(sample_ids, (0, tail), value=-1).view(batch, blocks, block)
    return (query_ids[..., :, None] == key_ids[..., None, :]) & near


def _ladder(length: int) -> int:
    """The bucket a document of `length` tokens is padded to: the next of 8, 12, 16, 24, 32, 48, ..."""
    size = 8
    while size < length:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _document_plan(sample_ids: torch.Tensor) -> dict:
    """Which token goes to which slot of which bucket on the documents path (a function of the
    sample ids alone: built once per micro-batch with a cache)."""
    batch, seq = sample_ids.shape
    device = sample_ids.device
    span = int(sample_ids.max()) + 1
    document = (torch.arange(batch, device=device)[:, None] * span + sample_ids).reshape(-1)
    order = torch.argsort(document, stable=True)  # tokens grouped by document, in position order
    lengths = torch.unique_consecutive(document[order], return_counts=True)[1]
    starts = lengths.cumsum(0) - lengths
    buckets = torch.tensor([_ladder(n) for n in lengths.tolist()], device=device)
    plans, sources, valids = [], [], []
    for size in sorted(set(buckets.tolist())):
        chosen = (buckets == size).nonzero().squeeze(1)
        slot = torch.arange(size, device=device)
        valid = slot[None, :] < lengths[chosen][:, None]  # [documents, size]
        # spare slots read some token (clamped in range): masked as keys, dropped as queries, so
        # they contribute nothing, gradients included
        source = order[(starts[chosen][:, None] + slot[None, :]).clamp_(max=batch * seq - 1)]
        plans.append((chosen.numel(), size, valid))
        sources.append(source.reshape(-1))
        valids.append(valid.reshape(-1))
    source, valid = torch.cat(sources), torch.cat(valids)
    slot_of_token = torch.empty(batch * seq, dtype=torch.long, device=device)
    slot_of_token[source[valid]] = valid.nonzero().squeeze(1)
    # buckets whose documents fill every slot (documents of exactly a ladder length, as full rows
    # are) need no mask: SDPA then keeps its fastest kernels (CUDA's flash attention, dropout too)
    full = [bool(v) for v in torch.stack([plan[2].all() for plan in plans]).tolist()]
    return {"buckets": [(*plan, is_full) for plan, is_full in zip(plans, full)], "source": source,
            "slot_of_token": slot_of_token, "biases": {}}


def _documents(query, key, value, plan: dict, dropout_p: float, scale: float) -> torch.Tensor:
    """Global attention of packed rows, one document at a time, the documents of a bucket batched
    (`plan`: _document_plan's): the tokens of each (row, number) are gathered in order into slots
    of the bucket's length (the spare slots masked as keys, their outputs dropped), attended, and
    put back. One index_select per operand and one for the output, whatever the number of buckets:
    each one's backward zero-fills its whole source, and index_select's (index_add) is several
    times faster on the CPU than advanced indexing's (index_put with accumulation). Documents need
    not be contiguous."""
    batch, heads, seq, dim = query.shape
    device = query.device
    slots = [count * size for count, size, *_ in plan["buckets"]]
    gathered = [t.transpose(1, 2).reshape(batch * seq, heads, dim).index_select(0, plan["source"]).split(slots)
                for t in (query, key, value)]
    biases = plan["biases"].setdefault(query.dtype, {})
    outputs = []
    for (count, size, valid_slots, full), q, k, v in zip(plan["buckets"], *gathered):
        q, k, v = (t.view(count, size, heads, dim).transpose(1, 2) for t in (q, k, v))
        if size not in biases:
            bias = None if full else torch.zeros(valid_slots.shape, dtype=query.dtype, device=device)
            biases[size] = None if full else bias.masked_fill_(~valid_slots, float("-inf"))[:, None, None, :]
        outputs.append(_attend(q, k, v, biases[size], dropout_p, scale).transpose(1, 2).reshape(count * size, heads, dim))
    return torch.cat(outputs).index_select(0, plan["slot_of_token"]).view(batch, seq, heads, dim).transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# CUDA kernels (GPU tier; not runnable on the development machines)

KERNELS = ATTENTION_KERNELS


def varlen_available() -> bool:
    """Whether this torch has variable-length flash attention with a window (torch >= 2.10's
    torch.nn.attention.varlen.varlen_attn taking window_size)."""
    return _varlen_attn() is not None


@functools.cache
def _varlen_attn():
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def cuda_kernel(requested: str, dtype: torch.dtype) -> str:
    """The kernel packed attention runs on CUDA without dropout: `requested` ("auto": varlen where
    torch has it and the dtype is one flash attention takes, FlexAttention otherwise). An explicit
    "varlen" that cannot run is an error, not a silent fallback."""
    if requested not in KERNELS:
        raise ValueError(f"unknown attention kernel {requested!r}: one of {', '.join(KERNELS)}")
    varlen_ok = varlen_available() and dtype in (torch.bfloat16, torch.float16)
    if requested == "varlen" and not varlen_ok:
        why = ("this torch has no torch.nn.attention.varlen.varlen_attn with window_size (torch >= 2.10)"
               if not varlen_available() else f"flash attention takes bf16 or fp16, not {dtype}")
        raise ValueError(f"model.attention_kernel=varlen cannot run: {why}")
    if requested == "flex" or not varlen_ok:
        return "flex"
    return "varlen"


def packed_attention(query, key, value, sample_ids, *, half_window=None, dropout_p=0.0, scale=None,
                     cache: MicroBatchCache | None = None, kernel: str = "auto") -> torch.Tensor:
    """encoder_attention for the model's packed rows, token-major: query, key and value [rows, seq,
    heads, head_dim] (the projection's layout, rotary applied), the context in the same layout. On
    CUDA without dropout one of the `KERNELS` (`cuda_kernel`) with its per-micro-batch inputs from
    `cache`; elsewhere the paths above, head-major."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    seq = query.shape[1]
    if half_window is not None and half_window >= seq - 1:
        half_window = None
    if query.device.type == "cuda" and dropout_p == 0.0:
        if cuda_kernel(kernel, query.dtype) == "varlen":
            return _varlen(query, key, value, sample_ids, half_window, scale, cache)
        heads_major = [t.transpose(1, 2) for t in (query, key, value)]
        return _flex_attention(*heads_major, sample_ids, half_window, scale, cache).transpose(1, 2)
    out = encoder_attention(*(t.transpose(1, 2) for t in (query, key, value)), sample_ids,
                            half_window=half_window, dropout_p=dropout_p, scale=scale, cache=cache)
    return out.transpose(1, 2)


def document_bounds(sample_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens [documents + 1] int32, the longest document) of packed rows: a document is a run
    of equal sample ids within a row (a row's trailing padding is one too: padding attends padding
    only, as the other paths have it), so documents must be contiguous, as the model's always are
    (unpadding.py). One host read (the longest length)."""
    rows, seq = sample_ids.shape
    flat = sample_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts.view(rows, seq)[:, 0] = True
    begin = starts.nonzero().squeeze(1)
    bounds = torch.cat([begin, begin.new_full((1,), flat.numel())])
    return bounds.to(torch.int32), int((bounds[1:] - bounds[:-1]).max())


def _varlen(query, key, value, sample_ids, half_window, scale, cache) -> torch.Tensor:
    """torch's variable-length flash attention over the documents of the flattened rows; a window
    of half_window keys on either side ((left, right) = (w, w)) within the document."""
    rows, seq, heads, dim = query.shape
    bounds, longest = _shared(cache, sample_ids, "document-bounds", lambda: document_bounds(sample_ids))
    window = (-1, -1) if half_window is None else (half_window, half_window)
    flat = [t.reshape(rows * seq, heads, dim) for t in (query, key, value)]
    out = _varlen_attn()(*flat, bounds, bounds, longest, longest, scale=scale, window_size=window)
    return out.view(rows, seq, heads, dim)


@functools.cache
def _compiled_flex():
    """flex_attention and create_block_mask, compiled once per process with dynamic shapes (the
    rows' length varies between micro-batches: one compilation serves them all). Uncompiled,
    flex_attention runs a reference that materialises the scores, and create_block_mask the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention, dynamic=True), torch.compile(create_block_mask, dynamic=True)


def _flex_attention(query, key, value, sample_ids, half_window, scale,
                    cache: MicroBatchCache | None = None) -> torch.Tensor:
    """The module docstring's rule as a FlexAttention mask_mod; the BlockMask lets the kernel skip
    the blocks no query of a block may see (other documents, outside the window), built once per
    micro-batch and window with `cache`."""
    flex, _ = _compiled_flex()
    block_mask = _shared(cache, sample_ids, ("flex", half_window),
                         lambda: _block_mask(sample_ids, half_window, query.shape[2], query.device))
    return flex(query, key, value, block_mask=block_mask, scale=scale)


def _block_mask(sample_ids, half_window, seq: int, device):
    """The BlockMask of the rule. No captured number changes with the row's length (global layers
    have no distance term), so the compiled builder and kernel are not specialised to one length."""
    _, block_mask_of = _compiled_flex()
    ids = sample_ids.to(torch.int32)
    if half_window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & ((q_idx - kv_idx).abs() <= half_window)
    return block_mask_of(mask_mod, sample_ids.shape[0], None, seq, seq, device=device)
