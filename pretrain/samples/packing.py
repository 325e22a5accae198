"""Sequence packing: a micro-batch's samples share rows of seq_length tokens.

Each sample keeps everything it has unpacked: its tokens and token types, its positions from 0,
its [CLS] (the NSP/SOP head reads it), its masked positions and labels. What changes is where it
sits: sample i of the micro-batch is copied into a row at some offset, and `sample_ids` (i + 1 on
its tokens, 0 on padding) tells the attention which tokens may see each other (block-diagonal:
a sample attends only to itself). Positions the heads read are flat indices into the
[rows * seq_length] tokens, so the heads return per-sample tensors in the micro-batch's sample
order, exactly as unpacked, and the labels are unchanged.

Which row a sample goes to is a pure function of the micro-batch's samples (first-fit
decreasing on their lengths, ties by position), so packing keeps the sample sequence, the
layout invariance and the exact resume of pretrain/samples.
"""
from __future__ import annotations

import numpy as np

# The packed micro-batch, by field: what the model takes as inputs (see split_inputs_labels) and
# the labels, which are those of the unpacked samples.
PACKED_INPUTS = ("input_ids", "token_type_ids", "sample_ids", "masked_positions", "position_ids", "cls_positions")
LABELS = ("masked_labels", "masked_weights", "nsp_label")


class PackingError(ValueError):
    """A sample whose real tokens are not a prefix of its row (packing needs padding at the end)."""


def real_lengths(padding_masks: np.ndarray) -> np.ndarray:
    """Real tokens of each sample [samples, seq] -> [samples]; they must come first (padding at the end)."""
    lengths = padding_masks.sum(axis=1)
    prefix = np.arange(padding_masks.shape[1])[None, :] < lengths[:, None]
    bad = np.flatnonzero(((padding_masks != 0) != prefix).any(axis=1))
    if bad.size:
        raise PackingError(f"sample {int(bad[0])} of the micro-batch has padding before real tokens; packing needs "
                           "every sample's real tokens first and its padding at the end")
    return lengths


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Rows of sample numbers: longest first, each into the first row it fits in, ties broken by
    number (deterministic); each row's samples in number order. Within 11/9 of the fewest rows."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        need = int(lengths[i])
        if need > capacity:
            raise PackingError(f"sample {i} has {need} tokens, more than the row's {capacity}")
        for r, space in enumerate(free):
            if need <= space:
                rows[r].append(i)
                free[r] -= need
                break
        else:
            rows.append([i])
            free.append(capacity - need)
    return [sorted(row) for row in rows]


def pack(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One packed micro-batch (NumPy arrays: PACKED_INPUTS then LABELS) from unpacked samples."""
    stacked = {name: np.stack([s[name] for s in samples]) for name in samples[0]}
    count, seq = stacked["input_ids"].shape
    lengths = real_lengths(stacked["padding_mask"])
    rows = first_fit_decreasing(lengths, seq)
    shape = (len(rows), seq)
    packed = {name: np.zeros(shape, dtype=np.int64)
              for name in ("input_ids", "token_type_ids", "sample_ids", "position_ids")}
    start = np.zeros(count, dtype=np.int64)  # flat index of each sample's first token ([CLS])
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = int(lengths[i])
            cols = slice(offset, offset + n)
            packed["input_ids"][r, cols] = stacked["input_ids"][i, :n]
            packed["token_type_ids"][r, cols] = stacked["token_type_ids"][i, :n]
            packed["sample_ids"][r, cols] = i + 1
            packed["position_ids"][r, cols] = np.arange(n)
            start[i] = r * seq + offset
            offset += n
    # unused prediction slots (weight 0) point at position 0: the sample's [CLS], as unpacked
    packed["masked_positions"] = stacked["masked_positions"].astype(np.int64) + start[:, None]
    packed["cls_positions"] = start
    for name in LABELS:
        packed[name] = stacked[name]
    return packed


def packing_efficiency(lengths, capacity: int) -> float:
    """Real tokens / row capacity when `lengths` are packed into rows of `capacity`."""
    return float(np.sum(lengths)) / (len(first_fit_decreasing(lengths, capacity)) * capacity)
