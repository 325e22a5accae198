"""Reading raw text corpora: input expansion, transparent decompression, record-aligned chunks,
and parsing a chunk into documents with every malformed line counted.

Inputs are files or globs; ``.gz``, ``.bz2``, ``.xz`` and ``.zst`` files are decompressed on the
fly. Five formats:

- ``jsonl``: one JSON object per line (Megatron's convention), the text under one or more keys;
- ``text-lines``: plain text, one document per line;
- ``text-blank-lines``: plain text, documents separated by blank lines (hard-wrapped lines of a
  document are kept together);
- ``parquet`` and ``arrow``: tables, the text in one or more string columns (tables.py): Parquet
  files or folders of shards, datasets saved by ``datasets.save_to_disk``.

Large inputs are cut into chunks of roughly ``chunk_bytes`` that end on a record boundary, so
that processes can work on chunks independently and no file is ever held in memory whole. An
uncompressed chunk is only a byte range: the worker reads it itself, which keeps the parent out
of the data path. A compressed stream cannot be seeked, so its chunks carry their bytes.

Line numbers: every chunk except a file's last ends right after a newline, so the line number of
a chunk's first line is one plus the newlines of the chunks before it in that file; workers report
lines relative to their chunk and the consumer (who sees chunks in order) makes them absolute.
"""
from __future__ import annotations

import bz2
import glob
import gzip
import io
import json
import lzma
import os
import re
from typing import BinaryIO, Iterator, Sequence

from .chunks import Chunk, CorpusError, ParsedChunk, Problem
from .tables import TABLE_FORMATS, expand_table_input, parse_table_chunk, table_chunks

__all__ = [
    "INPUT_FORMATS",
    "PROBLEM_KINDS",
    "CorpusError",
    "Chunk",
    "Problem",
    "ParsedChunk",
    "expand_inputs",
    "is_compressed",
    "open_decompressed",
    "iter_chunks",
    "layout_hint",
    "read_chunk",
    "parse_chunk",
    "iter_documents",
    "chunk_documents",
]

INPUT_FORMATS = ("jsonl", "text-lines", "text-blank-lines", *TABLE_FORMATS)
# What a skipped line can be counted as (the report keeps this order).
PROBLEM_KINDS = ("bad JSON", "missing key", "non-string value", "invalid UTF-8")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
DEFAULT_CHUNK_BYTES = 1 << 20
_GLOB_CHARS = re.compile(r"[*?\[]")
# A blank (whitespace-only) line preceded by a newline; documents of text-blank-lines end there.
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_MAX_PROBLEM_SAMPLES = 10  # per chunk; the report shows the first few overall anyway
# layout_hint reads this much of each plain-text input, and calls a line of at most _SHORT_LINE
# characters short (hard-wrapped text is wrapped at 60-80)
_SNIFF_BYTES = 64 << 10
_SHORT_LINE = 80
_SNIFF_MIN_LINES = 20


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def expand_inputs(patterns: Sequence[str], input_format: str | None = None) -> list[str]:
    """Files named by ``patterns`` (paths or globs), in the given order, each glob sorted; for the
    table formats a folder stands for its files (tables.expand_table_input).

    A path that does not exist, a glob that matches no file, or a directory (of a text format) is
    an error naming it; a file named twice is read once.
    """
    if not patterns:
        raise CorpusError("no input given")
    files: list[str] = []
    for pattern in patterns:
        if os.path.isdir(pattern) and input_format in TABLE_FORMATS:
            matched = expand_table_input(pattern, input_format)
        elif os.path.isdir(pattern):
            raise CorpusError(f"input {pattern!r} is a directory; give files or a glob such as {os.path.join(pattern, '*.jsonl')!r}")
        elif os.path.isfile(pattern):
            matched = [pattern]
        elif _GLOB_CHARS.search(pattern):
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise CorpusError(f"input glob {pattern!r} matches no file")
        else:
            raise CorpusError(f"input file {pattern!r} does not exist")
        for path in matched:
            if path not in files:
                files.append(path)
    for path in files:
        if not os.access(path, os.R_OK):
            raise CorpusError(f"input file {path!r} is not readable")
    return files


def is_compressed(path: str) -> bool:
    return path.endswith(COMPRESSED_SUFFIXES)


def open_decompressed(path: str) -> BinaryIO:
    """A binary stream of ``path``'s content, decompressed according to its suffix."""
    return _open_with_raw(path)[0]


