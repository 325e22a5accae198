"""Megatron indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``): checked opening, and a
builder whose memory does not grow with the dataset.

Format (megatron-core ``IndexedDataset``, version 1): the .bin is all token ids back to back in
one dtype; the .idx is ``MMIDIDX\\0\\0``, version (u64 = 1), dtype code (u8), sequence count S
(u64), document count D (u64), then S int32 sequence lengths, S int64 byte offsets into the .bin,
D int64 document boundaries (sequence indices, the first 0, the last S), and optionally S int8
modes (multimodal datasets only). A "sequence" is one sentence (or one whole document when
sentences were not split).

``open_indexed_dataset`` checks all of that before handing the files to megatron-core's reader,
which would otherwise fail with an assertion or, for a truncated .bin, read garbage past its end.
``StreamingIndexedDatasetBuilder`` is megatron-core's ``IndexedDatasetBuilder`` with the index
kept in temporary files instead of Python lists: the same output, byte for byte, in constant
memory (Megatron's lists cost about 40 bytes per sentence, and finalize() doubles that).
"""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np

from ...common.errors import UserError
from ...distributed.megatron_core import indexed_dataset
from .fingerprint import fingerprint_problem

DType, IndexedDataset, IndexedDatasetBuilder = (indexed_dataset.DType, indexed_dataset.IndexedDataset,
                                                indexed_dataset.IndexedDatasetBuilder)
get_bin_path, get_idx_path = indexed_dataset.get_bin_path, indexed_dataset.get_idx_path

__all__ = [
    "DataError",
    "IndexHeader",
    "DatasetStats",
    "read_index_header",
    "validate_indexed_dataset",
    "open_indexed_dataset",
    "dataset_statistics",
    "dtype_for_vocab",
    "StreamingIndexedDatasetBuilder",
    "get_bin_path",
    "get_idx_path",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
_TOKEN_DTYPES = {DType.uint8, DType.int8, DType.int16, DType.int32, DType.int64, DType.uint16}
_BLOCK = 1 << 22  # index entries handled at a time: bounds memory for any dataset size
_COPY_BYTES = 16 << 20


class DataError(UserError, ValueError):
    """A dataset file that cannot be used, naming the file and the problem."""


# --------------------------------------------------------------------------------------------
# Reading and checking
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexHeader:
    idx_path: str
    dtype: type  # numpy scalar type of the token ids
    sequence_count: int
    document_count: int  # entries of the document index (= documents + 1)
    multimodal: bool  # per-sequence modes present

    @property
    def documents(self) -> int:
        return self.document_count - 1

    @property
    def lengths_offset(self) -> int:
        return HEADER_BYTES

    @property
    def pointers_offset(self) -> int:
        return HEADER_BYTES + 4 * self.sequence_count

    @property
    def documents_offset(self) -> int:
        return HEADER_BYTES + 12 * self.sequence_count


def read_index_header(idx_path: str) -> IndexHeader:
    """The header of a .idx file, checked against the file's size."""
    try:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise DataError(f"{idx_path}: index file does not exist") from None
    except OSError as e:
        raise DataError(f"{idx_path}: cannot read: {e.strerror}") from None
    if not head.startswith(INDEX_MAGIC[: len(head)]) or len(head) < len(INDEX_MAGIC):
        if len(head) < len(INDEX_MAGIC) and INDEX_MAGIC.startswith(head):
            raise DataError(f"{idx_path}: truncated index file ({size} bytes)")
        raise DataError(f"{idx_path}: not a Megatron indexed-dataset index (starts with {head[:9]!r}, "
                        f"expected {INDEX_MAGIC!r})")
    if len(head) < HEADER_BYTES:
        raise DataError(f"{idx_path}: truncated index file ({size} bytes; the header alone has {HEADER_BYTES})")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_MAGIC):])
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: index format version {version}; only version {INDEX_VERSION} is supported")
    try:
        dtype_enum = DType(code)
    except ValueError:
        raise DataError(f"{idx_path}: unknown token dtype code {code}") from None
    if dtype_enum not in _TOKEN_DTYPES:
        raise DataError(f"{idx_path}: token dtype {dtype_enum.name} is not an integer type")
    expected = HEADER_BYTES + 12 * sequences + 8 * documents
    if size not in (expected, expected + sequences) or documents < 1:
        raise DataError(f"{idx_path}: truncated or corrupt index: {sequences} sequences and {documents} document "
                        f"boundaries need {expected} bytes, the file has {size}")
    return IndexHeader(idx_path, DType.dtype_from_code(code), sequences, documents,
                       multimodal=sequences > 0 and size == expected + sequences)


