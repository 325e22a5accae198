"""Which optimizer param group each parameter belongs to, by its kind.

One function serves the trainer (grouping live parameters) and the checkpoint reader (mapping a
ZeRO-0 optimizer state's parameter indices back to names), so both agree on the order.
"""
from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def group_by_kind(items: Iterable[tuple[T, str]], no_weight_decay, no_layer_adaptation) -> list[tuple[bool, bool, list[T]]]:
    """(decays, adapts layers, items) per param group, in the optimizer's group order; items keep
    their order within a group. `items` are (item, parameter kind) in model order."""
    groups: dict[tuple[bool, bool], list[T]] = {}
    for item, kind in items:
        groups.setdefault((kind not in no_weight_decay, kind not in no_layer_adaptation), []).append(item)
    return [(decay, adapt, members) for (decay, adapt), members in sorted(groups.items(), reverse=True)]