def _open_with_raw(path: str) -> tuple[BinaryIO, BinaryIO]:
    """(decompressed stream, underlying file): the latter tells how far into the file we are."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if path.endswith(".bz2"):
        return bz2.BZ2File(raw, "rb"), raw
    if path.endswith(".xz"):
        return lzma.LZMAFile(raw, "rb"), raw
    if path.endswith(".zst"):
        import zstandard  # only needed for .zst inputs

        # read_across_frames: files made by concatenating .zst files (or by pzstd) have many frames
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, buffer_size=1 << 20), raw
    return raw, raw


def layout_hint(path: str, input_format: str) -> str | None:
    """A warning when the start of a plain-text input fits the other plain-text format better:
    hard-wrapped text (mostly short lines in blocks separated by blank lines) read as
    text-lines, which makes every line a document; or text without any blank line read as
    text-blank-lines, which makes all of it one document. Reads the first 64 KiB only."""
    if input_format not in ("text-lines", "text-blank-lines"):
        return None
    try:
        with open_decompressed(path) as f:
            head = f.read(_SNIFF_BYTES)
    except Exception:  # any decompressor's own error: reading the file in earnest names it
        return None
    lines = head.decode("utf-8", errors="replace").split("\n")
    if len(head) == _SNIFF_BYTES:
        lines = lines[:-1]  # cut short
    texts = [line.rstrip() for line in lines if line.strip()]
    if len(texts) < _SNIFF_MIN_LINES:
        return None
    blocks = sum(1 for i, line in enumerate(lines) if line.strip() and (i == 0 or not lines[i - 1].strip()))
    short = sum(len(text) <= _SHORT_LINE for text in texts)
    if input_format == "text-lines" and blocks > 1 and short >= 0.8 * len(texts) and len(texts) >= 3 * blocks:
        return (f"{path} looks hard-wrapped: {short} of its first {len(texts)} lines have at most {_SHORT_LINE} "
                f"characters, in {blocks} blocks separated by blank lines. --input-format text-lines makes every "
                "line a document; --input-format text-blank-lines makes every block (paragraph) one")
    if input_format == "text-blank-lines" and blocks == 1:
        return (f"{path} has no blank line in its first {len(texts)} lines: --input-format text-blank-lines "
                "reads them all as one document (documents end at blank lines); if every line is a document, "
                "--input-format text-lines fits")
    return None


# --------------------------------------------------------------------------------------------
# Chunks
# --------------------------------------------------------------------------------------------


def read_chunk(chunk: Chunk) -> bytes:
    """The chunk's bytes (read from disk for an uncompressed file)."""
    if chunk.data is not None:
        return chunk.data
    with open(chunk.path, "rb") as f:
        f.seek(chunk.start)
        return f.read(chunk.end - chunk.start)


