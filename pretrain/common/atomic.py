"""Writing outputs so that an interrupted run never leaves one that looks complete: the project's
one atomic writer (atomic_outputs for files written by a program, atomic_output_set for files
whose names are learnt while writing, directory_output for a directory
written whole, such as an exported model, replace_durably for a small text file that must be
replaced in one step, such as a checkpoint's `latest`).

Each final path gets a temporary sibling (``name.tmp-<pid>.ext``, same directory, so the rename is
atomic); they are renamed over the final names only after everything was written. Files that
belong together (a .bin and its .idx) are renamed in the given order, after removing any old
final files in the reverse order: put the file readers check first (the .idx) last, and a crash
between two renames leaves the set visibly incomplete instead of pairing a new file with an old one.
A killed process (SIGKILL) leaves only ``*.tmp-<pid>.*`` files, safe to delete.

Whatever wrote a temporary file (safetensors writes 0600, tempfile's names are private too), the
final file gets the mode the user's umask gives a new file (0644 under umask 022) and a directory
renamed into place that of a new directory (0755): a colleague or a serving account reads an
exported model as it reads the user's other files.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import Iterator, Sequence

from .diskspace import disk_full_named

__all__ = ["temp_path", "atomic_outputs", "atomic_output_set", "AtomicOutputSet", "directory_output",
           "replace_durably", "remove_quietly", "umask", "honour_umask"]


def _proc_umask() -> int | None:
    """The umask the kernel reports for this process (Linux), without changing it."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def _umask_by_setting() -> int:
    """os.umask can only be read by setting it, which races with threads creating files: done
    once, at import, and only where the kernel does not report it."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_IMPORT_UMASK = _proc_umask()
if _IMPORT_UMASK is None:
    _IMPORT_UMASK = _umask_by_setting()


def umask() -> int:
    """This process's umask now, or where the kernel does not report it, the one it had at import."""
    found = _proc_umask()
    return _IMPORT_UMASK if found is None else found


def honour_umask(path: str) -> None:
    """Give `path`, and everything under it if it is a directory, the mode a new file or directory
    gets under the user's umask (0o666 & ~umask, 0o777 & ~umask); links are left alone."""
    mask = umask()
    entries = [path] + [os.path.join(root, name) for root, dirs, files in os.walk(path) for name in dirs + files]
    for entry in (e for e in entries if not os.path.islink(e)):
        wanted = (0o777 if os.path.isdir(entry) else 0o666) & ~mask
        if stat.S_IMODE(os.stat(entry).st_mode) != wanted:
            with contextlib.suppress(OSError):  # a file system without modes (some network mounts)
                os.chmod(entry, wanted)


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


class AtomicOutputSet:
    """atomic_outputs for outputs learnt while writing (one dataset per value of a column, say):
    ``temp(final)`` names the temporary file of each final path as it comes; the renames happen in
    that order, after the block (atomic_output_set)."""

    def __init__(self, tag: str | None = None):
        self.tag = tag
        self.temps: dict[str, str] = {}

    def temp(self, final: str) -> str:
        if final not in self.temps:
            self.temps[final] = temp_path(final, self.tag)
        return self.temps[final]


@contextlib.contextmanager
def atomic_output_set(directory: str, what: str, tag: str | None = None) -> Iterator[AtomicOutputSet]:
    """Yield an AtomicOutputSet; on success rename each temporary file over its final name (in the
    order they were named), on any exception (KeyboardInterrupt included) delete the temporary
    files. A full disk becomes one DiskFullError naming `directory`, `what` and the space left."""
    outputs = AtomicOutputSet(tag)
    try:
        with disk_full_named(directory, what):
            yield outputs
        missing = [t for t in outputs.temps.values() if not os.path.exists(t)]
        if missing:
            raise FileNotFoundError(f"expected output {missing[0]!r} was not written")
        for temp in outputs.temps.values():
            honour_umask(temp)
    except BaseException:
        remove_quietly(list(outputs.temps.values()))
        raise
    finals = list(outputs.temps)
    remove_quietly(list(reversed(finals)))
    for final in finals:
        os.replace(outputs.temps[final], final)


@contextlib.contextmanager
def atomic_outputs(finals: Sequence[str], tag: str | None = None) -> Iterator[dict[str, str]]:
    """Yield {final: temporary path}; on success rename each temporary file over its final name
    (in order), on any exception (KeyboardInterrupt included) delete the temporary files. A full
    disk becomes one DiskFullError naming the directory, the files and the space left."""
    what = ", ".join(os.path.basename(f) for f in finals)
    with atomic_output_set(os.path.dirname(finals[0]) or ".", what, tag) as outputs:
        yield {final: outputs.temp(final) for final in finals}


@contextlib.contextmanager
def directory_output(final: str, what: str) -> Iterator[str]:
    """Yield a temporary sibling directory to write `final` (absent, or an empty directory) in;
    when the block ends, give its contents the user's umask modes and rename it to `final`; on
    any exception remove it, leaving no output. A full disk becomes one DiskFullError naming
    `final` and `what`."""
    tmp = f"{final.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with disk_full_named(final, what):
            yield tmp
            honour_umask(tmp)
            if os.path.isdir(final):
                os.rmdir(final)  # empty: a non-empty one fails here rather than being replaced
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
