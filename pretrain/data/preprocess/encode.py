"""The worker side of preprocessing: one chunk of raw input -> token ids, sentence lengths and
document sizes, ready to append to an indexed dataset.

Runs in worker processes, so it imports neither torch nor megatron-core (a worker starts in a
fraction of a second and stays small). Per chunk: parse the records (corpus.parse_chunk), split
each document into sentences with blingfire (optional), batch-encode all sentences of the chunk
with Hugging Face tokenizers on this process's single thread, drop sentences without tokens and
documents without sentences (counted), and pack the ids into one array of the output dtype.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from itertools import chain
from typing import Sequence

import numpy as np

from .corpus import Chunk, Problem, chunk_documents
from .dataset_record import TokenCounts, count_tokens

__all__ = ["EncodeOptions", "EncodedField", "EncodedChunk", "SentenceSplitter", "ChunkEncoder"]


@dataclass(frozen=True)
class EncodeOptions:
    tokenizer_path: str  # a tokenizer.json (a file keeps the workers' start-up data small)
    input_format: str
    keys: tuple[str, ...]
    dtype: str  # numpy name of the output dtype
    split_sentences: bool = False
    keep_newlines: bool = False  # line breaks inside a document end sentences
    append_eod: bool = False
    eod_id: int | None = None  # appended to each document's last sentence with append_eod
    special_ids: tuple[int, ...] = ()  # counted (dataset_record.TokenCounts)
    pad_id: int = 0
    group_by: str | None = None  # a JSON key or column: one output per value (pipeline.py)


@dataclass
class EncodedField:
    """One JSON key's output for a chunk."""

    ids: np.ndarray  # all tokens, sentence after sentence
    lengths: np.ndarray  # int32 tokens per sentence
    document_sizes: np.ndarray  # int64 sentences per document
    empty_documents: int = 0  # documents dropped for having no tokens
    counts: TokenCounts = field(default_factory=TokenCounts)


@dataclass
class EncodedChunk:
    chunk: Chunk  # without its data (not sent back)
    # (key, group value) -> the output's part of the chunk; the value is None without group_by, and a
    # group's documents keep their input order
    fields: dict[tuple[str, str | None], EncodedField]
    records: int  # documents read (before dropping empty ones)
    lines: int
    text_bytes: int  # decompressed input bytes
    problem_counts: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)


class SentenceSplitter:
    """blingfire's sentence splitter (``blingfire.text_to_sentences``) with one reusable output
    buffer: blingfire's wrapper allocates a fresh buffer per call, which took 40% of its time on
    paragraph-sized documents.

    blingfire treats line breaks as spaces; with ``keep_newlines`` every line is split on its
    own, so a line break always ends a sentence.
    """

    def __init__(self, keep_newlines: bool = False):
        import ctypes

        import blingfire

        self.keep_newlines = keep_newlines
        self._ctypes = ctypes
        self._text_to_sentences = blingfire.blingfire.TextToSentences  # the C function
        self._buffer = ctypes.create_string_buffer(1 << 16)

    def __call__(self, text: str) -> list[str]:
        parts = text.split("\n") if self.keep_newlines else [text]
        sentences: list[str] = []
        for part in parts:
            if part.strip():
                sentences.extend(s for s in self._split(part).split("\n") if s)
        return sentences

    def _split(self, text: str) -> str:
        data = text.encode("utf-8")
        size = 2 * len(data) + 1  # what blingfire's wrapper allows for its output
        if len(self._buffer) < size:
            self._buffer = self._ctypes.create_string_buffer(size)
        n = self._text_to_sentences(data, len(data), self._buffer, len(self._buffer))
        if n < 0 or n > len(self._buffer):
            return text  # blingfire failed (its wrapper would return ""): keep the text as one sentence
        return self._ctypes.string_at(self._buffer, n).rstrip(b"\0").decode("utf-8")


class ChunkEncoder:
    """Turns chunks into EncodedChunks; one per worker process (built by the pool initializer)."""

    def __init__(self, options: EncodeOptions):
        from tokenizers import Tokenizer

        self.options = options
        self.tokenizer = Tokenizer.from_file(options.tokenizer_path)
        # Text is text: "[SEP]" written in a document is tokenized as characters, not as the
        # special token (as Google's and Megatron's BERT preprocessing do).
        self.tokenizer.encode_special_tokens = True
        self.dtype = np.dtype(options.dtype)
        size = max([self.tokenizer.get_vocab_size(with_added_tokens=True), *(i + 1 for i in options.special_ids)])
        self.special = np.zeros(size, dtype=bool)
        self.special[list(options.special_ids)] = True
        self.split_sentences = SentenceSplitter(options.keep_newlines) if options.split_sentences else None

    def __call__(self, chunk: Chunk) -> EncodedChunk:
        options = self.options
        parsed, text_bytes = chunk_documents(chunk, options.input_format, options.keys, options.group_by)
        groups: dict[str | None, list[list[str]]] = {}
        for doc in parsed.documents:
            groups.setdefault(doc[-1] if options.group_by else None, []).append(doc)
        fields = {(key, group): self.encode_documents([doc[k] for doc in docs])
                  for group, docs in groups.items() for k, key in enumerate(options.keys)}
        meta = dataclasses.replace(chunk, data=None)
        return EncodedChunk(meta, fields, records=len(parsed.documents), lines=parsed.lines, text_bytes=text_bytes,
                            problem_counts=parsed.problem_counts, problems=parsed.problems)

    def encode_documents(self, texts: Sequence[str]) -> EncodedField:
        options = self.options
        if self.split_sentences is not None:
            per_doc = [self.split_sentences(text) for text in texts]
        else:
            per_doc = [[text] if text.strip() else [] for text in texts]
        sentences = list(chain.from_iterable(per_doc))
        # encode_batch_fast: no character offsets, which we do not need
        encodings = self.tokenizer.encode_batch_fast(sentences, add_special_tokens=False) if sentences else []
        pieces: list[list[int]] = []
        lengths: list[int] = []
        sizes: list[int] = []
        empty, position = 0, 0
        for doc in per_doc:
            kept = 0
            for encoding in encodings[position:position + len(doc)]:
                ids = encoding.ids
                if ids:  # a "sentence" of symbols the normalizer removes has no tokens
                    pieces.append(ids)
                    lengths.append(len(ids))
                    kept += 1
            position += len(doc)
            if not kept:
                empty += 1
                continue
            if options.append_eod:
                pieces.append([options.eod_id])
                lengths[-1] += 1
            sizes.append(kept)
        total = sum(lengths)
        ids = np.fromiter(chain.from_iterable(pieces), dtype=self.dtype, count=total)
        return EncodedField(ids, np.asarray(lengths, dtype=np.int32), np.asarray(sizes, dtype=np.int64), empty,
                            count_tokens(ids, self.special, options.pad_id))


# --------------------------------------------------------------------------------------------
# Worker process entry points (for a process pool's initializer and tasks)
# --------------------------------------------------------------------------------------------

# The one encoder of this worker process, set by init_worker: a pool initializer can hand
# state to later tasks only through the worker's module namespace.
_worker_encoder: ChunkEncoder | None = None


def init_worker(factory: type[ChunkEncoder], options: EncodeOptions) -> None:
    import signal

    # Ctrl-C reaches the whole process group; the parent handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread per worker: the workers are the parallelism, and the tokenizer's Rust thread
    # pool would compete with them for the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _worker_encoder
    _worker_encoder = factory(options)


def encode_in_worker(chunk: Chunk) -> EncodedChunk:
    assert _worker_encoder is not None, "init_worker did not run in this process"
    return _worker_encoder(chunk)
