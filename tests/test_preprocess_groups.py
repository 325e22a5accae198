"""One dataset per value of a column (tools/preprocess_data.py --group-by; pretrain/data/preprocess/
groups.py): each group's dataset holds exactly its documents, in input order, token for token what
the whole corpus preprocessed at once holds for them; Parquet with a dictionary-encoded column gives
the JSONL bytes; the manifest lists every group with its documents and tokens; a config naming the
manifest trains on the same blend as one listing the datasets; bad groups are one line each."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _preprocess_helpers import documents, small_vocab
from pretrain.data.preprocess.groups import GroupManifestError, read_manifest
from pretrain.data.preprocess.pipeline import PreprocessError, PreprocessOptions, format_report, preprocess

pytestmark = pytest.mark.slow  # worker processes
DOCS = documents(240, seed=7, empty_every=19)
VALUES = ["en", "de", "zh/Hans"]
# the group of each document: runs of different lengths, so every chunk holds several groups
GROUPS = [VALUES[(i // 7 + i // 11) % 3] for i in range(len(DOCS))]
BAD = {30: "missing", 31: "not text"}  # rows whose group is missing (JSONL) or null (Parquet)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> str:
    return small_vocab(str(tmp_path_factory.mktemp("vocab")))


def write_grouped_jsonl(path) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, (doc, group) in enumerate(zip(DOCS, GROUPS)):
            record = {"text": doc, "lang": group}
            if BAD.get(i) == "missing":
                del record["lang"]
            elif BAD.get(i) == "not text":
                record["lang"] = 3
            f.write(json.dumps(record) + "\n")
    return str(path)


def run(inputs, prefix, vocab, **kwargs):
    return preprocess(PreprocessOptions(inputs=tuple(inputs), output_prefix=str(prefix), vocab_file=vocab,
                                        progress=False, split_sentences=True, **kwargs))


def read_documents(prefix) -> list[list[list[int]]]:
    """Every document of a dataset as its sentences' token ids, read with megatron-core's reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    return [[dataset[s].tolist() for s in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


def test_each_group_holds_its_documents_as_the_whole_corpus_does(tmp_path, vocab):
    grouped = write_grouped_jsonl(tmp_path / "grouped.jsonl")
    kept = [i for i in range(len(DOCS)) if i not in BAD]
    with open(tmp_path / "whole.jsonl", "w", encoding="utf-8") as f:  # the reference: the kept rows at once
        f.writelines(json.dumps({"text": DOCS[i]}) + "\n" for i in kept)
    run([str(tmp_path / "whole.jsonl")], tmp_path / "whole", vocab)
    whole = read_documents(tmp_path / "whole_text_sentence")
    with_tokens = [i for i in kept if DOCS[i].strip()]  # empty documents are dropped (counted)
    assert len(whole) == len(with_tokens)
    expected = {value: [doc for i, doc in zip(with_tokens, whole) if GROUPS[i] == value] for value in VALUES}

    report = run([grouped], tmp_path / "g", vocab, group_by="lang", workers=2, chunk_bytes=1500)
    entries = {e.value: e for e in read_manifest(str(tmp_path / "g_text_sentence.groups.json"))}
    assert sorted(entries) == sorted(VALUES)
    assert entries["zh/Hans"].prefix == str(tmp_path / "g_zh-Hans_text_sentence")
    for value in VALUES:
        got = read_documents(entries[value].prefix)
        assert got == expected[value], value
        assert entries[value].documents == len(got)
        assert entries[value].tokens == sum(len(s) for doc in got for s in doc) > 0
        fingerprint = json.load(open(entries[value].prefix + ".fingerprint.json"))
        assert fingerprint["token_counts"]["total"] == entries[value].tokens
    assert report.problem_counts == {"missing key": 1, "non-string value": 1}
    assert report.keys["text"].documents == len(with_tokens)
    assert report.keys["text"].empty_documents == len(kept) - len(with_tokens)
    text = format_report(report)
    assert "3 datasets, one per lang, listed in" in text and "grouped.jsonl:32: non-string value for key 'lang'" in text
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]

    # Parquet, two shards, the group column dictionary-encoded with nulls where JSONL's were bad: the JSONL bytes
    shards = tmp_path / "shards"
    shards.mkdir()
    column = pa.array([None if i in BAD else g for i, g in enumerate(GROUPS)]).dictionary_encode()
    table = pa.table({"text": DOCS, "lang": column})
    pq.write_table(table.slice(0, 100), shards / "part-0.parquet", row_group_size=30)
    pq.write_table(table.slice(100), shards / "part-1.parquet", row_group_size=30)
    assert pa.types.is_dictionary(pq.read_table(shards / "part-0.parquet").schema.field("lang").type)
    report = run([str(shards)], tmp_path / "p", vocab, group_by="lang", input_format="parquet", workers=2)
    assert report.problem_counts == {"non-string value": 2}
    for value in VALUES:
        name = value.replace("/", "-")
        for ext in ("bin", "idx"):
            assert (open(tmp_path / f"p_{name}_text_sentence.{ext}", "rb").read()
                    == open(tmp_path / f"g_{name}_text_sentence.{ext}", "rb").read()), (value, ext)


def test_bad_groups_are_one_line_and_write_nothing(tmp_path, vocab, capsys):
    import importlib

    def jsonl(name, values):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps({"text": "the of and", "src": v}) + "\n" for v in values)
        return str(tmp_path / name)

    out = tmp_path / "out"
    cli = importlib.import_module("tools.preprocess_data").main
    status = cli(["--input", jsonl("clash.jsonl", ["web/a", "x", "web-a"]), "--output-prefix", str(out / "c"),
                  "--vocab-file", vocab, "--group-by", "src", "--workers", "1", "--quiet"])
    assert status == 1
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "preprocess_data: error: --group-by src: the values 'web/a' and 'web-a' would both be written as 'web-a'",
        "preprocess_data: no output written"]
    with pytest.raises(PreprocessError, match=r"--group-by src has more than 2 distinct values .*--max-groups"):
        run([jsonl("many.jsonl", ["a", "b", "c"])], out / "m", vocab, group_by="src", max_groups=2)
    assert os.listdir(out) == []  # nothing left, not even temporary files
    problems = PreprocessOptions(inputs=("x",), output_prefix="o", input_format="text-lines", group_by="src",
                                 json_keys=("src",), partitions=2).problems()
    assert problems == ["--group-by reads a JSON key or a column: --input-format text-lines has none",
                        "--group-by src is also a text key (--json-keys)",
                        "--group-by writes each group's dataset in input order already: leave --partitions at 1"]


