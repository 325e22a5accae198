"""One dataset per value of a column (a language, a source): the names of the outputs, and the
manifest that lists them.

``tools/preprocess_data.py --group-by language`` writes ``<prefix>_<value>_<key>_<level>.{bin,idx}``
for every value of the column, and ``<prefix>_<key>_<level>.groups.json`` beside them: each
value with its dataset's prefix (relative to the manifest) and its documents and tokens. A
pretraining config names the manifest in data.paths, and it stands for all of its datasets, one
corpus each (expand_group_manifests), which temperature sampling then weighs by their tokens
(pretrain/data/samples/mixture.py). Torch-free: the config is expanded when it is loaded.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ...common.errors import UserError

__all__ = ["MANIFEST_SUFFIX", "GroupEntry", "GroupManifestError", "group_name", "manifest_path", "write_manifest",
           "read_manifest", "expand_group_manifests", "manifest_problems"]

MANIFEST_SUFFIX = ".groups.json"
FORMAT = "bert-pretrain corpus groups"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_NAME = 100  # characters of a value kept in a file name


class GroupManifestError(UserError, ValueError):
    """A manifest that cannot be read, named with its file."""


@dataclass(frozen=True)
class GroupEntry:
    value: str  # the column's value, as read
    prefix: str  # the dataset's prefix, relative to the manifest's folder
    documents: int
    tokens: int


def group_name(value: str) -> str:
    """The part of a file name that stands for `value`: runs of characters other than letters,
    digits, '.', '_' and '-' become '-' (deu_Latn stays, 'github/python' becomes github-python);
    an empty value is 'empty'."""
    name = _UNSAFE.sub("-", value).strip("-.")[:MAX_NAME]
    return name or "empty"


def manifest_path(output_prefix: str) -> str:
    """The manifest of a grouped output whose datasets would be named ``output_prefix`` ungrouped."""
    return output_prefix + MANIFEST_SUFFIX


def write_manifest(path: str, group_by: str, key: str, entries: list[GroupEntry]) -> None:
    groups = [{"value": e.value, "prefix": e.prefix, "documents": e.documents, "tokens": e.tokens}
              for e in sorted(entries, key=lambda e: e.value)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": 1, "group_by": group_by, "key": key, "groups": groups}, f, indent=1,
                  ensure_ascii=False)
        f.write("\n")


def read_manifest(path: str) -> list[GroupEntry]:
    """The groups a manifest lists, their prefixes made absolute; GroupManifestError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise GroupManifestError(f"{path}: not a readable corpus-group manifest ({error})") from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or not isinstance(saved.get("groups"), list):
        raise GroupManifestError(f"{path}: not a corpus-group manifest written by tools/preprocess_data.py "
                                 "--group-by")
    folder = os.path.dirname(os.path.abspath(path))
    entries = []
    for n, group in enumerate(saved["groups"], 1):
        try:
            entries.append(GroupEntry(str(group["value"]), os.path.join(folder, str(group["prefix"])),
                                      int(group["documents"]), int(group["tokens"])))
        except (KeyError, TypeError, ValueError) as error:
            raise GroupManifestError(f"{path}: group {n} is incomplete ({type(error).__name__}: {error})") from None
    if not entries:
        raise GroupManifestError(f"{path}: lists no group")
    return entries


def expand_group_manifests(tree: dict) -> dict:
    """The config's {section: {key: value}} tree with every manifest in data.paths, data.valid_paths
    and data.test_paths replaced by its datasets' prefixes, in the manifest's order. Left as it is
    where a manifest cannot be expanded (unreadable, or data.weights set beside it): the data checks
    (manifest_problems) say why, in one line. Applied when the run's config is loaded, so the
    checkpoint records the corpora themselves and a resume compares them."""
    data = tree.get("data", {})
    if not isinstance(data, dict):
        return tree
    expanded = dict(data)
    for key in ("paths", "valid_paths", "test_paths"):
        paths = data.get(key)
        if not isinstance(paths, list) or not any(_is_manifest(p) for p in paths):
            continue
        if key == "paths" and data.get("weights"):
            return tree
        try:
            expanded[key] = [prefix for path in paths
                             for prefix in ([e.prefix for e in read_manifest(path)] if _is_manifest(path) else [path])]
        except GroupManifestError:
            return tree
    return {**tree, "data": expanded}


def manifest_problems(data) -> list[str]:
    """A manifest left in a data config (a DataConfig) because it cannot be read, one line each."""
    problems = []
    for key in ("paths", "valid_paths", "test_paths"):
        for path in getattr(data, key):
            if not _is_manifest(path):
                continue
            try:
                read_manifest(path)
            except GroupManifestError as error:
                problems.append(f"data.{key}: {error}")
    return problems  # a manifest beside data.weights: the config's own check names it


def _is_manifest(path) -> bool:
    return isinstance(path, str) and path.endswith(MANIFEST_SUFFIX)
