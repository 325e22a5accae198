"""Preprocessing raw text into Megatron indexed datasets: equal to a straightforward reference,
readable by megatron-core, identical bytes whatever the workers/partitions/chunking/compression,
bad input counted or refused with file:line, and no complete-looking output after a failure."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time

import blingfire
import numpy as np
import pytest
import zstandard
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from tokenizers.implementations import BertWordPieceTokenizer

from _preprocess_helpers import (DyingAtStartEncoder, DyingEncoder, RaisingEncoder, documents, hard_wrap, small_vocab,
                                 write_jsonl)
from pretrain.data.preprocess.corpus import CorpusError
from pretrain.data.preprocess.encode import SentenceSplitter
from pretrain.data.preprocess.indexed import (
    DataError,
    StreamingIndexedDatasetBuilder,
    dataset_statistics,
    open_indexed_dataset,
)
from pretrain.data.preprocess.merge import merge_datasets
from pretrain.data.preprocess.pipeline import PreprocessError, PreprocessOptions, format_report, preprocess
from pretrain.data.preprocess.tokenizer import SPECIAL_TOKENS, TokenizerError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = dict(progress=False)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    return small_vocab(str(tmp_path_factory.mktemp("vocab")))


@pytest.fixture(scope="module")
def reference_tokenizer(vocab):
    # Hugging Face's own BERT tokenizer class, independent of how our pipeline builds one.
    return BertWordPieceTokenizer(vocab, lowercase=True)


def reference(tokenizer, docs, split: bool, append_eod: bool = False) -> list[list[list[int]]]:
    """What the dataset must hold: blingfire sentences, each tokenized on its own, empty ones dropped."""
    sep = tokenizer.token_to_id("[SEP]")
    out = []
    for doc in docs:
        sentences = blingfire.text_to_sentences(doc).split("\n") if split else [doc]
        ids = [tokenizer.encode(s, add_special_tokens=False).ids for s in sentences if s.strip()]
        ids = [i for i in ids if i]
        if ids:
            if append_eod:
                ids[-1] = ids[-1] + [sep]
            out.append(ids)
    return out


def read_dataset(prefix: str) -> list[list[list[int]]]:
    """Documents -> sentences -> ids, through megatron-core's own reader."""
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [[dataset[s].tolist() for s in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


def run(inputs, prefix, vocab, **kwargs):
    options = PreprocessOptions(inputs=tuple(inputs), output_prefix=str(prefix), vocab_file=vocab,
                                **{**QUIET, **kwargs})
    return preprocess(options)


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------------------------
# Content
# --------------------------------------------------------------------------------------------


def test_sentences_match_reference(tmp_path, vocab, reference_tokenizer):
    docs = documents(300, seed=5, empty_every=25)
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    report = run([corpus], tmp_path / "out" / "ds", vocab, split_sentences=True, workers=2, chunk_bytes=2000)
    expected = reference(reference_tokenizer, docs, split=True)
    prefix = str(tmp_path / "out" / "ds_text_sentence")
    assert read_dataset(prefix) == expected
    assert files(tmp_path / "out") == ["ds_text_sentence.bin", "ds_text_sentence.fingerprint.json", "ds_text_sentence.idx"]
    stats = report.keys["text"]
    assert report.records == 300 and stats.empty_documents == 12 and stats.documents == len(expected) == 288
    assert stats.sentences == sum(map(len, expected)) and stats.sentences > 2 * stats.documents
    assert stats.tokens == sum(len(s) for d in expected for s in d)
    assert report.dtype == "uint16" and IndexedDataset(prefix).index.dtype == np.uint16
    text = format_report(report)
    assert "288 documents" in text and "skipped empty documents: 12" in text and "malformed lines skipped: 0" in text


def test_documents_match_reference_with_eod(tmp_path, vocab, reference_tokenizer):
    docs = documents(120, seed=6, empty_every=10)
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    run([corpus], tmp_path / "ds", vocab, append_eod=True, chunk_bytes=1500)
    assert read_dataset(str(tmp_path / "ds_text_document")) == reference(reference_tokenizer, docs, False, True)


def test_several_json_keys_and_literal_special_tokens(tmp_path, vocab, reference_tokenizer):
    docs = documents(50, seed=7)
    titles = [d.split(".")[0] for d in docs]
    with open(tmp_path / "in.jsonl", "w") as f:
        for doc, title in zip(docs, titles):
            f.write(json.dumps({"title": title + " [SEP] [MASK]", "text": doc}) + "\n")
    run([str(tmp_path / "in.jsonl")], tmp_path / "ds", vocab, json_keys=("text", "title"), split_sentences=True)
    assert read_dataset(str(tmp_path / "ds_text_sentence")) == reference(reference_tokenizer, docs, True)
    title_ids = read_dataset(str(tmp_path / "ds_title_sentence"))
    specials = {reference_tokenizer.token_to_id(t) for t in ("[SEP]", "[MASK]")}
    # text that spells a special token is text, as in Google's and Megatron's preprocessing
    assert not specials & {i for d in title_ids for s in d for i in s}
    assert len(title_ids) == 50


def test_plain_text_formats(tmp_path, vocab, reference_tokenizer):
    paragraphs = documents(60, seed=8)
    # documents separated by blank lines (some with spaces, CRLF, several in a row), hard-wrapped
    text = ""
    for i, p in enumerate(paragraphs):
        text += hard_wrap(p, 30 + i % 20).replace("\n", "\r\n" if i % 7 == 0 else "\n")
        text += ["\n\n", "\n  \n", "\n\n\n\n", "\n\t\n\n"][i % 4]
    (tmp_path / "blank.txt").write_text(text.rstrip("\n"))  # no final newline
    run([str(tmp_path / "blank.txt")], tmp_path / "b", vocab, input_format="text-blank-lines",
        split_sentences=True, chunk_bytes=700)
    assert read_dataset(str(tmp_path / "b_text_sentence")) == reference(reference_tokenizer, paragraphs, True)
    (tmp_path / "blank.txt.gz").write_bytes(gzip.compress((tmp_path / "blank.txt").read_bytes()))
    run([str(tmp_path / "blank.txt.gz")], tmp_path / "bgz", vocab, input_format="text-blank-lines",
        split_sentences=True, chunk_bytes=500, workers=2)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"bgz_text_sentence.{ext}").read_bytes() == (tmp_path / f"b_text_sentence.{ext}").read_bytes()

    # one document per line; blank lines are empty documents
    lines = [p if i % 9 else "" for i, p in enumerate(paragraphs)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    report = run([str(tmp_path / "lines.txt")], tmp_path / "l", vocab, input_format="text-lines", chunk_bytes=900)
    assert read_dataset(str(tmp_path / "l_text_document")) == reference(reference_tokenizer, lines, False)
    assert report.keys["text"].empty_documents == 7

    # --keep-newlines: a line break always ends a sentence
    (tmp_path / "poem.txt").write_text("Roses are red\nviolets are blue\n\nA second poem. With two lines\nhere\n")
    run([str(tmp_path / "poem.txt")], tmp_path / "p", vocab, input_format="text-blank-lines",
        split_sentences=True, keep_newlines=True)
    enc = lambda s: reference_tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert read_dataset(str(tmp_path / "p_text_sentence")) == [
        [enc("Roses are red"), enc("violets are blue")],
        [enc("A second poem."), enc("With two lines"), enc("here")]]
    run([str(tmp_path / "poem.txt")], tmp_path / "q", vocab, input_format="text-blank-lines", split_sentences=True)
    assert read_dataset(str(tmp_path / "q_text_sentence"))[0] == [enc("Roses are red violets are blue")]


def test_same_bytes_for_any_workers_partitions_chunks_and_compression(tmp_path, vocab):
    docs = documents(400, seed=9, empty_every=17)
    plain = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    data = open(plain, "rb").read()
    compressed = {
        "gz": gzip.compress(data),
        "bz2": bz2.compress(data),
        "xz": lzma.compress(data),
        "zst": zstandard.ZstdCompressor().compress(data[:5000]) + zstandard.ZstdCompressor().compress(data[5000:]),
    }
    for suffix, blob in compressed.items():
        (tmp_path / f"in.jsonl.{suffix}").write_bytes(blob)
    runs = {
        "1 worker": dict(inputs=[plain], workers=1),
        "2 workers": dict(inputs=[plain], workers=2, chunk_bytes=3000),
        "2 partitions": dict(inputs=[plain], workers=2, partitions=2, chunk_bytes=4000),
        "5 partitions, big chunks": dict(inputs=[plain], workers=1, partitions=5),
        **{suffix: dict(inputs=[str(tmp_path / f"in.jsonl.{suffix}")], workers=2, chunk_bytes=2500)
           for suffix in compressed},
    }
    outputs = {}
    for name, kwargs in runs.items():
        prefix = tmp_path / name.replace(" ", "_").replace(",", "")
        run(kwargs.pop("inputs"), prefix, vocab, split_sentences=True, **kwargs)
        outputs[name] = tuple(open(f"{prefix}_text_sentence.{ext}", "rb").read() for ext in ("bin", "idx"))
    first = outputs["1 worker"]
    assert len(first[0]) > 10000
    for name, output in outputs.items():
        assert output == first, name
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_tokenizer_json_gives_the_same_output_as_vocab_txt(tmp_path, vocab):
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), documents(60, seed=18))
    run([corpus], tmp_path / "a", vocab, split_sentences=True)
    options = PreprocessOptions(inputs=(corpus,), output_prefix=str(tmp_path / "b"), split_sentences=True,
                                tokenizer_json=os.path.join(os.path.dirname(vocab), "tokenizer.json"), progress=False)
    preprocess(options)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a_text_sentence.{ext}").read_bytes() == (tmp_path / f"b_text_sentence.{ext}").read_bytes()


