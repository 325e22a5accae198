"""Raw text -> Megatron indexed datasets (``<prefix>_<key>_{sentence,document}.{bin,idx}``).

The parent process cuts the inputs into record-aligned chunks (corpus.iter_chunks), hands them
to a pool of worker processes (encode.ChunkEncoder: parse, split sentences, tokenize) and appends
the results, in input order, to one StreamingIndexedDatasetBuilder per JSON key. Memory stays
bounded whatever the corpus size: at most ``window`` chunks are in flight, an uncompressed chunk
travels to its worker as a byte range (the worker reads it), and the index is spilled to disk.

Failure behaviour: outputs are written under temporary names and renamed only at the end
(atomic.atomic_outputs); any error, Ctrl-C or SIGTERM removes them. A worker that raises or dies
fails the run at once (concurrent.futures reports a dead worker as BrokenProcessPool, where
multiprocessing.Pool would wait for its result forever).

``--partitions N`` (Megatron's option) writes N consecutive parts of the input to separate
files and merges them at the end; the documents keep their input order, so the result is the
same bytes as without partitions (Megatron's --keep-sequential-samples behaviour).
"""
from __future__ import annotations

import logging

import contextlib
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np

from ...observability.console import progress
from ...common.errors import UserError
from ...common.atomic import AtomicOutputSet, atomic_output_set, remove_quietly, temp_path
from .corpus import (
    DEFAULT_CHUNK_BYTES,
    TABLE_FORMATS,
    INPUT_FORMATS,
    PROBLEM_KINDS,
    Chunk,
    CorpusError,
    expand_inputs,
    iter_chunks,
    layout_hint,
    locate,
)
from .dataset_record import TokenCounts, VocabularyRecord, record_members
from .encode import ChunkEncoder, EncodedChunk, EncodedField, EncodeOptions, encode_in_worker, init_worker
from .fingerprint import fingerprint_path, write_fingerprint
from .groups import GroupEntry, group_name, manifest_path, write_manifest
from .tokenizer import load_tokenizer, tokenizer_vocab, tokens_by_id

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .indexed import StreamingIndexedDatasetBuilder

# .indexed (megatron-core, hence torch) is imported inside the functions that write: spawned
# workers re-import the caller's main module, and one that imports this module at its top must
# not make every worker load torch (seconds and hundreds of MB each).

__all__ = [
    "PreprocessOptions",
    "PreprocessReport",
    "KeyReport",
    "PreprocessError",
    "output_prefixes",
    "preprocess",
    "format_report",
]


class PreprocessError(UserError, RuntimeError):
    """The run failed (a worker failed or died, it was interrupted, nothing to write)."""


class Interrupted(PreprocessError):
    """Ctrl-C or SIGTERM."""

    exit_status = 130  # the shell's status for a process stopped by SIGINT


