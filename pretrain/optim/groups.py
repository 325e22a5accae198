"""Which optimizer param group each parameter belongs to, by its kind.

One function serves the trainer (grouping live parameters) and the checkpoint reader (mapping a
ZeRO-0 optimizer state's parameter indices back to names), so both agree on the order.
"""
from __future__ import annotations

from typing import Iterable, TypeVar

from ..model.names import logical_parameters

T = TypeVar("T")


def group_by_kind(items: Iterable[tuple[T, str]], no_weight_decay, no_layer_adaptation) -> list[tuple[bool, bool, list[T]]]:
    """(decays, adapts layers, items) per param group, in the optimizer's group order; items keep
    their order within a group. `items` are (item, parameter kind) in model order."""
    groups: dict[tuple[bool, bool], list[T]] = {}
    for item, kind in items:
        groups.setdefault((kind not in no_weight_decay, kind not in no_layer_adaptation), []).append(item)
    return [(decay, adapt, members) for (decay, adapt), members in sorted(groups.items(), reverse=True)]


def optimizer_param_groups(model, optimizer_cfg) -> list[dict]:
    """Group parameters by the configured weight-decay and layer-adaptation exclusions (by kind)."""
    trainable = [(lp.param, lp.kind) for lp in logical_parameters(model) if lp.param.requires_grad]
    return [
        {"params": params, "weight_decay": optimizer_cfg.weight_decay if decay else 0.0, "layer_adaptation": adapt}
        for decay, adapt, params in group_by_kind(trainable, optimizer_cfg.no_weight_decay,
                                                  optimizer_cfg.no_layer_adaptation)
    ]
