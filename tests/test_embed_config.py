"""`python -m finetune embed`'s configuration and evaluation files, refused up front with every
problem named (torch-free: no process group, no model)."""
import json

import pytest

from distributed import run_python
from finetune.embedding.config import load_embed_config
from finetune.embedding.data import ContrastiveDataError
from finetune.embedding.eval_data import read_retrieval_set, read_similarity_set
from pretrain.config import ConfigError


def problems(overrides, world_size=1):
    with pytest.raises(ConfigError) as error:
        load_embed_config(None, overrides).validate(world_size)
    return error.value.problems


def test_every_problem_of_a_config_is_named_at_once(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"anchor": "a", "positive": "b"}\n')
    found = problems([f"data.train_files=[{pairs}]", f"model.init_from={tmp_path}", "eval.queries=" + str(pairs),
                      "eval.metric=spearman", "model.pooling=max", "loss.matryoshka_dims=[8,4]",
                      "loss.matryoshka_weights=[1.0]", "train.global_batch_size=6", "parallel.tensor_parallel=1",
                      "train.precision=fp16"], world_size=4)
    assert found == [
        "eval.queries, eval.corpus and eval.qrels go together: retrieval needs all three",
        "eval.metric spearman needs eval.similarity_file",
        "model.pooling 'max' must be one of mean, cls, last",
        "loss.matryoshka_weights has 1 weights for 2 loss.matryoshka_dims",
        "train.precision 'fp16' must be fp32 or bf16",
        "train.global_batch_size (6) must be a multiple of the data-parallel size (4)",
    ]
    assert problems([]) == [
        "data.train_files is required: JSON lines, TSV or Parquet files of (anchor, positive[, negatives]) rows",
        "model.init_from is required: a native checkpoint or a Hugging Face BERT or ModernBERT directory"]
    cfg = load_embed_config(None, [f"data.train_files=[{pairs}]", f"model.init_from={tmp_path}"])
    cfg.validate(2)
    assert cfg.eval.selection_metric() is None and cfg.share(2) == 32


def test_the_command_refuses_a_bad_config_before_any_process_group(tmp_path):
    done = run_python(["-m", "finetune", "embed", f"model.init_from={tmp_path / 'missing'}", "train.lr=-1"], timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("invalid configuration (") and lines[0].endswith("configs/finetune/embed.yaml + command line):")
    assert any(f"model.init_from {tmp_path / 'missing'} does not exist" in line for line in lines)
    assert any("data.train_files is required" in line for line in lines)
    assert any("train.lr must be > 0" in line for line in lines)


def beir(tmp_path, qrels: str, corpus_extra: str = ""):
    (tmp_path / "q.jsonl").write_text('{"_id": "q1", "text": "what is a cat"}\n{"_id": 2, "text": "dogs"}\n')
    (tmp_path / "c.jsonl").write_text('{"_id": "d1", "title": "Cats", "text": "a small animal"}\n'
                                      '{"_id": "d2", "text": "a loyal animal"}\n' + corpus_extra)
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + qrels)
    return tmp_path / "q.jsonl", tmp_path / "c.jsonl", tmp_path / "qrels.tsv"


def test_retrieval_files_are_read_as_beir_lays_them_out_and_a_bad_line_is_named(tmp_path):
    q, c, r = beir(tmp_path, "q1\td1\t1\n2\td2\t2\n2\td1\t0\n")
    data = read_retrieval_set(str(q), str(c), str(r))
    assert data.query_ids == ["q1", "2"] and data.documents == ["Cats a small animal", "a loyal animal"]
    assert data.qrels == {"q1": {"d1": 1}, "2": {"d2": 2, "d1": 0}}
    for qrels, extra, message in [
        ("q1\td9\t1\n", "", f"{r}:2: document 'd9' is not in {c}"),
        ("q9\td1\t1\n", "", f"{r}:2: query 'q9' is not in {q}"),
        ("q1\td1\thigh\n", "", f"{r}:2: score 'high' is not a number"),
        ("q1\td1\n", "", f"{r}:2: needs query-id, corpus-id and score, tab-separated"),
        ("q1\td1\t0\n", "", f"{r}: no relevant (score > 0) judgement"),
        ("q1\td1\t1\n", '{"_id": "d1", "text": "again"}\n', f"{c}:3: _id 'd1' appears twice"),
        ("q1\td1\t1\n", "not json\n", f"{c}:3: invalid JSON"),
    ]:
        q, c, r = beir(tmp_path, qrels, extra)
        with pytest.raises(ContrastiveDataError) as error:
            read_retrieval_set(str(q), str(c), str(r))
        assert str(error.value) == message


def test_similarity_pairs_from_json_lines_or_tsv(tmp_path):
    rows = [{"a": "x", "b": "y", "s": 1.0}, {"a": "x", "b": "z", "s": "0.5"}]
    jsonl = tmp_path / "sts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tsv = tmp_path / "sts.tsv"
    tsv.write_text("a\tb\ts\nx\ty\t1.0\nx\tz\t0.5\n")
    for path in (jsonl, tsv):
        data = read_similarity_set(str(path), "a", "b", "s")
        assert (data.first, data.second, data.scores) == (["x", "x"], ["y", "z"], [1.0, 0.5])
    tsv.write_text("a\tb\ts\nx\ty\tnone\n")
    with pytest.raises(ContrastiveDataError) as error:
        read_similarity_set(str(tsv), "a", "b", "s")
    assert str(error.value) == f"{tsv}:2: 's' is not a number"


def test_the_shipped_config_states_the_defaults_an_installed_package_runs_on():
    """Without the repository's configs/ (an installed wheel), the command runs on the sections'
    defaults: they must be what configs/finetune/embed.yaml says."""
    from finetune.embedding.main import DEFAULT_CONFIG

    assert load_embed_config(DEFAULT_CONFIG).to_dict() == load_embed_config(None).to_dict()