def _read_at(f: BinaryIO, offset: int, dtype: type, count: int) -> np.ndarray:
    f.seek(offset)
    itemsize = np.dtype(dtype).itemsize
    block = np.frombuffer(f.read(count * itemsize), dtype=dtype)
    if len(block) != count:
        raise DataError(f"{getattr(f, 'name', '?')}: truncated while reading")
    return block


def _blocks(f: BinaryIO, offset: int, dtype: type, count: int) -> Iterator[np.ndarray]:
    """``count`` values of ``dtype`` from ``offset`` in blocks of at most _BLOCK."""
    itemsize = np.dtype(dtype).itemsize
    for start in range(0, count, _BLOCK):
        yield _read_at(f, offset + start * itemsize, dtype, min(_BLOCK, count - start))


def validate_indexed_dataset(prefix: str) -> IndexHeader:
    """Check ``prefix``.idx and ``prefix``.bin belong together and are complete; DataError if not.

    Reads the whole index in bounded blocks: lengths non-negative, byte offsets consistent with
    them, document boundaries from 0 to S without going back, and the .bin's size equal to the
    sum of lengths times the dtype's size. Then both files' sampled contents against the
    fingerprint preprocessing wrote (fingerprint.py), when there is one.
    """
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    if not os.path.exists(idx_path) and not os.path.exists(bin_path):
        raise DataError(f"{prefix}: no dataset there ({bin_path} and {idx_path} do not exist)")
    header = read_index_header(idx_path)
    try:
        bin_size = os.path.getsize(bin_path)
    except FileNotFoundError:
        raise DataError(f"{bin_path}: data file does not exist (its index {idx_path} does)") from None
    itemsize = np.dtype(header.dtype).itemsize
    position = 0  # bytes of the sequences checked so far
    with open(idx_path, "rb") as f:
        for start in range(0, header.sequence_count, _BLOCK):
            n = min(_BLOCK, header.sequence_count - start)
            lengths = _read_at(f, header.lengths_offset + 4 * start, np.int32, n)
            pointers = _read_at(f, header.pointers_offset + 8 * start, np.int64, n)
            if lengths.min() < 0:
                raise DataError(f"{idx_path}: corrupt index (negative sequence length)")
            ends = position + np.cumsum(lengths, dtype=np.int64) * itemsize
            if pointers[0] != position or not np.array_equal(pointers[1:], ends[:-1]):
                raise DataError(f"{idx_path}: corrupt index (sequence offsets disagree with sequence lengths)")
            position = int(ends[-1])
        if bin_size != position:
            raise DataError(f"{bin_path}: {bin_size} bytes, but {idx_path} describes {position // itemsize} tokens "
                            f"of {np.dtype(header.dtype).name} = {position} bytes (a truncated or foreign .bin)")
        previous = 0
        for i, block in enumerate(_blocks(f, header.documents_offset, np.int64, header.document_count)):
            if (i == 0 and block[0] != 0) or block[0] < previous or np.any(np.diff(block) < 0) \
                    or block[-1] > header.sequence_count:
                raise DataError(f"{idx_path}: corrupt index (document boundaries out of order or out of range)")
            previous = int(block[-1])
        if previous != header.sequence_count:
            raise DataError(f"{idx_path}: corrupt index (the last document ends at sequence {previous}, "
                            f"not at the last sequence {header.sequence_count})")
    problem = fingerprint_problem(prefix, bin_path, idx_path)  # contents: a foreign .idx of the same length
    if problem:
        raise DataError(problem)
    return header


