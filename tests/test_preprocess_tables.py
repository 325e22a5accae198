"""Preprocessing tables (pretrain/data/preprocess/tables.py): Parquet files, folders of Parquet
shards and datasets saved by `datasets.save_to_disk` (Arrow stream files, written here as datasets
writes them) give the same .bin/.idx bytes as the same text fed as JSON lines, through workers and
partitions; a vocabulary learnt from them is the JSONL one; nulls are counted skips named by row;
a missing or non-text column, an unreadable shard and a DatasetDict folder are one line naming the
file; reading holds one chunk at a time."""
from __future__ import annotations

import json
import os
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _preprocess_helpers import documents, small_vocab, write_jsonl
from pretrain.data.preprocess.corpus import CorpusError, iter_documents
from pretrain.data.preprocess.pipeline import PreprocessError, PreprocessOptions, format_report, preprocess
from pretrain.data.preprocess.vocab_builder import VocabOptions, build_vocab

pytestmark = pytest.mark.slow  # worker processes
DOCS = documents(300, seed=4, empty_every=23)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    return small_vocab(str(tmp_path_factory.mktemp("vocab")))


def write_parquet(path, docs, row_group_size=40, **columns):
    table = pa.table({"id": list(range(len(docs))), "text": docs, **columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def save_to_disk(folder, docs, shards=2, batch_rows=25):
    """A dataset as datasets.save_to_disk writes one: Arrow stream files in state.json's order."""
    os.makedirs(folder)
    names, per = [], -(-len(docs) // shards)
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        table = pa.table({"text": docs[s * per:(s + 1) * per], "lang": ["en"] * len(docs[s * per:(s + 1) * per])})
        with pa.OSFile(os.path.join(folder, name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
        names.append(name)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": "train"}, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"features": {"text": {"dtype": "string", "_type": "Value"}}}, f)
    return str(folder)


def run(inputs, prefix, vocab, **kwargs):
    return preprocess(PreprocessOptions(inputs=tuple(inputs), output_prefix=str(prefix), vocab_file=vocab,
                                        progress=False, **kwargs))


def output(prefix) -> tuple[bytes, bytes]:
    return tuple(open(f"{prefix}_text_sentence.{ext}", "rb").read() for ext in ("bin", "idx"))


def test_parquet_and_arrow_give_the_jsonl_bytes(tmp_path, vocab):
    jsonl = write_jsonl(str(tmp_path / "in.jsonl"), DOCS)
    one = write_parquet(tmp_path / "one.parquet", DOCS)
    shards = tmp_path / "shards" / "nested"
    shards.mkdir(parents=True)
    for i in range(3):  # a folder of shards, read in name order (recursively)
        write_parquet(shards / f"part-{i}.parquet", DOCS[i * 100:(i + 1) * 100], row_group_size=30)
    saved = save_to_disk(tmp_path / "saved", DOCS)
    runs = {"jsonl": ([jsonl], "jsonl", {}), "parquet": ([one], "parquet", {"workers": 2}),
            "parquet-sliced": ([one], "parquet", {"workers": 2, "chunk_bytes": 1500}),
            "parquet-folder": ([str(tmp_path / "shards")], "parquet", {"workers": 2, "partitions": 2}),
            "arrow": ([saved], "arrow", {"workers": 2, "chunk_bytes": 2000})}
    outputs, reports = {}, {}
    for name, (inputs, fmt, kwargs) in runs.items():
        reports[name] = run(inputs, tmp_path / name, vocab, input_format=fmt, split_sentences=True, **kwargs)
        outputs[name] = output(tmp_path / name)
    assert len(outputs["jsonl"][0]) > 5000
    for name in runs:
        assert outputs[name] == outputs["jsonl"], name
        assert reports[name].records == len(DOCS), name
    assert reports["parquet-folder"].files == 3 and reports["arrow"].files == 2
    assert reports["parquet"].text_bytes == sum(len(d.encode()) for d in DOCS)
    # row groups read in slices of about chunk_bytes, Arrow files in runs of record batches
    sliced = [c for c, _ in iter_documents([one], "parquet", ["text"], chunk_bytes=1500)]
    assert len(sliced) > 2 * pq.ParquetFile(one).metadata.num_row_groups
    assert [(c.start, c.end) for c in sliced] == list(zip([0] + [c.end for c in sliced[:-1]], [c.end for c in sliced]))
    chunks = [c for c, _ in iter_documents([os.path.join(saved, "data-00000-of-00002.arrow")], "arrow", ["text"],
                                           chunk_bytes=2000)]
    assert len(chunks) > 2 and [c.start for c in chunks] == sorted(c.start for c in chunks)


def test_a_vocabulary_learns_from_parquet_what_it_learns_from_jsonl(tmp_path):
    """build_vocab reads the same documents in the same order (the WordPiece trainer itself breaks
    ties differently from run to run, so the vocabularies are not compared)."""
    jsonl = write_jsonl(str(tmp_path / "in.jsonl"), DOCS)
    parquet = write_parquet(tmp_path / "in.parquet", DOCS)
    assert [d for _, p in iter_documents([parquet], "parquet", ["text"]) for d in p.documents] == \
        [d for _, p in iter_documents([jsonl], "jsonl", ["text"]) for d in p.documents] == [[d] for d in DOCS]
    reports = {fmt: build_vocab([path], fmt, ["text"], VocabOptions(vocab_size=150), str(tmp_path / f"{fmt}.txt"),
                                str(tmp_path / f"{fmt}.json")) for path, fmt in ((jsonl, "jsonl"), (parquet, "parquet"))}
    assert reports["parquet"].documents == reports["jsonl"].documents == len(DOCS)
    assert reports["parquet"].text_chars == reports["jsonl"].text_chars > 10000


def test_nulls_are_counted_by_row_and_bad_shards_named(tmp_path, vocab):
    texts = list(DOCS[:90])
    texts[44] = None
    texts[81] = None
    path = write_parquet(tmp_path / "nulls.parquet", texts, row_group_size=40)
    report = run([path], tmp_path / "nulls", vocab, input_format="parquet")
    assert report.records == 88 and report.problem_counts == {"non-string value": 2}
    assert report.problems == [f"{path}: row 45: null in column 'text'", f"{path}: row 82: null in column 'text'"]
    assert "malformed lines skipped: 2" in format_report(report)
    with pytest.raises(CorpusError, match=r"row 45: null in column 'text' \(--strict"):
        run([path], tmp_path / "strict", vocab, input_format="parquet", strict=True)

    with pytest.raises(PreprocessError, match=r"^\S+nulls.parquet: no column 'body' \(it has id, text\)"):
        run([path], tmp_path / "body", vocab, input_format="parquet", json_keys=("body",))
    numbers = write_parquet(tmp_path / "numbers.parquet", DOCS[:5], body=[1, 2, 3, 4, 5])
    with pytest.raises(PreprocessError, match=r"^\S+numbers.parquet: column 'body' holds int64, not text"):
        run([numbers], tmp_path / "numbers", vocab, input_format="parquet", json_keys=("body",))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(open(path, "rb").read()[:300])
    with pytest.raises(CorpusError, match=r"broken.parquet: not a readable Parquet file"):
        run([str(broken)], tmp_path / "broken", vocab, input_format="parquet")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(CorpusError, match=r"a saved DatasetDict \(splits: train, test\): give one split's folder"):
        run([str(tmp_path / "dd")], tmp_path / "dd-out", vocab, input_format="arrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"holds no .parquet file"):
        run([str(tmp_path / "empty")], tmp_path / "empty-out", vocab, input_format="parquet")
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".bin", ".idx")) and "nulls" not in n]


def test_reading_a_table_holds_one_chunk_at_a_time(tmp_path):
    """A 16 MB Parquet file of 32 row groups: the documents of one row group (0.5 MB) in memory at a time."""
    text = "word " * 1000  # 5 kB
    path = write_parquet(tmp_path / "big.parquet", [text] * 3200, row_group_size=100)
    tracemalloc.start()
    documents_read = 0
    for _, parsed in iter_documents([path], "parquet", ["text"]):
        documents_read += len(parsed.documents)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert documents_read == 3200
    assert peak < 4e6, peak  # a few row groups' worth, not the file's 16 MB
