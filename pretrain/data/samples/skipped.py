"""Ranges of the training sample sequence a run steps over (data.skip_samples, and the ranges a
loss-spike rollback adds): the position of the sequence after N samples trained from a position.

Positions are sample indices of the global sequence (sample i is the same in every layout); a
range is [start, end) in whole global batches, so a step never begins inside one and the data
iterator, its loader processes and the trainer all move the same way (`advance`).
"""
from __future__ import annotations

from typing import Iterable

Ranges = list[tuple[int, int]]


def merged(ranges: Iterable) -> Ranges:
    """[start, end) ranges from [first, count] pairs (or ranges), sorted, overlaps joined."""
    spans = sorted((int(first), int(first) + int(count)) for first, count in ranges if int(count) > 0)
    out: Ranges = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def as_pairs(ranges: Ranges) -> list[list[int]]:
    """[first, count] pairs, the form the config and checkpoints keep."""
    return [[start, end - start] for start, end in ranges]


def skip_ahead(position: int, ranges: Ranges) -> int:
    """The first position at or after `position` that no range covers."""
    for start, end in ranges:
        if start <= position < end:
            position = end
    return position


def advance(position: int, samples: int, ranges: Ranges) -> int:
    """The position after training `samples` samples from `position`, stepping over the ranges
    (a range reached exactly is stepped over at once: the next draw starts after it)."""
    position = skip_ahead(position, ranges)
    for start, end in ranges:
        if end <= position:
            continue
        if position + samples < start:
            break
        samples -= start - position
        position = end
    return position + samples