def iter_chunks(paths: Sequence[str], input_format: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """Record-aligned chunks of every file in order. Memory: about one chunk (two for a record
    longer than a chunk)."""
    if input_format not in INPUT_FORMATS:
        raise CorpusError(f"unknown input format {input_format!r}; expected one of {', '.join(INPUT_FORMATS)}")
    for file_index, path in enumerate(paths):
        if input_format in TABLE_FORMATS:
            yield from table_chunks(file_index, path, input_format, chunk_bytes)
        elif is_compressed(path):
            yield from _compressed_chunks(file_index, path, input_format, chunk_bytes)
        else:
            yield from _file_chunks(file_index, path, input_format, chunk_bytes)


def _file_chunks(file_index: int, path: str, input_format: str, chunk_bytes: int) -> Iterator[Chunk]:
    size = os.path.getsize(path)
    start, index = 0, 0
    with open(path, "rb") as f:
        while start < size:
            end = _next_boundary(f, start + chunk_bytes, input_format, size)
            yield Chunk(file_index, path, index, start, end)
            start, index = end, index + 1


def _next_boundary(f: BinaryIO, pos: int, input_format: str, size: int) -> int:
    """The first record boundary at or after ``pos``: the start of a line for the line formats;
    the start of a line that follows a blank line for text-blank-lines."""
    if pos >= size:
        return size
    f.seek(pos - 1)
    f.readline()  # finish the line that pos falls in (a no-op read of b"\n" if pos starts a line)
    if input_format != "text-blank-lines":
        return f.tell()
    while True:
        line = f.readline()
        if not line:
            return size
        if not line.strip():
            return f.tell()


def _compressed_chunks(file_index: int, path: str, input_format: str, chunk_bytes: int) -> Iterator[Chunk]:
    raw_size = os.path.getsize(path)
    index, raw_start, carry = 0, 0, b""
    stream, raw = _open_with_raw(path)
    try:
        while True:
            try:
                block = stream.read(chunk_bytes)
            except Exception as e:  # zlib/bz2/lzma/zstd each raise their own kind
                raise CorpusError(f"{path}: corrupt compressed data: {e}") from None
            if not block:
                break
            buf = carry + block
            cut = _last_boundary(buf, input_format)
            if cut <= 0:
                carry = buf  # one record longer than a chunk: keep reading
                continue
            raw_end = max(raw_start, min(raw_size, raw.tell()))
            yield Chunk(file_index, path, index, raw_start, raw_end, buf[:cut])
            carry, raw_start, index = buf[cut:], raw_end, index + 1
        if carry or raw_start < raw_size:
            # the rest (a last line without newline), and the file's remaining bytes on disk
            yield Chunk(file_index, path, index, raw_start, raw_size, carry)
    finally:
        stream.close()
        raw.close()


def _last_boundary(buf: bytes, input_format: str) -> int:
    """Position just after the last record end in ``buf`` (0 if none)."""
    if input_format != "text-blank-lines":
        return buf.rfind(b"\n") + 1
    last = None
    for last in _BLANK_LINE.finditer(buf):
        pass
    return last.end() if last is not None else 0


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def parse_chunk(data: bytes, input_format: str, keys: Sequence[str], strip_bom: bool = False) -> ParsedChunk:
    """Documents of a chunk. A malformed line is skipped and counted (for text-blank-lines, the
    document containing it is skipped). ``keys`` are the JSON keys (the text formats have one
    field)."""
    result = ParsedChunk(lines=data.count(b"\n"))
    if strip_bom and data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = _decode_lines(data, result)
    if input_format == "jsonl":
        _parse_jsonl(lines, keys, result)
    elif input_format == "text-lines":
        result.documents = [[text] for _, text in lines if text is not None]
    elif input_format == "text-blank-lines":
        _parse_blank_lines(lines, result)
    else:
        raise CorpusError(f"unknown input format {input_format!r}")
    # bad UTF-8 is found before bad JSON: put them in line order, then keep the first few
    result.problems = sorted(result.problems, key=lambda p: p.line)[:_MAX_PROBLEM_SAMPLES]
    return result


def _decode_lines(data: bytes, result: ParsedChunk) -> list[tuple[int, str | None]]:
    """(line number, text) per line, text None for a line that is not valid UTF-8 (counted).
    Splits on \\n only: JSON strings may hold U+2028 and friends, which str.splitlines cuts at."""
    if data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        return []
    try:
        texts = data.decode("utf-8").split("\n")
        return [(n, t[:-1] if t.endswith("\r") else t) for n, t in enumerate(texts, 1)]
    except UnicodeDecodeError:
        pass  # rare: find the bad lines one by one
    lines: list[tuple[int, str | None]] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            result.add_problem(n, "invalid UTF-8", f"invalid UTF-8 at byte {e.start} of the line")
            lines.append((n, None))
            continue
        lines.append((n, text[:-1] if text.endswith("\r") else text))
    return lines


def _parse_jsonl(lines: list[tuple[int, str | None]], keys: Sequence[str], result: ParsedChunk) -> None:
    loads = json.loads
    for n, text in lines:
        if text is None or not text.strip():
            continue  # blank lines are not records; bad UTF-8 was counted already
        try:
            record = loads(text)
        except ValueError as e:
            result.add_problem(n, "bad JSON", f"bad JSON: {e}")
            continue
        if not isinstance(record, dict):
            result.add_problem(n, "bad JSON", f"bad JSON: expected an object, got {type(record).__name__}")
            continue
        values = []
        for key in keys:
            if key not in record:
                result.add_problem(n, "missing key", f"missing key {key!r}")
                break
            value = record[key]
            if not isinstance(value, str):
                result.add_problem(n, "non-string value", f"non-string value for key {key!r} ({type(value).__name__})")
                break
            if "\\u" in text and not _encodable(value):
                result.add_problem(n, "invalid UTF-8", f"key {key!r} holds a lone surrogate escape (not encodable as UTF-8)")
                break
            values.append(value)
        else:
            result.documents.append(values)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _parse_blank_lines(lines: list[tuple[int, str | None]], result: ParsedChunk) -> None:
    block: list[str] = []
    bad = False
    for _, text in lines + [(0, "")]:  # a final blank line flushes the last document
        if text is None:
            bad = True  # the document is skipped; its bad line was counted
        elif text.strip():
            block.append(text)
        else:
            if block and not bad:
                result.documents.append(["\n".join(block)])
            block, bad = [], False


def locate(chunk: Chunk, number: int, message: str) -> str:
    """A problem's place: file:line, or file: row N of a table."""
    if chunk.table is not None:
        return f"{chunk.path}: row {number}: {message}"
    return f"{chunk.path}:{number}: {message}"


def chunk_documents(chunk: Chunk, input_format: str, keys: Sequence[str],
                    group_by: str | None = None) -> tuple[ParsedChunk, int]:
    """(the chunk's documents, its bytes of text), whatever its format; with group_by (a JSON key
    or a column, jsonl and tables only), each document's value of it last."""
    if input_format in TABLE_FORMATS:
        return parse_table_chunk(chunk, input_format, keys, group_by)
    data = read_chunk(chunk)
    names = [*keys, group_by] if group_by else keys
    return parse_chunk(data, input_format, names, strip_bom=chunk.index == 0), len(data)


def iter_documents(paths: Sequence[str], input_format: str, keys: Sequence[str],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[Chunk, ParsedChunk]]:
    """Parsed chunks of all files in order, in this process (for tools that need no workers)."""
    for chunk in iter_chunks(paths, input_format, chunk_bytes):
        yield chunk, chunk_documents(chunk, input_format, keys)[0]