def open_indexed_dataset(prefix: str) -> IndexedDataset:
    """megatron-core's IndexedDataset for ``prefix`` after validate_indexed_dataset; DataError
    naming the file if the pair is missing, truncated, foreign, inconsistent or empty."""
    header = validate_indexed_dataset(prefix)
    if os.path.getsize(get_bin_path(prefix)) == 0:
        raise DataError(f"{get_bin_path(prefix)}: the dataset holds no tokens")  # and an empty file cannot be mapped
    return IndexedDataset(prefix, multimodal=header.multimodal, mmap=True)


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> type:
    """The token dtype: megatron-core's choice for the vocabulary size ("auto": uint16 below
    65500 entries, else int32) or the requested one, which must hold every id."""
    if requested == "auto":
        return DType.optimal_dtype(vocab_size)
    try:
        dtype = np.dtype(requested).type
        DType.code_from_dtype(dtype)
    except (TypeError, KeyError):
        raise DataError(f"unknown dtype {requested!r}; expected auto, uint16, int32 or int64") from None
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(f"a vocabulary of {vocab_size} tokens (ids up to {vocab_size - 1}) does not fit {requested} "
                        f"(max {np.iinfo(dtype).max}); use --dtype auto or a wider type")
    return dtype


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@dataclass
class DatasetStats:
    prefix: str
    dtype: str
    documents: int
    sentences: int
    tokens: int
    empty_documents: int
    sentences_per_document: tuple[int, float, int]  # min, mean, max (over all documents)
    tokens_per_sentence: tuple[int, float, int]
    bin_bytes: int
    idx_bytes: int