def test_sentence_splitter_is_blingfire():
    texts = documents(300, seed=19) + ["", "  ", "a\x00b. c", "東京. 北京!", "x" * 70000 + ". Y.",
                                       "Line one\nline two. Three"]
    split = SentenceSplitter()
    for text in texts:
        expected = [s for s in blingfire.text_to_sentences(text).split("\n") if s] if text.strip() else []
        assert split(text) == expected
    assert SentenceSplitter(keep_newlines=True)("Line one\nline two. Three") == ["Line one", "line two.", "Three"]


def test_several_inputs_are_concatenated_in_order(tmp_path, vocab, reference_tokenizer):
    docs = documents(90, seed=10)
    for i in range(3):
        write_jsonl(str(tmp_path / f"part-{i}.jsonl"), docs[30 * i: 30 * (i + 1)])
    with gzip.open(tmp_path / "part-3.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "The end."}) + "\n")
    run([str(tmp_path / "part-0.jsonl"), str(tmp_path / "part-[12].jsonl"), str(tmp_path / "part-3.jsonl.gz")],
        tmp_path / "ds", vocab, split_sentences=True, workers=2, partitions=2)
    assert read_dataset(str(tmp_path / "ds_text_sentence")) == reference(reference_tokenizer, docs + ["The end."], True)


# --------------------------------------------------------------------------------------------
# Format compatibility with megatron-core
# --------------------------------------------------------------------------------------------


def _megatron_build(prefix: str, docs: list[list[list[int]]], dtype=np.uint16) -> None:
    import torch

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for sentence in doc:
            builder.add_item(torch.tensor(sentence))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_output_is_what_megatron_builder_writes(tmp_path, vocab, reference_tokenizer):
    docs = documents(150, seed=11)
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    run([corpus], tmp_path / "ours", vocab, split_sentences=True, workers=2, chunk_bytes=3000)
    _megatron_build(str(tmp_path / "theirs"), reference(reference_tokenizer, docs, True))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours_text_sentence.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()

    # our builder through megatron's item-by-item interface, and merging (add_index)
    builder = StreamingIndexedDatasetBuilder(str(tmp_path / "again.bin"), dtype=np.uint16)
    builder._FLUSH = 7  # exercise the spilling of small buffers
    for doc in reference(reference_tokenizer, docs[:70], True):
        for sentence in doc:
            builder.add_item(np.array(sentence))
        builder.end_document()
    _megatron_build(str(tmp_path / "tail"), reference(reference_tokenizer, docs[70:], True))
    builder.add_index(str(tmp_path / "tail"))
    builder.finalize(str(tmp_path / "again.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"again.{ext}").read_bytes() == (tmp_path / f"theirs.{ext}").read_bytes()


def test_open_indexed_dataset_reads_megatron_files_and_refuses_broken_ones(tmp_path):
    docs = [[[5, 6, 7], [8]], [[9, 10]], [], [[11] * 40]]
    prefix = str(tmp_path / "m")
    _megatron_build(prefix, docs, dtype=np.int32)
    dataset = open_indexed_dataset(prefix)
    assert isinstance(dataset, IndexedDataset)
    assert dataset[0].tolist() == [5, 6, 7] and dataset[3].tolist() == [11] * 40
    assert dataset.document_indices.tolist() == [0, 2, 3, 3, 4]
    stats = dataset_statistics(prefix)
    assert (stats.documents, stats.sentences, stats.tokens, stats.empty_documents) == (4, 4, 46, 1)
    assert stats.tokens_per_sentence == (1, 11.5, 40) and stats.sentences_per_document == (0, 1.0, 2)
    bin_bytes, idx_bytes = open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()

    def broken(bin_data: bytes, idx_data: bytes, match: str, name: str = "x") -> None:
        bad = str(tmp_path / name)
        if bin_data is not None:
            open(bad + ".bin", "wb").write(bin_data)
        if idx_data is not None:
            open(bad + ".idx", "wb").write(idx_data)
        with pytest.raises(DataError, match=match):
            open_indexed_dataset(bad)
        for ext in (".bin", ".idx"):
            if os.path.exists(bad + ext):
                os.remove(bad + ext)

    x = str(tmp_path / "x")
    broken(bin_bytes[:-4], idx_bytes, rf"{x}\.bin: 180 bytes, but {x}\.idx describes 46 tokens of int32 = 184 bytes")
    broken(bin_bytes, idx_bytes[:-8], rf"{x}\.idx: truncated or corrupt index")
    broken(bin_bytes, idx_bytes[:20], rf"{x}\.idx: truncated index file")
    broken(bin_bytes, b"\x89PNG\r\n\x1a\n" + idx_bytes[8:], rf"{x}\.idx: not a Megatron indexed-dataset index")
    broken(bin_bytes, idx_bytes[:9] + (2).to_bytes(8, "little") + idx_bytes[17:], "version 2")
    broken(bin_bytes, idx_bytes[:17] + bytes([42]) + idx_bytes[18:], "unknown token dtype code 42")
    broken(bin_bytes, idx_bytes[:17] + bytes([DType.float32.value]) + idx_bytes[18:], "not an integer type")
    broken(None, idx_bytes, rf"{x}\.bin: data file does not exist")
    broken(b"", b"", "truncated index file")
    with pytest.raises(DataError, match="no dataset there"):
        open_indexed_dataset(str(tmp_path / "nothing"))
    # a .bin from another dataset with the same length but inconsistent offsets in the index
    idx = bytearray(idx_bytes)
    idx[34 + 4 * 5 + 8] = 99  # second sequence's offset
    broken(bin_bytes, bytes(idx), "offsets disagree")


def test_a_foreign_idx_or_a_bin_rewritten_in_place_is_refused_by_the_fingerprint(tmp_path):
    """Structurally sound pairs the size and offset checks cannot tell apart from the real one: an
    .idx of another segmentation of as many tokens, and a .bin with other tokens of the same size."""
    docs = [[[5, 6, 7], [8]], [[9, 10]], [], [[11] * 40]]
    _megatron_build(str(tmp_path / "m"), docs, dtype=np.int32)
    ours = str(tmp_path / "ours")
    merge_datasets([str(tmp_path / "m")], ours)  # writes the fingerprint, as preprocessing does
    assert json.loads(open(ours + ".fingerprint.json").read())["bin_bytes"] == 46 * 4
    dataset = open_indexed_dataset(ours)  # kept: its items are views of its mapping
    assert dataset[0].tolist() == [5, 6, 7]

    def replace(path, data):  # a new file: megatron-core keeps the old one mapped
        open(path + ".new", "wb").write(data)
        os.replace(path + ".new", path)

    _megatron_build(str(tmp_path / "other"), [[[5, 6], [7, 8]], [[9, 10]], [], [[11] * 40]], dtype=np.int32)
    good_idx, good_bin = open(ours + ".idx", "rb").read(), open(ours + ".bin", "rb").read()

    replace(ours + ".idx", open(str(tmp_path / "other.idx"), "rb").read())
    with pytest.raises(DataError, match=rf"^{ours}\.idx is not the file preprocessing wrote with {ours}\.bin: "
                                        r".* \(a foreign or rewritten \.idx\); if the files were replaced on purpose, "
                                        rf"delete {ours}\.fingerprint\.json$"):
        open_indexed_dataset(ours)
    replace(ours + ".idx", good_idx)
    rewritten = np.frombuffer(good_bin, dtype=np.int32).copy()
    rewritten[1] = 12
    replace(ours + ".bin", rewritten.tobytes())
    with pytest.raises(DataError, match=rf"^{ours}\.bin is not the file preprocessing wrote with {ours}\.idx"):
        open_indexed_dataset(ours)
    os.remove(ours + ".fingerprint.json")  # no fingerprint (Megatron-LM's own files): the structural checks only
    dataset = open_indexed_dataset(ours)
    assert dataset[0].tolist() == [5, 12, 7]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_malformed_lines_are_counted_with_file_and_line(tmp_path, vocab, reference_tokenizer):
    docs = documents(40, seed=12)
    good = [json.dumps({"text": d}) for d in docs]
    lines = (good[:10] + ['{"text": "unterminated'] + good[10:20] + ['{"txt": "wrong key"}'] + good[20:30]
             + ['{"text": ["a", "list"]}', '[1, 2]', '{"text": null}'] + good[30:])
    raw = "\n".join(lines).encode() + b"\n" + b'{"text": "Latin-1 caf\xe9"}\n' + b'{"text": "\\ud800 lone"}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(raw)
    report = run([str(path)], tmp_path / "ds", vocab, split_sentences=True, chunk_bytes=800, workers=2)
    assert read_dataset(str(tmp_path / "ds_text_sentence")) == reference(reference_tokenizer, docs, True)
    assert report.problem_counts == {"bad JSON": 2, "missing key": 1, "non-string value": 2, "invalid UTF-8": 2}
    assert report.problems == [
        f"{path}:11: bad JSON: Unterminated string starting at: line 1 column 10 (char 9)",
        f"{path}:22: missing key 'text'",
        f"{path}:33: non-string value for key 'text' (list)",
        f"{path}:34: bad JSON: expected an object, got list",
        f"{path}:35: non-string value for key 'text' (NoneType)",
    ]
    text = format_report(report)
    assert "malformed lines skipped: 7 (bad JSON 2, missing key 1, non-string value 2, invalid UTF-8 2)" in text
    assert "... and 2 more" in text

    with pytest.raises(CorpusError, match=rf"{path}:11: bad JSON"):
        run([str(path)], tmp_path / "strict", vocab, strict=True, chunk_bytes=800)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("strict")]


def test_bad_inputs_and_vocabularies_are_clear_errors(tmp_path, vocab):
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), documents(10, seed=13))
    with pytest.raises(CorpusError, match=f"input file '{tmp_path}/missing.jsonl' does not exist"):
        run([corpus, str(tmp_path / "missing.jsonl")], tmp_path / "ds", vocab)
    with pytest.raises(CorpusError, match=r"input glob '.*/\*\.json' matches no file"):
        run([str(tmp_path / "*.json")], tmp_path / "ds", vocab)
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(open(corpus, "rb").read())[:-30])
    with pytest.raises(CorpusError, match=f"{truncated}: corrupt compressed data"):
        run([str(truncated)], tmp_path / "ds", vocab)
    bad_vocab = tmp_path / "bad_vocab.txt"
    bad_vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    with pytest.raises(TokenizerError, match=rf"{bad_vocab}: vocabulary lacks the special token \[MASK\]"):
        run([corpus], tmp_path / "ds", str(bad_vocab))
    big_vocab = tmp_path / "big_vocab.txt"
    words = open(vocab).read().split("\n")[:-1]
    big_vocab.write_text("\n".join(words + [f"w{i}" for i in range(70000 - len(words))]) + "\n")
    with pytest.raises(DataError, match=r"70000 tokens \(ids up to 69999\) does not fit uint16"):
        run([corpus], tmp_path / "ds", str(big_vocab), dtype="uint16")
    report = run([corpus], tmp_path / "big", str(big_vocab))  # auto: int32 like megatron's optimal_dtype
    assert report.dtype == "int32" and IndexedDataset(str(tmp_path / "big_text_document")).index.dtype == np.int32
    with pytest.raises(TokenizerError, match="capitalised words would become"):
        run([corpus], tmp_path / "ds", vocab, tokenizer_type="BertWordPieceCase")
    with pytest.raises(PreprocessError, match="no document with tokens for key 'body' .*10 malformed lines: missing key 10; first: .*in.jsonl:1: missing key 'body'"):
        run([corpus], tmp_path / "ds", vocab, json_keys=("body",))
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        run([corpus], tmp_path / "ds", vocab, workers=0)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ds")]