@dataclass(frozen=True)
class PreprocessOptions:
    inputs: tuple[str, ...]
    output_prefix: str
    vocab_file: str | None = None
    tokenizer_json: str | None = None
    tokenizer_type: str | None = None  # BertWordPieceLowerCase | BertWordPieceCase | None (from the vocab)
    allow_case_mismatch: bool = False
    json_keys: tuple[str, ...] = ("text",)
    input_format: str = "jsonl"
    split_sentences: bool = False
    keep_newlines: bool = False
    append_eod: bool = False
    workers: int = 1
    partitions: int = 1
    log_interval: int = 1000  # documents between progress updates
    dtype: str = "auto"
    strict: bool = False  # a malformed line is an error instead of a counted skip
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    progress: bool = True
    max_reported: int = 5  # malformed lines quoted in the report
    group_by: str | None = None  # a JSON key or column: one dataset per value, and a manifest (groups.py)
    max_groups: int = 4096  # distinct values of group_by allowed (each holds 3 open files while writing)

    def problems(self) -> list[str]:
        out = []
        if not self.inputs:
            out.append("no --input given")
        if self.input_format not in INPUT_FORMATS:
            out.append(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, got {self.input_format!r}")
        if not self.json_keys:
            out.append("--json-keys needs at least one key")
        elif len(set(self.json_keys)) != len(self.json_keys):
            out.append(f"--json-keys repeats a key: {' '.join(self.json_keys)}")
        if self.input_format != "jsonl" and len(self.json_keys) != 1:
            out.append(f"--input-format {self.input_format} has one text field; give at most one --json-keys name "
                       "(it names the output)")
        if self.workers < 1:
            out.append(f"--workers must be >= 1, got {self.workers}")
        if self.partitions < 1:
            out.append(f"--partitions must be >= 1, got {self.partitions}")
        if self.log_interval < 1:
            out.append(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.chunk_bytes < 1:
            out.append(f"--chunk-bytes must be >= 1, got {self.chunk_bytes}")
        if self.group_by is not None:
            if self.input_format not in ("jsonl", *TABLE_FORMATS):
                out.append(f"--group-by reads a JSON key or a column: --input-format {self.input_format} has none")
            if self.group_by in self.json_keys:
                out.append(f"--group-by {self.group_by} is also a text key (--json-keys)")
            if self.partitions > 1:
                out.append("--group-by writes each group's dataset in input order already: leave --partitions at 1")
            if self.max_groups < 1:
                out.append(f"--max-groups must be >= 1, got {self.max_groups}")
        return out


@dataclass
class KeyReport:
    output_prefix: str
    documents: int = 0  # written
    sentences: int = 0
    tokens: int = 0
    empty_documents: int = 0  # skipped: no tokens
    counts: TokenCounts = field(default_factory=TokenCounts)  # tokens, special ones, [PAD]s


@dataclass
class PreprocessReport:
    files: int
    tokenizer: str
    dtype: str
    keys: dict[str, KeyReport]  # with group_by: each key's totals, output_prefix its manifest
    # with group_by: key -> group value -> its dataset (groups whose documents were all empty included)
    groups: dict[str, dict[str, KeyReport]] = field(default_factory=dict)
    group_by: str | None = None
    records: int = 0  # documents read
    lines: int = 0
    text_bytes: int = 0  # decompressed input
    disk_bytes: int = 0  # input files on disk
    problem_counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # "file:line: message", the first few
    elapsed: float = 0.0
    notes: list[str] = field(default_factory=list)  # tokenizer warnings

    @property
    def malformed(self) -> int:
        return sum(self.problem_counts.values())


def output_prefixes(output_prefix: str, keys: Sequence[str], split_sentences: bool) -> dict[str, str]:
    """Megatron's naming: ``<prefix>_<key>_sentence`` (or ``_document`` without splitting)."""
    level = "sentence" if split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in keys}


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def preprocess(options: PreprocessOptions, encoder_factory: type[ChunkEncoder] = ChunkEncoder) -> PreprocessReport:
    """Run the whole conversion; returns the report, raises CorpusError / TokenizerError /
    DataError (bad input, named) or PreprocessError (the run failed). Never leaves outputs
    under their final names unless it returns."""
    problems = options.problems()
    if problems:
        raise ValueError("\n".join(problems))
    paths = expand_inputs(options.inputs, options.input_format)
    info = load_tokenizer(options.vocab_file, options.tokenizer_json, options.tokenizer_type,
                          options.allow_case_mismatch)
    if options.keep_newlines and not options.split_sentences:
        info.warnings.append("--keep-newlines has no effect without --split-sentences "
                             "(WordPiece treats line breaks as spaces)")
    for note in info.warnings:
        logger.warning(f"note: {note}")
    if info.switched_off:
        logger.info(f"{info.source}: its {' and '.join(info.switched_off)} switched off: every sentence is "
                    "written with its own tokens, none cut off or added")
    for path in paths:
        hint = layout_hint(path, options.input_format)
        if hint:
            logger.warning(hint)
    tokens = tokens_by_id(tokenizer_vocab(info.tokenizer))
    vocabulary = VocabularyRecord.of(tokens, info.lowercase, info.source)
    from .indexed import dtype_for_vocab

    dtype = dtype_for_vocab(info.vocab_size, options.dtype)
    prefixes = output_prefixes(options.output_prefix, options.json_keys, options.split_sentences)
    out_dir = os.path.dirname(os.path.abspath(options.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    report = PreprocessReport(files=len(paths), tokenizer=info.source, dtype=np.dtype(dtype).name,
                              keys={key: KeyReport(prefix if options.group_by is None else manifest_path(prefix))
                                    for key, prefix in prefixes.items()},
                              disk_bytes=sum(os.path.getsize(p) for p in paths), notes=list(info.warnings),
                              group_by=options.group_by)
    # The tokenizer reaches the workers as a file, not as an argument: a worker's start-up data
    # goes through a pipe the parent fills before going on, and beyond the pipe's 64 KiB a worker
    # dying during start-up would block the parent forever (CPython holds the pipe's read end
    # open meanwhile). A 30k vocabulary alone is 500 KB of JSON.
    fd, tokenizer_path = tempfile.mkstemp(prefix="preprocess-tokenizer-", suffix=".json")
    os.close(fd)
    started = time.perf_counter()
    try:
        info.tokenizer.save(tokenizer_path)
        encode_options = EncodeOptions(
            tokenizer_path=tokenizer_path,
            input_format=options.input_format,
            keys=tuple(options.json_keys),
            dtype=np.dtype(dtype).name,
            split_sentences=options.split_sentences,
            keep_newlines=options.keep_newlines,
            append_eod=options.append_eod,
            eod_id=info.specials.sep_id,
            special_ids=info.specials.control_ids,
            pad_id=info.specials.pad_id,
            group_by=options.group_by,
        )
        what = ", ".join(f"{os.path.basename(report.keys[key].output_prefix)}{'' if options.group_by else '.*'}"
                         for key in prefixes)
        with _Interrupts().installed() as interrupts, atomic_output_set(out_dir, what) as files:
            outputs = _Outputs(options, prefixes, dtype, files, report)
            _run(options, paths, encode_options, encoder_factory, outputs, report, started, interrupts)
            outputs.write_records(vocabulary)
    finally:
        remove_quietly([tokenizer_path])
    report.elapsed = time.perf_counter() - started
    return report


class _Outputs:
    """The datasets being written, one per key, or with group_by one per key and value of the
    column (opened when the value's first document with tokens comes), all under temporary names
    in one AtomicOutputSet: a dataset's .bin, fingerprint and .idx are renamed in that order (the
    .idx last: a crash between renames leaves no .idx, visibly incomplete), a manifest after them.

    With --partitions N each part of the input is written to its own files, merged at the end."""

    def __init__(self, options: PreprocessOptions, prefixes: dict[str, str], dtype: type,
                 files: AtomicOutputSet, report: PreprocessReport):
        self.options, self.prefixes, self.dtype, self.files, self.report = options, prefixes, dtype, files, report
        self.finals: dict[tuple[str, str | None], str] = {}  # (key, group value) -> the dataset's prefix
        self.values_by_name: dict[str, str] = {}  # a group's name in file names -> its value
        self.builders: dict[tuple[str, str | None], StreamingIndexedDatasetBuilder] = {}
        self.part = 0
        self.part_files: list[str] = []

    # -- names
    def final(self, key: str, group: str | None) -> str:
        """The dataset's final prefix; its files are named in the set the first time."""
        output = (key, group)
        if output not in self.finals:
            from .indexed import get_bin_path, get_idx_path

            prefix = self.prefixes[key]
            if group is not None:
                name, column = group_name(group), self.options.group_by
                if self.values_by_name.setdefault(name, group) != group:
                    raise PreprocessError(f"--group-by {column}: the values {self.values_by_name[name]!r} and "
                                          f"{group!r} would both be written as {name!r}")
                if len(self.values_by_name) > self.options.max_groups:
                    raise PreprocessError(f"--group-by {column} has more than {self.options.max_groups:,} distinct "
                                          "values (is it the right column?); raise --max-groups to allow more")
                grouped = f"{self.options.output_prefix}_{name}"
                prefix = output_prefixes(grouped, [key], self.options.split_sentences)[key]
            self.finals[output] = prefix
            for path in (get_bin_path(prefix), fingerprint_path(prefix), get_idx_path(prefix)):
                self.files.temp(path)
        return self.finals[output]

    def _part_prefix(self, key: str, group: str | None, part: int) -> str:
        from .indexed import get_bin_path

        final = self.final(key, group)
        if self.options.partitions == 1:  # straight into the final temporary names
            return self.files.temp(get_bin_path(final))[: -len(".bin")]
        return temp_path(final, f"tmp-{os.getpid()}-part{part}")

    # -- writing
    def open_part(self) -> None:
        if self.options.group_by is None:  # every key's dataset has every part, empty or not
            for key in self.prefixes:
                self.builder(key, None)

    def builder(self, key: str, group: str | None) -> StreamingIndexedDatasetBuilder:
        output = (key, group)
        if output not in self.builders:
            from .indexed import StreamingIndexedDatasetBuilder, get_bin_path, get_idx_path

            prefix = self._part_prefix(key, group, self.part)
            _allow_open_files(3 * (len(self.builders) + 1), self.options.group_by)
            if self.options.partitions > 1:
                self.part_files.extend([get_bin_path(prefix), get_idx_path(prefix)])
            self.builders[output] = StreamingIndexedDatasetBuilder(get_bin_path(prefix), dtype=self.dtype)
        return self.builders[output]

    def add(self, key: str, group: str | None, encoded: EncodedField) -> None:
        stats = [self.report.keys[key]]
        if group is not None:
            stats.append(self.report.groups.setdefault(key, {}).setdefault(group, KeyReport("")))
        for s in stats:
            s.empty_documents += encoded.empty_documents
        if not len(encoded.document_sizes) and group is not None:
            return  # a group with no document with tokens yet: no dataset opened for it
        self.builder(key, group).add_sequences(encoded.ids, encoded.lengths, encoded.document_sizes)
        if group is not None:
            stats[1].output_prefix = self.final(key, group)
        for s in stats:
            s.documents += len(encoded.document_sizes)
            s.sentences += len(encoded.lengths)
            s.tokens += encoded.ids.size
            s.counts += encoded.counts

    def close_part(self) -> None:
        from .indexed import get_idx_path

        for (key, group), builder in self.builders.items():
            builder.finalize(get_idx_path(self._part_prefix(key, group, self.part)))
        self.builders.clear()

    def next_part(self) -> None:
        self.close_part()
        self.part += 1
        self.open_part()

    def merge_parts(self) -> None:
        from .indexed import StreamingIndexedDatasetBuilder, get_bin_path, get_idx_path

        if self.options.partitions == 1:
            return
        for (key, group), final in self.finals.items():
            merged = StreamingIndexedDatasetBuilder(self.files.temp(get_bin_path(final)), dtype=self.dtype)
            try:
                for p in range(self.options.partitions):
                    merged.add_index(self._part_prefix(key, group, p))
                merged.finalize(self.files.temp(get_idx_path(final)))
            finally:
                merged.close()

    def write_records(self, vocabulary: VocabularyRecord) -> None:
        """Each dataset's fingerprint (and with group_by, each key's manifest), into the set."""
        from .indexed import get_bin_path, get_idx_path

        for (key, group), final in self.finals.items():
            stats = self.report.keys[key] if group is None else self.report.groups[key][group]
            write_fingerprint(self.files.temp(get_bin_path(final)), self.files.temp(get_idx_path(final)),
                              self.files.temp(fingerprint_path(final)), record_members(vocabulary, stats.counts))
        if self.options.group_by is None:
            return
        for key, prefix in self.prefixes.items():
            folder = os.path.dirname(os.path.abspath(prefix))
            entries = [GroupEntry(value, os.path.relpath(os.path.abspath(stats.output_prefix), folder),
                                  stats.documents, stats.tokens)
                       for value, stats in self.report.groups[key].items() if stats.documents]
            write_manifest(self.files.temp(manifest_path(prefix)), self.options.group_by, key, entries)

    def close(self) -> None:
        for builder in self.builders.values():
            builder.close()
        remove_quietly(self.part_files)


def _allow_open_files(needed: int, group_by: str | None, reserve: int = 64) -> None:
    """Raise this process's soft limit of open files to what `needed` more need, within the hard
    limit; beyond it, one line naming --group-by and `ulimit -n`."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed + reserve <= soft or soft == resource.RLIM_INFINITY:
        return
    wanted = 2 * (needed + reserve)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if wanted < needed + reserve:
        raise PreprocessError(f"--group-by {group_by}: writing this many groups at once needs {needed + reserve:,} "
                              f"open files, over this shell's hard limit of {hard:,} (ulimit -Hn): raise it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _run(options: PreprocessOptions, paths: list[str], encode_options: EncodeOptions,
         encoder_factory: type[ChunkEncoder], outputs: _Outputs, report: PreprocessReport, started: float,
         interrupts: _Interrupts) -> None:
    sizes = [os.path.getsize(p) for p in paths]
    file_offsets = np.concatenate(([0], np.cumsum(sizes)))[:-1].tolist()
    total = max(1, sum(sizes))

    def partition_of(chunk: Chunk) -> int:
        return min(options.partitions - 1, (file_offsets[chunk.file_index] + chunk.start) * options.partitions // total)

    progress = _Progress(report, options, started)
    line_base: dict[int, int] = {}
    try:
        outputs.open_part()
        chunks = iter_chunks(paths, options.input_format, options.chunk_bytes)
        results = _encode_ordered(chunks, encode_options, encoder_factory, options.workers, interrupts)
        with contextlib.closing(results):  # stops the workers at once if we fail here
            for result in results:
                while partition_of(result.chunk) > outputs.part:
                    outputs.next_part()
                _account(result, report, options, line_base)
                for (key, group), encoded in result.fields.items():
                    outputs.add(key, group, encoded)
                progress.update(result)
        outputs.close_part()
        while outputs.part < options.partitions - 1:  # parts the input did not reach are empty
            outputs.part += 1
            outputs.open_part()
            outputs.close_part()
        progress.close()
        _check_not_empty(report)
        _check_mostly_text(report)
        outputs.merge_parts()
    finally:
        progress.close()
        outputs.close()


def _encode_ordered(chunks: Iterable[Chunk], options: EncodeOptions, encoder_factory: type[ChunkEncoder],
                    workers: int, interrupts: _Interrupts) -> Iterator[EncodedChunk]:
    """Encoded chunks in input order, at most 2 * workers + 1 in flight (bounded memory)."""
    context = multiprocessing.get_context("spawn")  # fresh workers: no torch, no inherited threads
    executor = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=init_worker,
                                   initargs=(encoder_factory, options))
    window = 2 * workers + 1
    pending: deque[tuple[Chunk, Future]] = deque()
    ok = False
    try:
        for chunk in chunks:
            try:
                with interrupts.deferred():
                    pending.append((chunk, executor.submit(encode_in_worker, chunk)))
            except BrokenProcessPool:  # a worker died before we asked for its result
                while pending:
                    _result(*pending.popleft())  # raises, naming the chunk
                raise PreprocessError("a worker process died (killed, or out of memory?)") from None
            if len(pending) >= window:
                yield _result(*pending.popleft())
        while pending:
            yield _result(*pending.popleft())
        ok = True
    finally:
        if not ok:
            # Failing or interrupted: stop the workers now rather than after their chunk. SIGKILL
            # works at once even on a worker still starting up, and workers hold nothing worth
            # cleaning up (the output files are the parent's).
            for process in list(getattr(executor, "_processes", {}).values()):
                with contextlib.suppress(Exception):
                    process.kill()
        # Wait for the executor's manager thread even when failing (its workers are dead, so it
        # ends at once): left running, it races CPython 3.11's exit hook (concurrent.futures.
        # process._python_exit wakes it without its lock while it closes its pipe), and the job
        # ends with an "OSError: Bad file descriptor" traceback after our clean message.
        executor.shutdown(wait=True, cancel_futures=True)


def _result(chunk: Chunk, future: Future) -> EncodedChunk:
    where = (f"{chunk.path} (rows {chunk.start + 1}-{chunk.end})" if chunk.table is not None else
             f"{chunk.path} (bytes {chunk.start}-{chunk.end})")
    try:
        return future.result()
    except PreprocessError:
        raise  # Interrupted, raised by our signal handler while we waited
    except BrokenProcessPool:
        raise PreprocessError(f"a worker process died (killed, or out of memory?) while working on {where}") from None
    except CorpusError as e:  # named by its file already (a table's column or shard), or by the chunk here
        raise PreprocessError(str(e) if str(e).startswith(chunk.path) else f"{where}: {e}") from None
    except Exception as e:
        # a bug: keep the worker's traceback (concurrent.futures attaches it as the cause)
        raise PreprocessError(f"a worker failed on {where}: {type(e).__name__}: {e}") from e


def _account(result: EncodedChunk, report: PreprocessReport, options: PreprocessOptions,
             line_base: dict[int, int]) -> None:
    """Fold a chunk's counts into the report; problems get their absolute file:line."""
    chunk = result.chunk
    base = line_base.get(chunk.file_index, 0)
    line_base[chunk.file_index] = base + result.lines
    report.records += result.records
    report.lines += result.lines
    report.text_bytes += result.text_bytes
    for kind, count in result.problem_counts.items():
        report.problem_counts[kind] = report.problem_counts.get(kind, 0) + count
    for problem in result.problems:
        located = locate(chunk, base + problem.line, problem.message)
        if options.strict:
            raise CorpusError(f"{located} (--strict makes malformed lines fatal)")
        if len(report.problems) < options.max_reported:
            report.problems.append(located)


def _check_not_empty(report: PreprocessReport) -> None:
    for key, stats in report.keys.items():
        if stats.documents == 0:
            kinds = ", ".join(f"{kind} {n:,}" for kind, n in report.problem_counts.items())
            detail = (f"{report.records:,} documents read, {stats.empty_documents:,} empty, "
                      f"{report.malformed:,} malformed lines{': ' + kinds if kinds else ''}"
                      + (f"; first: {report.problems[0]}" if report.problems else ""))
            raise PreprocessError(f"no document with tokens for key {key!r} ({detail}); nothing written")


def _check_mostly_text(report: PreprocessReport) -> None:
    """Refuse an output of mostly special tokens, before anything is renamed into place."""
    outputs = [(key, stats) for key, stats in report.keys.items() if key not in report.groups]
    outputs += [(key, stats) for key, groups in report.groups.items() for stats in groups.values() if stats.documents]
    for key, stats in outputs:
        refusal = stats.counts.refusal(f"{stats.output_prefix}.bin (key {key!r}, tokenized with {report.tokenizer})")
        if refusal:
            raise PreprocessError(f"{refusal}; check that the vocabulary covers this text's script and case (a "
                                  "word it cannot spell becomes [UNK]); nothing written")


class _Progress:
    """Progress in input MB with documents/s, refreshed every log_interval documents (a bar on a
    terminal, a plain line every few seconds in a log)."""

    def __init__(self, report: PreprocessReport, options: PreprocessOptions, started: float):
        self.report, self.interval, self.started = report, options.log_interval, started
        self.bar = progress(report.disk_bytes, "preprocess", enabled=options.progress, unit="B", unit_scale=True,
                            unit_divisor=1000, mininterval=0, smoothing=0.1)
        self.pending_bytes, self.pending_docs = 0, 0

    def update(self, result: EncodedChunk) -> None:
        self.pending_bytes += result.chunk.disk_bytes
        self.pending_docs += result.records
        if self.pending_docs >= self.interval:
            self._flush()

    def _flush(self) -> None:
        elapsed = max(1e-9, time.perf_counter() - self.started)
        self.bar.set_postfix_str(f"{self.report.records:,} docs, {self.report.records / elapsed:,.0f} docs/s",
                                 refresh=False)
        self.bar.update(self.pending_bytes)
        self.pending_bytes, self.pending_docs = 0, 0

    def close(self) -> None:
        if self.pending_bytes or self.pending_docs:
            self._flush()
        self.bar.close()


class _Interrupts:
    """SIGINT and SIGTERM raise Interrupted in the main thread, so the cleanup code runs, except
    inside ``deferred()``, which holds them until its block ends."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None

    def __call__(self, signum: int, frame) -> None:
        if self.depth and self.pending is None:
            self.pending = signum
            return
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold the signals until the block ends (a second one is not held: it forces). submit()
        may be starting a worker process, and an interruption halfway through sending it its
        start-up data leaves a half-started child that prints an EOFError traceback."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    @contextlib.contextmanager
    def installed(self) -> Iterator["_Interrupts"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set in the main thread
            return
        previous = {s: signal.signal(s, self) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


SHOWN_GROUPS = 12  # the largest groups named in the report (the manifest lists them all)


def _group_lines(groups: dict[str, KeyReport], total_tokens: int) -> list[str]:
    largest = sorted(groups.items(), key=lambda item: -item[1].tokens)
    lines = [f"  {value or repr(value)}: {stats.documents:,} documents, {stats.tokens:,} tokens "
             f"({stats.tokens / max(total_tokens, 1):.1%})"
             + ("" if stats.documents else f": no dataset, its {stats.empty_documents:,} documents have no token")
             for value, stats in largest[:SHOWN_GROUPS]]
    if len(largest) > SHOWN_GROUPS:
        rest = largest[SHOWN_GROUPS:]
        lines.append(f"  ... and {len(rest):,} more groups, {sum(s.tokens for _, s in rest):,} tokens")
    return lines


def format_report(report: PreprocessReport) -> str:
    mb = report.text_bytes / 1e6
    rate = mb / report.elapsed if report.elapsed else 0.0
    lines = [f"read {report.files} file{'s' if report.files != 1 else ''}: {report.records:,} documents, "
             f"{report.lines:,} lines, {mb:,.1f} MB of text"
             + (f" ({report.disk_bytes / 1e6:,.1f} MB on disk)" if report.disk_bytes != report.text_bytes else "")]
    for key, stats in report.keys.items():
        groups = report.groups.get(key)
        written = (f"{stats.output_prefix}.{{bin,idx}}" if groups is None else
                   f"{sum(1 for g in groups.values() if g.documents):,} datasets, one per {report.group_by}, "
                   f"listed in {stats.output_prefix}")
        lines.append(f"key {key!r}: {stats.documents:,} documents, {stats.sentences:,} sentences, "
                     f"{stats.tokens:,} tokens ({report.dtype}) -> {written}")
        lines.append(f"  skipped empty documents: {stats.empty_documents:,}")
        if groups:
            lines.extend(_group_lines(groups, stats.tokens))
    kinds = ", ".join(f"{kind} {report.problem_counts.get(kind, 0):,}" for kind in PROBLEM_KINDS)
    lines.append(f"malformed lines skipped: {report.malformed:,} ({kinds})")
    for problem in report.problems:
        lines.append(f"  {problem}")
    if report.malformed > len(report.problems):
        lines.append(f"  ... and {report.malformed - len(report.problems):,} more")
    lines.append(f"elapsed {report.elapsed:,.1f} s: {rate:,.2f} MB/s, "
                 f"{report.records / report.elapsed if report.elapsed else 0:,.0f} docs/s")
    return "\n".join(lines)