def test_a_config_naming_the_manifest_trains_on_every_group(tmp_path, vocab):
    from pretrain.checkpoint.starting_point import load_run_config
    from pretrain.config import ConfigError
    from pretrain.data.samples.provider import data_file_problems, pretraining_datasets

    run([write_grouped_jsonl(tmp_path / "c.jsonl")], tmp_path / "c", vocab, group_by="lang")
    manifest = str(tmp_path / "c_text_sentence.groups.json")
    prefixes = [e.prefix for e in read_manifest(manifest)]
    common = ["data.kind=indexed", f"data.vocab_file={vocab}", "data.seq_length=32", "data.sampling_alpha=0.3",
              "model.vocab_size=null", "train.global_batch_size=8", "train.train_steps=50", "eval.interval=0",
              f"data.index_cache_dir={tmp_path / 'cache'}", "data.split=1,0,0"]
    named = load_run_config(None, common + [f"data.paths=[{manifest}]"])
    assert named.data.paths == prefixes and len(prefixes) == 3  # expanded when loaded: the checkpoint records them
    assert data_file_problems(named) == []
    listed = load_run_config(None, common + [f"data.paths=[{','.join(prefixes)}]"])
    blends = [pretraining_datasets(cfg, True, None)[0] for cfg in (named, listed)]
    assert len(blends[0].splits) == 3
    assert np.array_equal(blends[0].blend["corpus"], blends[1].blend["corpus"])
    assert np.bincount(blends[0].blend["corpus"], minlength=3).min() > 0

    with pytest.raises(ConfigError, match=r"data.paths: \S+groups.json stands for one corpus per group: leave "
                                          r"data.weights unset"):
        load_run_config(None, common[:3] + ["data.paths=[" + manifest + ",x]", "data.weights=[1,2]"]).validate()
    broken = tmp_path / "broken.groups.json"
    broken.write_text('{"format": "bert-pretrain corpus groups", "groups": [{"value": "en"}]}')
    cfg = load_run_config(None, common + [f"data.paths=[{broken}]"])
    assert data_file_problems(cfg) == [f"data.paths: {broken}: group 1 is incomplete (KeyError: 'prefix')"]
    with pytest.raises(GroupManifestError, match="not a corpus-group manifest"):
        read_manifest(str(tmp_path / "c_en_text_sentence.fingerprint.json"))