# --------------------------------------------------------------------------------------------
# Failures leave nothing that looks complete
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoder, match", [(RaisingEncoder, "a worker failed on .*RuntimeError: injected failure"),
                                            (DyingEncoder, "a worker process died"),
                                            (DyingAtStartEncoder, "a worker process died")])
def test_worker_failure_fails_fast_and_leaves_no_output(tmp_path, vocab, encoder, match):
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), documents(200, seed=14))
    (tmp_path / "out").mkdir()
    options = PreprocessOptions(inputs=(corpus,), output_prefix=str(tmp_path / "out" / "ds"), vocab_file=vocab,
                                workers=2, chunk_bytes=1000, partitions=2, progress=False)
    started = time.monotonic()
    with pytest.raises(PreprocessError, match=match):
        preprocess(options, encoder_factory=encoder)
    assert time.monotonic() - started < 60
    assert files(tmp_path / "out") == []


def _cli(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), **kwargs)


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    write_jsonl(str(path), documents(20000, seed=15))  # ~5 MB: takes a few seconds
    return str(path)


def _wait_for_temp_files(directory, proc, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(".tmp-" in n for n in os.listdir(directory)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary output appeared"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "kill a worker"])
def test_cli_interrupted_or_worker_killed_leaves_no_output(tmp_path, vocab, big_corpus, how):
    import psutil

    out = tmp_path / "out"
    out.mkdir()
    proc = _cli(["--input", big_corpus, "--output-prefix", str(out / "ds"), "--vocab-file", vocab,
                 "--split-sentences", "--workers", "2", "--chunk-bytes", "20000", "--quiet"])
    _wait_for_temp_files(out, proc)
    if how == "kill a worker":
        deadline = time.monotonic() + 30
        while not (workers := [p for p in psutil.Process(proc.pid).children()
                               if any("spawn_main" in part for part in p.cmdline())]):
            assert time.monotonic() < deadline and proc.poll() is None, "no worker process seen"
            time.sleep(0.05)
        time.sleep(0.5)  # let it start working
        workers[0].kill()
    else:
        proc.send_signal(getattr(signal, how))
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{how}: the parent did not exit within 30 s")
    assert proc.returncode == (1 if how == "kill a worker" else 130), stderr
    assert ("worker process died" if how == "kill a worker" else "interrupted") in stderr
    assert "no output written" in stderr and "Traceback" not in stderr
    assert files(out) == []  # neither final names nor temporary ones


@pytest.mark.slow
def test_cli_success_and_usage_errors(tmp_path, vocab):
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), documents(50, seed=16))
    proc = _cli(["--input", corpus, "--output-prefix", str(tmp_path / "ds"), "--vocab-file", vocab,
                 "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences", "--workers", "1"])
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "key 'text': 50 documents" in stdout and "MB/s" in stdout
    assert files(tmp_path) == ["ds_text_sentence.bin", "ds_text_sentence.fingerprint.json", "ds_text_sentence.idx", "in.jsonl"]
    proc = _cli(["--input", corpus, "--output-prefix", str(tmp_path / "x"), "--vocab-file", str(tmp_path / "nope.txt")])
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and f"vocab file '{tmp_path}/nope.txt' does not exist" in stderr
    assert "Traceback" not in stderr


