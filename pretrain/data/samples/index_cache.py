"""Sample-index arrays built once, cached on disk under a hash of everything they depend on.

The first rank builds and writes atomically (array, then the JSON that marks it complete);
every rank then maps the same file read-only, so N ranks and their loader workers share one
copy in the page cache. A rank that does not see the file afterwards (cache directory not shared
between nodes) builds it itself: the build is deterministic, the result the same.
"""
from __future__ import annotations

import logging

import hashlib
import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

INDEX_FORMAT = 2  # bump when a builder's output changes for the same inputs


def file_fingerprint(path: str | Path, edge_bytes: int = 1 << 22) -> str:
    """Identity of a data file for cache keys: its size, modification time and a sha256 of its
    first and last 4 MiB. Every rank computes it at start-up, so it must not read a multi-GB
    .idx in full; a file rewritten in place changes its size or mtime."""
    stat = os.stat(path)
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(edge_bytes))
        if stat.st_size > edge_bytes:
            f.seek(max(edge_bytes, stat.st_size - edge_bytes))
            digest.update(f.read(edge_bytes))
    return digest.hexdigest()


def cache_key(description: dict) -> str:
    text = json.dumps({"format": INDEX_FORMAT, **description}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_index(cache_dir: str | Path, name: str, description: dict, build: Callable[[], tuple[np.ndarray, dict]],
                 is_builder: bool, barrier: Callable[[], None] | None = None) -> tuple[np.ndarray, dict]:
    """The array `build()` returns for `description`, from the cache when present.

    Returns (array mapped read-only, info dict stored beside it).
    """
    cache_dir = Path(cache_dir)
    stem = cache_dir / f"{name}-{cache_key(description)}"
    array_path, info_path = stem.with_suffix(".npy"), stem.with_suffix(".json")
    if is_builder and not info_path.exists():
        _build_and_store(array_path, info_path, description, build)
    if barrier is not None:
        barrier()
    if not info_path.exists():
        logger.warning(f"index {info_path.name} not visible here (cache directory not shared?): "
                       "building it on this rank")
        _build_and_store(array_path, info_path, description, build)
    info = json.loads(info_path.read_text())
    return np.load(array_path, mmap_mode="r"), info["counts"]


def _build_and_store(array_path: Path, info_path: Path, description: dict, build) -> None:
    array_path.parent.mkdir(parents=True, exist_ok=True)
    # a large corpus takes minutes here: said before, so the run is never silent (the other ranks wait)
    logger.info(f"building index {array_path.name} in {array_path.parent} (once: later runs read it)")
    started = time.monotonic()
    array, counts = build()
    suffix = f".tmp-{os.getpid()}"
    tmp_array = array_path.with_name(array_path.name + suffix)
    tmp_info = info_path.with_name(info_path.name + suffix)
    with open(tmp_array, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
    tmp_info.write_text(json.dumps({"description": description, "counts": counts}, indent=1, sort_keys=True))
    os.replace(tmp_array, array_path)
    os.replace(tmp_info, info_path)  # last: its presence means the array is complete
    logger.info(f"built index {array_path.name} in {time.monotonic() - started:.1f} s: {counts}")


@dataclass(frozen=True)
class MappedNpy:
    """A cached array as it travels to a loader process: its file, mapped again on arrival
    (np.memmap itself pickles as a full copy of its data)."""

    path: str


def mapped_state(array):
    """`array` for pickling: a whole-file mapping from `cached_index` by its file name, anything
    else (None, an in-memory array) as it is."""
    if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.filename:
        return MappedNpy(array.filename)
    return array


def from_mapped_state(state):
    return np.load(state.path, mmap_mode="r") if isinstance(state, MappedNpy) else state
