"""Sample-index arrays built once, cached on disk under a hash of everything they depend on.

The first rank builds and writes atomically (array, then the JSON that marks it complete);
every rank then maps the same file read-only, so N ranks and their loader workers share one
copy in the page cache. A rank that does not see the file afterwards (cache directory not shared
between nodes) builds it itself: the build is deterministic, the result the same.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

INDEX_FORMAT = 1  # bump when a builder's output changes for the same inputs


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes (the .idx: sentence lengths and document bounds decide the index)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(description: dict) -> str:
    text = json.dumps({"format": INDEX_FORMAT, **description}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_index(cache_dir: str | Path, name: str, description: dict, build: Callable[[], tuple[np.ndarray, dict]],
                 is_builder: bool, barrier: Callable[[], None] | None = None,
                 log: Callable[[str], None] = print) -> tuple[np.ndarray, dict]:
    """The array `build()` returns for `description`, from the cache when present.

    Returns (array mapped read-only, info dict stored beside it).
    """
    cache_dir = Path(cache_dir)
    stem = cache_dir / f"{name}-{cache_key(description)}"
    array_path, info_path = stem.with_suffix(".npy"), stem.with_suffix(".json")
    if is_builder and not info_path.exists():
        _build_and_store(array_path, info_path, description, build, log)
    if barrier is not None:
        barrier()
    if not info_path.exists():
        log(f"index {info_path.name} not visible here (cache directory not shared?): building it on this rank")
        _build_and_store(array_path, info_path, description, build, log)
    info = json.loads(info_path.read_text())
    return np.load(array_path, mmap_mode="r"), info["counts"]


def _build_and_store(array_path: Path, info_path: Path, description: dict, build, log) -> None:
    array_path.parent.mkdir(parents=True, exist_ok=True)
    array, counts = build()
    suffix = f".tmp-{os.getpid()}"
    tmp_array = array_path.with_name(array_path.name + suffix)
    tmp_info = info_path.with_name(info_path.name + suffix)
    with open(tmp_array, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
    tmp_info.write_text(json.dumps({"description": description, "counts": counts}, indent=1, sort_keys=True))
    os.replace(tmp_array, array_path)
    os.replace(tmp_info, info_path)  # last: its presence means the array is complete
    log(f"built index {array_path.name}: {counts}")
