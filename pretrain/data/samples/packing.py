"""Sequence packing: the samples of a rank's step share rows of seq_length tokens.

Each sample keeps everything it has unpacked: its tokens and token types, its positions from 0,
its [CLS] (the NSP/SOP head reads it), its masked positions and labels. What changes is where it
sits: it is copied into a row at some offset, and `sample_ids` (the sample's number in its
micro-batch + 1 on its tokens, 0 on padding) tells the attention which tokens may see each other
(block-diagonal: a sample attends only to itself). Positions the heads read are flat indices
into the micro-batch's [rows * seq_length] tokens, so the heads return per-sample tensors and
the labels are the samples' own.

What is packed together is a rank's whole share of a step (its micro-batches' samples, in
Megatron's order), not one micro-batch: a window of more samples fills rows better (at seq 512
on the demo corpus, 94% for 32 samples, 97% for 64, 98% for 128). The rows are then dealt out
to the step's micro-batches, so a micro-batch holds about micro_batch_size samples, in a row
count that follows their lengths. The loss does not depend on how a step's samples are cut
into micro-batches (PretrainingLoss: means over the whole global batch).

Which row a sample goes to is a pure function of the window's samples (first-fit decreasing on
their lengths, ties by position), so packing keeps the sample sequence, the layout invariance
and the exact resume of pretrain/data/samples.
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


def deal_rows(rows: list[list[int]], parts: int) -> list[list[list[int]]]:
    """`rows` dealt out to `parts` micro-batches as evenly as counts go (consecutive rows); a
    row with several samples gives one up to a new row while there are fewer rows than parts,
    so no micro-batch is empty (there are at least `parts` samples)."""
    rows = [list(row) for row in rows]
    while len(rows) < parts:
        fullest = max(range(len(rows)), key=lambda r: len(rows[r]))
        if len(rows[fullest]) < 2:
            raise PackingError(f"{sum(map(len, rows))} samples cannot fill {parts} micro-batches")
        rows.append([rows[fullest].pop()])
    return [rows[k * len(rows) // parts:(k + 1) * len(rows) // parts] for k in range(parts)]


def pack(samples: list[dict[str, np.ndarray]], parts: int = 1) -> list[dict[str, np.ndarray]]:
    """`samples` (a rank's share of a step) packed into rows, as `parts` micro-batches (NumPy
    arrays: PACKED_INPUTS then LABELS). A micro-batch's samples are in window order."""
    stacked = {name: np.stack([s[name] for s in samples]) for name in samples[0]}
    seq = stacked["input_ids"].shape[1]
    lengths = real_lengths(stacked["padding_mask"])
    return [_micro_batch(stacked, lengths, rows, seq)
            for rows in deal_rows(first_fit_decreasing(lengths, seq), parts)]


def _micro_batch(stacked: dict, lengths: np.ndarray, rows: list[list[int]], seq: int) -> dict[str, np.ndarray]:
    """One packed micro-batch of `rows` (sample numbers of the window in each row)."""
    members = sorted(i for row in rows for i in row)
    number = {i: n for n, i in enumerate(members)}  # the sample's place in this micro-batch
    packed = {name: np.zeros((len(rows), seq), dtype=np.int64)
              for name in ("input_ids", "token_type_ids", "sample_ids", "position_ids")}
    start = np.zeros(len(members), dtype=np.int64)  # flat index of each sample's first token ([CLS])
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = int(lengths[i])
            cols = slice(offset, offset + n)
            packed["input_ids"][r, cols] = stacked["input_ids"][i, :n]
            packed["token_type_ids"][r, cols] = stacked["token_type_ids"][i, :n]
            packed["sample_ids"][r, cols] = number[i] + 1
            packed["position_ids"][r, cols] = np.arange(n)
            start[number[i]] = r * seq + offset
            offset += n
    # unused prediction slots (weight 0) point at position 0: the sample's [CLS], as unpacked
    packed["masked_positions"] = stacked["masked_positions"][members].astype(np.int64) + start[:, None]
    packed["cls_positions"] = start
    for name in LABELS:
        packed[name] = stacked[name][members]
    return packed


def packing_efficiency(lengths, capacity: int) -> float:
    """Real tokens / row capacity when `lengths` are packed into rows of `capacity`."""
    return float(np.sum(lengths)) / (len(first_fit_decreasing(lengths, capacity)) * capacity)
