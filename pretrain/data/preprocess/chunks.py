"""What corpus.py and tables.py share: the error of a bad input, a chunk of an input file, and a
chunk's parsed documents with its counted problems."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...common.errors import UserError


class CorpusError(UserError, ValueError):
    """A problem with the input files (missing file, bad record under --strict, ...)."""


@dataclass(frozen=True)
class Chunk:
    """A record-aligned piece of one input file.

    ``data`` is None for an uncompressed file: the bytes are ``[start, end)`` of ``path``.
    For a compressed file ``data`` holds the decompressed bytes and ``start``/``end`` are the
    positions in the compressed file this chunk was cut between (for progress and partitioning).
    """

    file_index: int
    path: str
    index: int  # chunk number within its file
    start: int  # a table's chunk: its first row (from 0) and one past its last
    end: int
    data: bytes | None = None
    # a table's chunk: Parquet (row group, slice, rows per slice); Arrow its record batches (first, end)
    table: tuple[int, ...] | None = None
    disk: int | None = None  # a table's chunk: its bytes (for progress)

    @property
    def disk_bytes(self) -> int:
        return self.disk if self.disk is not None else self.end - self.start


@dataclass
class Problem:
    line: int  # 1-based, relative to the chunk until made absolute by the consumer
    kind: str  # one of PROBLEM_KINDS
    message: str


@dataclass
class ParsedChunk:
    """Documents of one chunk: ``documents[i][k]`` is the text of key ``keys[k]``."""

    documents: list[list[str]] = field(default_factory=list)
    lines: int = 0  # newline-terminated lines in the chunk (to number the next chunk's lines)
    problem_counts: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # the first few, in line order

    def add_problem(self, line: int, kind: str, message: str) -> None:
        self.problem_counts[kind] = self.problem_counts.get(kind, 0) + 1
        self.problems.append(Problem(line, kind, message))  # parse_chunk keeps the first few
