"""Read a UTF-8 text file whole, naming `file:line` when it is not UTF-8 (kept import-free).

Every reader of user text (fine-tuning tasks, feature extraction, fill-mask) goes through here,
so invalid bytes are one line naming where they are, never a UnicodeDecodeError traceback.
"""
from __future__ import annotations

import io


def read_text(path: str, error: type[Exception], what: str = "") -> str:
    """The text of `path`, line endings as they are (csv and JSON readers take it as it is).
    An unreadable file or invalid UTF-8 raises `error` with a one-line message; `what` prefixes
    the path (e.g. "--input-file ")."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise error(f"{what}{path}: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1)
        raise error(f"{what}{path}:{line}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte {column} of the "
                    "line); re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_lines(path: str, error: type[Exception], what: str = "") -> list[str]:
    """The lines of `path` without their ends, split as text-mode open() splits them (\\n, \\r\\n,
    \\r: not at U+2028 and the other breaks str.splitlines knows, which JSON strings may hold)."""
    lines = io.StringIO(read_text(path, error, what), newline=None).read().split("\n")
    if lines[-1] == "":
        lines.pop()  # the end of the last line, or an empty file
    return lines
