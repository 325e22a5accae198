"""The small rules every section's `problems()` uses: each appends one line naming the key."""
from __future__ import annotations

from typing import Sequence


def positive(problems: list[str], name: str, value: float) -> None:
    if not value > 0:
        problems.append(f"{name} ({value}) must be > 0")


def non_negative(problems: list[str], name: str, value: float) -> None:
    if not value >= 0:
        problems.append(f"{name} ({value}) must be >= 0")


def one_of(problems: list[str], name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        problems.append(f"{name} ({value!r}) must be one of: {', '.join(allowed)}")
