"""Tokenized inputs kept between runs (`task.cache_dir`): the runs of a sweep read and tokenize each
task file once, and every later run with the same file, tokenizer and task settings loads them.

An entry is one data file as a run reads and encodes it (the task's examples, its read report and
reference, the encoded features), under a key that changes with anything that changes them: the
file's bytes, the tokenizer (its serialised form and special tokens), the task's settings (every
`task.*` key except the file paths, which the bytes stand for), the split and whether it is the
training set, and CACHE_FORMAT (raise it when what `encode` produces changes). Entries are written
atomically: a run killed while writing leaves no entry that looks complete, and two runs writing the
same one at once leave one of their identical copies.

The entries are pickles (torch.save): read them only from a directory of your own.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Callable

import torch

from pretrain.common.atomic import atomic_outputs

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
_PATH_KEYS = ("data_dir", "train_file", "dev_files", "test_files")  # stood for by the file's bytes
_BLOCK = 1 << 20


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def entry_key(path: str, split: str, training: bool, task_section, tokenizer_text: str, specials: Any) -> str:
    """The entry's name: a digest of everything its contents depend on."""
    settings = {k: v for k, v in dataclasses.asdict(task_section).items() if k not in _PATH_KEYS}
    described = json.dumps({"format": CACHE_FORMAT, "file": file_digest(path), "split": split, "training": training,
                            "task": settings, "tokenizer": hashlib.sha256(tokenizer_text.encode()).hexdigest(),
                            "specials": repr(specials)}, sort_keys=True, default=str)
    return hashlib.sha256(described.encode()).hexdigest()[:32]


def cached(cache_dir: str | None, key: str, make: Callable[[], Any], what: str, write: bool = True) -> Any:
    """The entry `key` from `cache_dir`, else `make()` (stored there when `write`); `what` names the
    file in the log line that says which happened. No cache_dir: make() every time."""
    if not cache_dir:
        return make()
    path = os.path.join(cache_dir, f"{key}.pt")
    if os.path.exists(path):
        try:
            value = torch.load(path, weights_only=False)
        except Exception as error:  # noqa: BLE001 (an unreadable entry is made again, and replaced)
            logger.warning(f"{path}: unreadable tokenized inputs ({type(error).__name__}: {error}); tokenizing {what} again")
        else:
            logger.info(f"{what}: tokenized inputs from the cache ({path})")
            return value
    value = make()
    if write:
        os.makedirs(cache_dir, exist_ok=True)
        with atomic_outputs([path]) as temporary:
            torch.save(value, temporary[path])
        logger.info(f"{what}: tokenized, cached in {path}")
    return value