def dataset_statistics(prefix: str) -> DatasetStats:
    """Counts and min/mean/max of a validated dataset, in bounded memory."""
    header = validate_indexed_dataset(prefix)
    s_min, s_max, tokens = None, 0, 0
    d_min, d_max, empty = None, 0, 0
    with open(header.idx_path, "rb") as f:
        for block in _blocks(f, header.lengths_offset, np.int32, header.sequence_count):
            tokens += int(block.sum(dtype=np.int64))
            s_min = int(block.min()) if s_min is None else min(s_min, int(block.min()))
            s_max = max(s_max, int(block.max()))
        previous = None
        for block in _blocks(f, header.documents_offset, np.int64, header.document_count):
            edges = block if previous is None else np.concatenate(([previous], block))
            counts = np.diff(edges)
            if counts.size:
                d_min = int(counts.min()) if d_min is None else min(d_min, int(counts.min()))
                d_max = max(d_max, int(counts.max()))
                empty += int(np.count_nonzero(counts == 0))
            previous = int(block[-1])
    documents, sentences = header.documents, header.sequence_count
    return DatasetStats(
        prefix=prefix,
        dtype=np.dtype(header.dtype).name,
        documents=documents,
        sentences=sentences,
        tokens=tokens,
        empty_documents=empty,
        sentences_per_document=(d_min or 0, sentences / documents if documents else 0.0, d_max),
        tokens_per_sentence=(s_min or 0, tokens / sentences if sentences else 0.0, s_max),
        bin_bytes=os.path.getsize(get_bin_path(prefix)),
        idx_bytes=os.path.getsize(header.idx_path),
    )


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class StreamingIndexedDatasetBuilder(IndexedDatasetBuilder):
    """megatron-core's IndexedDatasetBuilder (same methods, same files) with the index spilled to
    two temporary files next to the output instead of growing Python lists, plus
    ``add_sequences`` to append many sentences at once.

    Temporary index files are unnamed (they vanish with the process). Call ``finalize`` to write
    the .idx, or ``close`` to abandon the build.
    """

    _FLUSH = 1 << 16

    def __init__(self, bin_path: str, dtype: type = np.int32, multimodal: bool = False,
                 scratch_dir: str | None = None) -> None:
        if multimodal:
            raise NotImplementedError("multimodal datasets are not supported")
        super().__init__(bin_path, dtype=dtype, multimodal=False)
        scratch = scratch_dir or os.path.dirname(os.path.abspath(bin_path))
        self._lengths_file = tempfile.TemporaryFile(dir=scratch, prefix=".index-lengths-")
        self._documents_file = tempfile.TemporaryFile(dir=scratch, prefix=".index-documents-")
        # Megatron's lists are not used; None makes accidental use fail loudly.
        self.sequence_lengths = None
        self.document_indices = None
        self._pending_lengths: list[int] = []
        self._pending_documents: list[int] = []
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0

    # -- megatron-core's interface
    def add_item(self, tensor, mode: int = 0) -> None:
        array = np.array(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=self.dtype)
        self.data_file.write(array.tobytes(order="C"))
        self._pending_lengths.append(array.size)
        self.num_sequences += 1
        self.num_tokens += array.size
        if len(self._pending_lengths) >= self._FLUSH:
            self._flush()

    def end_document(self) -> None:
        self.num_documents += 1
        self._pending_documents.append(self.num_sequences)
        if len(self._pending_documents) >= self._FLUSH:
            self._flush()

    def add_document(self, tensor, lengths, modes=None) -> None:
        array = np.array(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.add_sequences(array.reshape(-1), lengths, np.array([len(lengths)]))

    def add_index(self, path_prefix: str) -> None:
        header = validate_indexed_dataset(path_prefix)
        if header.dtype != self.dtype:
            raise DataError(f"{path_prefix}: token dtype {np.dtype(header.dtype).name} differs from the "
                            f"{np.dtype(self.dtype).name} of the dataset being written")
        self._flush()
        offset = self.num_sequences
        with open(header.idx_path, "rb") as f:
            for block in _blocks(f, header.lengths_offset, np.int32, header.sequence_count):
                self._lengths_file.write(block.tobytes())
                self.num_tokens += int(block.sum(dtype=np.int64))
            first = True
            for block in _blocks(f, header.documents_offset, np.int64, header.document_count):
                if first:
                    block, first = block[1:], False  # the leading 0 of every index
                self._documents_file.write((block + offset).tobytes())
        self.num_sequences += header.sequence_count
        self.num_documents += header.documents
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file, _COPY_BYTES)

    def finalize(self, idx_path: str) -> None:
        self._flush()
        self.data_file.close()
        itemsize = np.dtype(self.dtype).itemsize
        with open(idx_path, "wb") as out:
            out.write(INDEX_MAGIC)
            out.write(struct.pack("<Q", INDEX_VERSION))
            out.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
            out.write(struct.pack("<Q", self.num_sequences))
            out.write(struct.pack("<Q", self.num_documents + 1))
            for block in _blocks(self._lengths_file, 0, np.int32, self.num_sequences):
                out.write(block.tobytes())
            position = 0
            for block in _blocks(self._lengths_file, 0, np.int32, self.num_sequences):
                ends = position + np.cumsum(block, dtype=np.int64) * itemsize
                out.write(np.concatenate(([position], ends[:-1])).astype(np.int64).tobytes())
                position = int(ends[-1])
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            self._documents_file.seek(0)
            shutil.copyfileobj(self._documents_file, out, _COPY_BYTES)
        self.close()

    # -- bulk interface
    def add_sequences(self, ids: np.ndarray, lengths: np.ndarray, document_sizes: np.ndarray) -> None:
        """Append sentences: ``ids`` all their tokens back to back (already in this builder's
        dtype), ``lengths`` tokens per sentence, ``document_sizes`` sentences per document (they
        sum to len(lengths); each document is ended)."""
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        self._flush()
        self.data_file.write(memoryview(ids).cast("B"))
        self._lengths_file.write(np.asarray(lengths, dtype=np.int32).tobytes())
        ends = self.num_sequences + np.cumsum(document_sizes, dtype=np.int64)
        self._documents_file.write(ends.tobytes())
        self.num_sequences += len(lengths)
        self.num_documents += len(document_sizes)
        self.num_tokens += ids.size

    def close(self) -> None:
        """Release the files without writing an index (an abandoned build)."""
        for f in (self.data_file, self._lengths_file, self._documents_file):
            if not f.closed:
                f.close()

    def _flush(self) -> None:
        if self._pending_lengths:
            self._lengths_file.write(np.asarray(self._pending_lengths, dtype=np.int32).tobytes())
            self._pending_lengths.clear()
        if self._pending_documents:
            self._documents_file.write(np.asarray(self._pending_documents, dtype=np.int64).tobytes())
            self._pending_documents.clear()
