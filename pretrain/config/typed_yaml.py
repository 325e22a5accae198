"""A typed-YAML loader for configs made of dataclass sections: `base:` inheritance, dotted
`section.field=value` overrides parsed as YAML, unknown sections and keys and wrong types
reported all at once (one line each) in a ConfigError. Pretraining (schema.py) and fine-tuning
(finetune/config.py) load their own sections with it.
"""
from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from typing import Any, Sequence

import yaml

from ..common.errors import UserError


class ConfigError(UserError, ValueError):
    """All configuration problems found, one per line (``.problems`` holds the list)."""

    def __init__(self, problems: str | Sequence[str], checked_tree: dict | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        # load_sections: the keys and values that passed their checks (the others left out), so
        # that a caller can still check the rules between them and report every problem at once;
        # `partial` is the config built from them, where the caller could build one (load_config)
        self.checked_tree = checked_tree
        self.partial = None
        super().__init__("\n".join(self.problems))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float: PyYAML follows YAML 1.1, where a float
    needs a dot (`1.0e-3`), so `optimizer.lr=1e-3` would otherwise be the string '1e-3'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _field_types(sections: dict[str, type]) -> dict[str, dict[str, Any]]:
    return {name: typing.get_type_hints(cls) for name, cls in sections.items()}


class _WrongType(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """value checked against type annotation tp (int is accepted for float; bool is not int)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner)
    if origin is list:
        if not isinstance(value, list):
            raise _WrongType
        (item,) = typing.get_args(tp)
        return [_coerce(v, item) for v in value]
    if tp is dict:  # a free-form mapping (model.rope_scaling): its section's problems() checks the contents
        if not isinstance(value, dict):
            raise _WrongType
        return copy.deepcopy(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    if tp is str and isinstance(value, bool):
        # YAML reads an unquoted true/false as a boolean; a text field (a choice such as
        # model.compile: auto | true | false) meant the word, which its choice check then validates
        return "true" if value else "false"
    raise _WrongType


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is dict:
        return "a mapping"
    return "null" if tp is type(None) else tp.__name__


def _value_desc(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def check_tree(d: Any, source: str, sections: dict[str, type],
               moved: dict[str, str] | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check a {section: {field: value}} tree: unknown sections/keys and value types; a key of
    `moved` ("section.key" -> its new "section.key") is named with its new place.
    Returns the known, type-converted entries and the problems (one line each)."""
    field_types = _field_types(sections)
    if not isinstance(d, dict):
        return {}, [f"{source}: expected a mapping of sections, got {_value_desc(d)}"]
    clean: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for section, entries in d.items():
        if section not in sections:
            problems.append(f"{source}: unknown section {section!r}{_did_you_mean(section, sections)}; "
                            f"valid sections: {', '.join(sections)}")
            continue
        if entries is None:  # a section with every line commented out
            entries = {}
        if not isinstance(entries, dict):
            problems.append(f"{source}: section {section!r} must be a mapping, got {_value_desc(entries)}")
            continue
        fields = field_types[section]
        clean[section] = {}
        for key, value in entries.items():
            if f"{section}.{key}" in (moved or {}):
                problems.append(f"{source}: {section}.{key} has moved: it is {moved[f'{section}.{key}']} now")
                continue
            if key not in fields:
                problems.append(f"{source}: unknown key '{section}.{key}'{_key_suggestion(section, key, field_types)}; "
                                f"valid keys in {section!r}: {', '.join(fields)}")
                continue
            try:
                clean[section][key] = _coerce(value, fields[key])
            except _WrongType:
                problems.append(f"{source}: {section}.{key} must be {_type_name(fields[key])}, "
                                f"got {_value_desc(value)}")
    return clean, problems


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _key_suggestion(section: str, key: str, field_types: dict[str, dict[str, Any]]) -> str:
    """' (did you mean ...)' for an unknown key: the same name in another section first (train.vocab_file
    -> data.vocab_file), else a close spelling in its own section (model.ffn_size -> model.ffn_hidden_size)."""
    elsewhere = [f"{other}.{key}" for other, fields in field_types.items() if other != section and key in fields]
    if elsewhere:
        return f" (did you mean {' or '.join(repr(e) for e in elsewhere)}?)"
    close = difflib.get_close_matches(key, list(field_types[section]), n=1, cutoff=0.6)
    if not close:  # a prefix of a longer name: ffn_size -> ffn_hidden_size
        close = [name for name in field_types[section] if name.split("_")[0] == key.split("_")[0]
                 and name.split("_")[-1] == key.split("_")[-1]][:1]
    return f" (did you mean '{section}.{close[0]}'?)" if close else ""


def deep_merge(base: dict, top: dict) -> dict:
    """top merged over base: nested dicts merge, anything else (including lists) replaces."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = _yaml_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {_value_desc(data)}")
    return data


def _load_tree(path: str, stack: tuple[str, ...], problems: list[str], sections: dict[str, type],
               moved: dict[str, str] | None = None) -> dict:
    """The file's checked contents merged over its (recursively loaded) bases."""
    real = os.path.realpath(path)
    if real in stack:
        raise ConfigError(f"{path}: 'base' inheritance cycle")
    data = _read_yaml(path)
    bases = data.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"{path}: 'base' must be a path or a list of paths, got {_value_desc(bases)}")
    merged: dict = {}
    for base in bases:  # later bases win over earlier ones
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
        merged = deep_merge(merged, _load_tree(base_path, stack + (real,), problems, sections, moved))
    clean, file_problems = check_tree(data, path, sections, moved)
    problems.extend(file_problems)
    return deep_merge(merged, clean)


def split_override(item: str, valid_key, expected: str) -> tuple[list[str], Any] | str:
    """One dotted ``KEY=value`` override of the command line: (the key's parts, the value read as
    YAML), or the problem's line. `valid_key(parts)` says whether the key has the expected shape,
    `expected` shows it (``section.field=value``)."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts) or not valid_key(parts):
        return f"command line: malformed override {item!r}; expected {expected}"
    try:
        return parts, _yaml_load(text)
    except yaml.YAMLError as e:
        return f"command line: override {item!r}: value is not valid YAML: {' '.join(str(e).split())}"


def _parse_overrides(overrides: Sequence[str], problems: list[str], sections: dict[str, type],
                     moved: dict[str, str] | None = None) -> dict:
    tree: dict[str, dict[str, Any]] = {}
    for item in overrides:
        parsed = split_override(item, lambda parts: len(parts) == 2, "section.field=value")
        if isinstance(parsed, str):
            problems.append(parsed)
            continue
        (section, name), value = parsed
        tree.setdefault(section, {})[name] = value  # later overrides win
    clean, check_problems = check_tree(tree, "command line", sections, moved)
    problems.extend(check_problems)
    return clean


def load_sections(path: str | None, overrides: Sequence[str], sections: dict[str, type],
                  moved: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The checked {section: {field: value}} tree of a YAML file (+ bases) and overrides, for any
    set of dataclass sections (pretraining's and fine-tuning's); `moved`: see check_tree."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.field=value' strings, not one string")
    problems: list[str] = []
    tree = _load_tree(path, (), problems, sections, moved) if path is not None else {}
    tree = deep_merge(tree, _parse_overrides(overrides, problems, sections, moved))
    if problems:
        raise ConfigError(problems, checked_tree=tree)
    return tree
