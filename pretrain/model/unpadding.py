"""ModernBERT, and BERT's pretraining forward outside context parallelism, compute on real tokens
only: before the first layer a micro-batch's rows become one row of their real tokens, and a
caller that wants per-row hidden states gets them back with zeros at the padding (`repad`).

Padded rows (a padding mask; each row's real tokens contiguous, as a tokenizer pads them) and
packed rows (data.packing: sample ids, 0 on the padding at a row's end) alike become the packed
form with one row of T real tokens:

  hidden [1, T, hidden], sample_ids [1, T], masked_positions and cls_positions (flat indices into
  the T tokens), position_ids [1, T]

where a padded row's tokens get its row number + 1 as their sample id and their column as their
position (transformers' positions), and packed rows keep theirs. Every layer after it does T
tokens' work instead of rows x seq_length (what the ModernBERT codebase does: unpad_input before
the encoder, variable-length attention), so `data.packing: false` costs no more per real token
than packing, and the attention of a padded batch is that of a packed one (a token attends its own
row's tokens only; the window counts positions within the row, which contiguity makes the flat
distance).

Each call reads one small tensor to the host (T, which is the output's shape, and the padded
rows' contiguity): one sync per micro-batch, as unpad_input's nonzero costs the ModernBERT
codebase.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Tokens(NamedTuple):
    hidden: torch.Tensor           # [1, T, hidden]
    sample_ids: torch.Tensor       # [1, T], >= 1
    masked_positions: torch.Tensor  # the input's shape, flat indices into the T tokens
    cls_positions: torch.Tensor    # [samples], flat indices into the T tokens
    position_ids: torch.Tensor     # [1, T]
    index: torch.Tensor            # [T], each kept token's flat index into the input's rows x seq


class PaddingLayoutError(ValueError):
    """A padded row whose real tokens are not contiguous (padding between real tokens)."""


def unpad_inputs(inputs: tuple) -> Tokens:
    """The embedding stage's input tuple (word vectors first, then the batch's fields after its
    input ids: padded rows' (token_type_ids, padding_mask, masked_positions), or packed rows'
    (token_type_ids, sample_ids, masked_positions, position_ids, cls_positions)) as one row of
    its real tokens."""
    if len(inputs) == 6:
        word_vectors, _token_types, sample_ids, masked_positions, position_ids, cls_positions = inputs
        return unpad_packed(word_vectors, sample_ids, masked_positions, position_ids, cls_positions)
    word_vectors, _token_types, padding_mask, masked_positions = inputs
    return unpad_padded(word_vectors, padding_mask, masked_positions)


def unpad_padded(hidden: torch.Tensor, padding_mask: torch.Tensor, masked_positions: torch.Tensor) -> Tokens:
    """Padded rows (`padding_mask` [rows, seq], 1 = real; `masked_positions` [rows, P] columns)
    as one row of their real tokens. Slots pointing at padding (unused prediction slots, weight 0)
    point at some real token afterwards; nothing reads them."""
    rows, seq = padding_mask.shape
    device = padding_mask.device
    real = padding_mask != 0
    count = real.sum(1)
    column = torch.arange(seq, device=device).expand(rows, seq)
    first = torch.where(real, column, seq).amin(1)
    last = torch.where(real, column, -1).amax(1)
    gaps = ((last - first + 1) != count) & (count > 0)
    total, bad_rows = (int(v) for v in torch.stack([count.sum(), gaps.sum()]).tolist())  # the one sync
    if bad_rows:
        bad = int(gaps.nonzero()[0, 0])
        raise PaddingLayoutError(
            f"row {bad} of the batch has padding between real tokens (padding mask "
            f"{padding_mask[bad].tolist()}): ModernBERT computes each row's real tokens as one run, so they "
            "must be contiguous (padding on the right or the left only, as tokenizers pad)")
    flat_real = real.reshape(-1)
    row_ids = torch.arange(1, rows + 1, device=device)[:, None].expand(rows, seq).reshape(-1)
    index, new_of_old, total = _kept(flat_real, total)
    starts = torch.arange(rows, device=device) * seq
    return Tokens(
        hidden=hidden.reshape(rows * seq, -1).index_select(0, index)[None],
        sample_ids=row_ids.index_select(0, index)[None],
        masked_positions=new_of_old[masked_positions + starts[:, None]],
        cls_positions=new_of_old[starts + first.clamp(max=seq - 1)],
        position_ids=column.reshape(-1).index_select(0, index)[None],
        index=index,
    )


def unpad_packed(hidden: torch.Tensor, sample_ids: torch.Tensor, masked_positions: torch.Tensor,
                 position_ids: torch.Tensor, cls_positions: torch.Tensor) -> Tokens:
    """Packed rows (pretrain/data/samples/packing.py: `sample_ids` [rows, seq], 0 = padding;
    positions flat into rows x seq) as one row of their real tokens."""
    flat_real = sample_ids.reshape(-1) != 0
    total = int(flat_real.sum())  # the one sync
    index, new_of_old, total = _kept(flat_real, total)
    return Tokens(
        hidden=hidden.reshape(flat_real.numel(), -1).index_select(0, index)[None],
        sample_ids=sample_ids.reshape(-1).index_select(0, index)[None],
        masked_positions=new_of_old[masked_positions],
        cls_positions=new_of_old[cls_positions],
        position_ids=position_ids.reshape(-1).index_select(0, index)[None],
        index=index,
    )


def _kept(flat_real: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the kept tokens' flat indices [T], each flat index's place among the kept [N] (a padding
    index: the kept token before it, or 0), T), without a second sync: a batch of padding only
    keeps its first token, so that no tensor is empty."""
    if total == 0:
        flat_real = flat_real.clone()
        flat_real[0] = True
        total = 1
    place = flat_real.long().cumsum(0) - 1
    # each kept token's index written to its place; every padding index to slot `total`, cut off
    target = torch.where(flat_real, place, total)
    index = torch.empty(total + 1, dtype=torch.long, device=flat_real.device)
    index.scatter_(0, target, torch.arange(flat_real.numel(), device=flat_real.device))
    return index[:total], place.clamp(min=0), total


def repad(hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """One row of real tokens ([1, T, hidden], as unpadded) back in the input's rows ([rows, seq,
    hidden]), zeros at the padding (`real`: [rows, seq], nonzero on real tokens; all zero rows of
    a padding-only batch keep their first token, as `unpad_*` kept it)."""
    rows, seq = real.shape
    flat_real = real.reshape(-1) != 0
    total = hidden.shape[1]
    index, _, kept = _kept(flat_real, total if bool(flat_real.any()) else 0)
    if kept != total:
        raise ValueError(f"repad: {total} tokens for a mask of {kept} real tokens")
    out = hidden.new_zeros(rows * seq, hidden.shape[-1])
    return out.index_copy(0, index, hidden[0]).view(rows, seq, -1)
