"""A full disk named as one line: the path being written and the space left, whatever raised it
(Python's OSError, torch's zip writer, safetensors, DeepSpeed's checkpoint engine).

Every writer of the project goes through `disk_full_named` (atomic.atomic_outputs does it for the
files it renames into place), so a full disk never surfaces as `RuntimeError: basic_ios::clear:
iostream error` or `unexpected pos 576 vs 534` from deep inside a library.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Iterator

from .errors import UserError

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_SAYS_NO_SPACE = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")
# torch's zip writer and C++ streams report a short write without its errno: taken for a full
# disk when the file system is (nearly) full right after it
_SHORT_WRITE = ("unexpected pos", "iostream error", "file write failed", "PytorchStreamWriter failed")
NEARLY_FULL_BYTES = 64 << 20


class DiskFullError(UserError, OSError):
    """No space left where a program writes; the message names the path and the space left."""


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _mount_point(path: str) -> str:
    path = _nearest_existing(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def space_left(path: str) -> str:
    """"12.0 KiB free of 1.0 MiB on /mnt/ckpt": the file system `path` is (or would be) on."""
    usage = shutil.disk_usage(_nearest_existing(path))
    return f"{_size(usage.free)} free of {_size(usage.total)} on {_mount_point(path)}"


def is_disk_full(error: BaseException, path: str) -> bool:
    """Whether `error` (or an error it was raised from) says the disk at `path` is full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return True
        text = str(current)
        if any(s in text for s in _SAYS_NO_SPACE):
            return True
        if any(s in text for s in _SHORT_WRITE) and shutil.disk_usage(_nearest_existing(path)).free < NEARLY_FULL_BYTES:
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def disk_full_named(path: str, what: str, note: str = "") -> Iterator[None]:
    """Around the writes of `what` into `path` (a file or directory): a full disk becomes one
    DiskFullError naming both and the space left, measured before any caller cleans up, then
    `note` (what the failed write left)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not is_disk_full(error, path):
            raise
        raise DiskFullError(f"{path}: no space left on device while writing {what} ({space_left(path)})"
                            + (f"; {note}" if note else "")) from None
