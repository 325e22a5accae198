"""Reading corpora stored as tables: Parquet files (or folders of shards) and Hugging Face datasets
saved with `datasets.save_to_disk` (Arrow IPC stream files), the text in one or more string columns,
and optionally a column whose values (a language, a source) each get their own dataset.

A table is read in record batches through pyarrow, never whole. A Parquet file's chunks are
slices of its row groups of about chunk_bytes of text: the worker of slice k streams the row
group's batches and keeps the k-th (decoding the ones before it costs little beside tokenizing).
An Arrow file's chunks are runs of its record batches of about chunk_bytes (the file is
memory-mapped, so a worker skips to its batches without reading the ones before). A chunk's rows
are numbered from 1 within it, and the consumer makes them absolute, as corpus.py's lines.

What is wrong with a shard is named with its file (and its row group or rows): an unreadable
file, a missing text column (with the columns it has), a column that is not text. A null in the
text column skips that row, counted and named by its row.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Sequence

from .chunks import Chunk, CorpusError, ParsedChunk

TABLE_FORMATS = ("parquet", "arrow")
BATCH_ROWS = 8192  # rows decoded at a time within a chunk
PARQUET_EXTRA = "pip install 'bert-pretrain[parquet]'"


def _pyarrow(path: str):
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError(f"{path}: reading Parquet or Arrow needs pyarrow, which is not installed: "
                          f"{PARQUET_EXTRA}") from None
    return pa, pc, pq


# ----------------------------------------------------------------------------- inputs
def expand_table_input(path: str, input_format: str) -> list[str]:
    """The files of a folder input: a Parquet folder's *.parquet shards (sorted, recursively), a
    saved dataset's Arrow files (its state.json's order)."""
    if input_format == "parquet":
        shards = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
        if not shards:
            raise CorpusError(f"input folder {path!r} holds no .parquet file")
        return shards
    state, splits = os.path.join(path, "state.json"), os.path.join(path, "dataset_dict.json")
    if os.path.isfile(splits):
        with open(splits) as f:
            names = json.load(f).get("splits", [])
        raise CorpusError(f"input {path!r} is a saved DatasetDict (splits: {', '.join(names)}): give one split's "
                          f"folder, such as {os.path.join(path, names[0] if names else 'train')!r}")
    if not os.path.isfile(state):
        raise CorpusError(f"input folder {path!r} is no dataset saved by datasets.save_to_disk (no state.json)")
    try:
        with open(state) as f:
            files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as error:
        raise CorpusError(f"{state}: not a datasets state file ({error})") from None
    return [os.path.join(path, name) for name in files]


# ----------------------------------------------------------------------------- chunks
def table_chunks(file_index: int, path: str, input_format: str, chunk_bytes: int) -> Iterator:
    """Chunks of one table file: Parquet row groups; runs of Arrow record batches of about chunk_bytes."""
    if input_format == "parquet":
        source = _open_parquet(path)
        row, index = 0, 0
        for group in range(source.metadata.num_row_groups):
            meta = source.metadata.row_group(group)
            slices = max(1, min(meta.num_rows, -(-meta.total_byte_size // chunk_bytes)))
            per = -(-meta.num_rows // slices)
            for k, first in enumerate(range(0, meta.num_rows, per)):
                rows = min(per, meta.num_rows - first)
                yield Chunk(file_index, path, index, row + first, row + first + rows, table=(group, k, per),
                            disk=meta.total_byte_size * rows // max(meta.num_rows, 1))
                index += 1
            row += meta.num_rows
        return
    row, first, rows, size, index = 0, 0, 0, 0, 0
    batches = 0
    for batches, batch in enumerate(_arrow_batches(path), 1):
        rows, size = rows + batch.num_rows, size + batch.nbytes
        if size >= chunk_bytes:
            yield Chunk(file_index, path, index, row, row + rows, table=(first, batches), disk=size)
            row, first, rows, size, index = row + rows, batches, 0, 0, index + 1
    if batches > first:
        yield Chunk(file_index, path, index, row, row + rows, table=(first, batches), disk=size)


def _open_parquet(path: str):
    _, _, pq = _pyarrow(path)
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow's ArrowInvalid, OSError: the file is not Parquet
        raise CorpusError(f"{path}: not a readable Parquet file ({error})") from None


def _arrow_batches(path: str):
    pa, _, _ = _pyarrow(path)
    try:
        reader = pa.ipc.open_stream(pa.memory_map(path))
    except Exception as error:
        raise CorpusError(f"{path}: not a readable Arrow stream file ({error})") from None
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except Exception as error:
            raise CorpusError(f"{path}: unreadable record batch ({error})") from None
        yield batch


# ----------------------------------------------------------------------------- parsing
def parse_table_chunk(chunk, input_format: str, keys: Sequence[str], group_by: str | None = None):
    """(ParsedChunk, text bytes) of one table chunk: per row, the text of each key's column (and
    last, with group_by, the value of that column); a row with a null in one of them skipped and
    counted. A group column may be dictionary-encoded, as Parquet writers often store a language."""
    pa, pc, _ = _pyarrow(chunk.path)
    result = ParsedChunk(lines=chunk.end - chunk.start)
    names = [*keys, group_by] if group_by else list(keys)
    text_bytes, row = 0, 0
    for batch in _chunk_batches(chunk, input_format, names):
        columns = []
        for name in names:
            if name not in batch.schema.names:
                raise CorpusError(f"{chunk.path}: no column {name!r} (it has {', '.join(batch.schema.names)}): "
                                  + ("name the group column with --group-by" if name == group_by else
                                     "name the text column with --json-keys"))
            column = batch.column(name)
            kind = column.type.value_type if pa.types.is_dictionary(column.type) and name == group_by else column.type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise CorpusError(f"{chunk.path}: column {name!r} holds {column.type}, not text")
            if name != group_by:
                text_bytes += int(pc.sum(pc.binary_length(column)).as_py() or 0)
            columns.append(column.to_pylist())
        for values in zip(*columns):
            row += 1
            missing = [name for name, value in zip(names, values) if value is None]
            if missing:
                result.add_problem(row, "non-string value", f"null in column {missing[0]!r}")
                continue
            result.documents.append(list(values))
    result.problems = result.problems[:10]
    return result, text_bytes


def _chunk_batches(chunk, input_format: str, keys: Sequence[str]):
    where = f"{chunk.path}: rows {chunk.start + 1}-{chunk.end}"
    if input_format == "parquet":
        group, wanted, rows = chunk.table
        source = _open_parquet(chunk.path)
        names = source.schema_arrow.names
        missing = [key for key in keys if key not in names]
        if missing:
            raise CorpusError(f"{chunk.path}: no column {missing[0]!r} (it has {', '.join(names)}): "
                              "name the text column with --json-keys (and a group column with --group-by)")
        try:
            for k, batch in enumerate(source.iter_batches(batch_size=rows, row_groups=[group], columns=list(keys))):
                if k == wanted:
                    for start in range(0, batch.num_rows, BATCH_ROWS):
                        yield batch.slice(start, BATCH_ROWS)
                    return
        except Exception as error:
            raise CorpusError(f"{where} (row group {group}) are unreadable ({error})") from None
        return
    first, end = chunk.table
    for index, batch in enumerate(_arrow_batches(chunk.path)):
        if index >= end:
            return
        if index >= first:
            yield batch
