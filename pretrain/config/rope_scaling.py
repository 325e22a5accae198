"""model.rope_scaling: ModernBERT's rotary scaling, with transformers' definitions and key names
(modeling_rope_utils: "linear", "dynamic" NTK, "yarn"), checked here without torch.

Either one spec for both layer kinds, or one per kind (ModernBERT's global and local layers have
their own rotary bases, and a context extension usually scales the global ones only):

    rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 8192}
    rope_scaling: {global: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 8192}, local: null}

`resolved()` gives {"global": spec | None, "local": spec | None}, each spec a plain dict with its
rope_type and parameters as transformers' config.json `rope_parameters` entry holds them (less the
rope_theta, which stays model.global_rope_theta / local_rope_theta).
"""
from __future__ import annotations

from typing import Any

KINDS = ("global", "local")
# rope_type -> (required parameters, optional parameters): transformers' _validate_<type>_rope_parameters
PARAMETERS = {
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
}


def resolved(value: dict | None) -> dict[str, dict | None]:
    """{"global": spec | None, "local": spec | None} of a checked model.rope_scaling."""
    if not value:
        return {kind: None for kind in KINDS}
    if "rope_type" in value:
        return {kind: dict(value) for kind in KINDS}
    return {kind: (dict(value[kind]) if value.get(kind) else None) for kind in KINDS}


def problems(value: Any, modern: bool) -> list[str]:
    """One line per problem of a model.rope_scaling value."""
    if value is None or value == {}:
        return []
    if not modern:
        return ["model.rope_scaling is for ModernBERT's rotary positions: BERT learns a position table"]
    if not isinstance(value, dict):
        return [f"model.rope_scaling must be a mapping, got {value!r}"]
    if "rope_type" in value:
        return _spec_problems("model.rope_scaling", value)
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        return [f"model.rope_scaling: unknown keys {unknown}: give one spec (rope_type and its parameters) for "
                f"both layer kinds, or one per kind under 'global' and 'local'"]
    found = []
    for kind in KINDS:
        if value.get(kind) is not None:
            if not isinstance(value[kind], dict):
                found.append(f"model.rope_scaling.{kind} must be a mapping or null, got {value[kind]!r}")
            else:
                found += _spec_problems(f"model.rope_scaling.{kind}", value[kind])
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _spec_problems(name: str, spec: dict) -> list[str]:
    rope_type = spec.get("rope_type")
    if rope_type not in PARAMETERS:
        return [f"{name}.rope_type ({rope_type!r}) must be one of: {', '.join(PARAMETERS)}"]
    required, optional = PARAMETERS[rope_type]
    found = [f"{name}: {rope_type} needs {key}" for key in required if spec.get(key) is None]
    unknown = sorted(set(spec) - {"rope_type", *required, *optional})
    if unknown:
        found.append(f"{name}: {rope_type} takes {', '.join(required + optional)}; unknown: {', '.join(unknown)}")
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "original_max_position_embeddings"):
        if spec.get(key) is not None and not (_number(spec[key]) and spec[key] > 0):
            found.append(f"{name}.{key} ({spec[key]!r}) must be a number > 0")
    if _number(spec.get("factor")) and spec["factor"] < 1:
        found.append(f"{name}.factor ({spec['factor']}) must be >= 1 (the ratio of the new length to the trained one)")
    if spec.get("truncate") not in (None, True):
        # transformers reads `truncate` from the top of rope_parameters, which ModernBERT nests per
        # layer kind: an exported `false` would be ignored there, and the two models would differ
        found.append(f"{name}.truncate ({spec['truncate']!r}): only true (transformers' ModernBERT ignores false)")
    return found
