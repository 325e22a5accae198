"""Windows over a token sequence longer than the model's input (google-research/bert's run_squad.py
rules, shared by span extraction and token classification): window starts are `stride` tokens
apart, and a token that several windows hold is predicted from the one where it has the most
context (the window with the largest min(left, right) context around it, ties to the longer
window, then to the earlier one)."""
from __future__ import annotations

import bisect


def windows(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window; starts are `stride` apart (run_squad.py's loop)."""
    spans, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, stride)
    return spans


def max_context_window(spans: list[tuple[int, int]], position: int) -> int:
    """Index of the window in which token `position` has the most context."""
    best_score, best = None, -1
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best = score, index
    return best


def is_max_context(spans: list[tuple[int, int]], current: int, position: int) -> bool:
    return max_context_window(spans, position) == current


def max_context_owners(spans: list[tuple[int, int]], positions: list[int]) -> list[int]:
    """max_context_window of each of the (ascending) `positions`, in time linear in the windows'
    total length (a document of thousands of windows is scored window by window)."""
    best_score, owner = [-1.0] * len(positions), [-1] * len(positions)
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        for i in range(bisect.bisect_left(positions, start), bisect.bisect_right(positions, end)):
            score = min(positions[i] - start, end - positions[i]) + 0.01 * length
            if score > best_score[i]:
                best_score[i], owner[i] = score, index
    return owner
