"""Writing outputs so that an interrupted run never leaves one that looks complete: the project's
one atomic writer (atomic_outputs for files written by a program, replace_durably for a small text
file that must be replaced in one step, such as a checkpoint's `latest`).

Each final path gets a temporary sibling (``name.tmp-<pid>.ext``, same directory, so the rename is
atomic); they are renamed over the final names only after everything was written. Files that
belong together (a .bin and its .idx) are renamed in the given order, after removing any old
final files in the reverse order: put the file readers check first (the .idx) last, and a crash
between two renames leaves the set visibly incomplete instead of pairing a new file with an old one.
A killed process (SIGKILL) leaves only ``*.tmp-<pid>.*`` files, safe to delete.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from .diskspace import disk_full_named

__all__ = ["temp_path", "atomic_outputs", "replace_durably", "remove_quietly"]


def temp_path(final: str, tag: str | None = None) -> str:
    """``dir/name.tmp-<pid>.ext`` for ``dir/name.ext`` (``tag`` replaces ``tmp-<pid>``)."""
    tag = tag or f"tmp-{os.getpid()}"
    head, tail = os.path.split(final)
    stem, ext = os.path.splitext(tail)
    return os.path.join(head, f"{stem}.{tag}{ext}")


def remove_quietly(paths: Sequence[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def atomic_outputs(finals: Sequence[str], tag: str | None = None) -> Iterator[dict[str, str]]:
    """Yield {final: temporary path}; on success rename each temporary file over its final name
    (in order), on any exception (KeyboardInterrupt included) delete the temporary files. A full
    disk becomes one DiskFullError naming the directory, the files and the space left."""
    temps = {final: temp_path(final, tag) for final in finals}
    try:
        with disk_full_named(os.path.dirname(finals[0]) or ".", ", ".join(os.path.basename(f) for f in finals)):
            yield temps
        missing = [t for t in temps.values() if not os.path.exists(t)]
        if missing:
            raise FileNotFoundError(f"expected output {missing[0]!r} was not written")
    except BaseException:
        remove_quietly(list(temps.values()))
        raise
    remove_quietly(list(reversed(finals)))
    for final in finals:
        os.replace(temps[final], final)


def replace_durably(path: str, text: str) -> None:
    """`text` into `path` so that a reader finds the old file or the whole new one, never a part and
    never none (a checkpoint's metadata and its `latest` pointer): written to a temporary sibling,
    flushed to the disk, renamed over `path`. Unlike atomic_outputs, nothing is removed first. The
    caller names a full disk (disk_full_named) around it, as around its other writes."""
    tmp = temp_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly([tmp])
        raise