# --------------------------------------------------------------------------------------------
# merge and inspect
# --------------------------------------------------------------------------------------------


def test_merge_equals_preprocessing_the_concatenation(tmp_path, vocab, capsys):
    from tools import merge_datasets as merge_tool

    docs = documents(100, seed=17)
    write_jsonl(str(tmp_path / "a.jsonl"), docs[:60])
    write_jsonl(str(tmp_path / "b.jsonl"), docs[60:])
    (tmp_path / "parts").mkdir()
    run([str(tmp_path / "a.jsonl")], tmp_path / "parts" / "a", vocab, split_sentences=True)
    run([str(tmp_path / "b.jsonl")], tmp_path / "parts" / "b", vocab, split_sentences=True)
    run([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], tmp_path / "both", vocab, split_sentences=True)
    assert merge_tool.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged")]) == 0
    assert "merged 2 datasets" in capsys.readouterr().out
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"both_text_sentence.{ext}").read_bytes()
    run([str(tmp_path / "b.jsonl")], tmp_path / "wide", vocab, split_sentences=True, dtype="int32")
    with pytest.raises(DataError, match=r"different token dtypes: .*a_text_sentence \(uint16\), .*wide_text_sentence \(int32\)"):
        merge_datasets([str(tmp_path / "parts" / "a_text_sentence"), str(tmp_path / "wide_text_sentence")],
                       str(tmp_path / "bad"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith("bad")]


def test_inspect(tmp_path, vocab, capsys):
    from tools import inspect_dataset

    docs = ["Emma was here. She left!", "   ", "Mr Knightley came. He sat. The end?"]
    corpus = write_jsonl(str(tmp_path / "in.jsonl"), docs)
    run([corpus], tmp_path / "ds", vocab, split_sentences=True)
    prefix = str(tmp_path / "ds_text_sentence")
    assert inspect_dataset.main([prefix, "--decode", "1", "--vocab-file", vocab]) == 0
    out = capsys.readouterr().out
    assert "documents   2 (0 empty)" in out and "sentences   5" in out and "dtype       uint16" in out
    assert "sentences/document  min 2  mean 2.50  max 3" in out
    assert "--- document 1: sentences 2-4 (3 sentences)" in out
    assert "mr knightley came." in out and "the end?" in out
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    assert inspect_dataset.main([prefix]) == 1
    assert f"{prefix}.bin: 10 bytes, but {prefix}.idx describes" in capsys.readouterr().err
