"""Contrastive training (`python -m finetune embed`) at every layout equals one process, and its export
is a sentence-transformers model giving our embeddings.

Three process groups, each started once and running several configurations (tests/_embed_worker.py):
one process (the reference, BERT and ModernBERT, packed; padded instead; gradient-cached), two data-parallel
ranks (gathered negatives; ZeRO-1 cached, ZeRO-2, bf16) and two tensor-parallel ranks. Every fp32 run
equals the one-process run with the whole global batch, within 1e-5: the losses of every step and
the weights after the steps. Each checks that its layout, caching or precision took effect (the
DP/TP sizes, the half-width weight shard, the texts packed into one row or padded each to its own,
DeepSpeed's accumulation steps for the mini-batches, the
ZeRO stage and the parameter dtype). The exports of the BERT and ModernBERT runs load in
`SentenceTransformer(path)` offline, with our pooling, normalisation and trained length, and its
`encode()` equals the trainer's own embeddings within 1e-5.
"""
import json

import numpy as np
import pytest

from distributed import run_python, run_ranks
from test_hf_directories import save_directory, tiny_model
from test_modernbert import saved_model

pytestmark = pytest.mark.slow

ROWS, BATCH, STEPS = 24, 8, 3  # 24 rows of distinct texts: three full batches of 8, one epoch
PROBE = ["w3 w5 the cat", "w40 w2 in the park w9", "hello world w11", "w7"]


def pairs_file(path, rows: int = ROWS):
    """(anchor, positive, negative) rows of distinct texts from the tiny vocabulary; each positive
    shares words with its anchor, each negative with another row's."""
    lines = []
    for i in range(rows):
        a, b, c = f"w{i % 60}", f"w{(i * 7 + 3) % 60}", f"w{(i * 11 + 5) % 60}"
        lines.append(json.dumps({"anchor": f"{a} {b} the cat {i}", "positive": f"{a} {b} {c} in the park {i}",
                                 "neg": f"{c} w{(i + 13) % 60} are playing {i}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def retrieval_files(root):
    queries = [{"_id": f"q{i}", "text": f"w{i} w{(i * 7 + 3) % 60}"} for i in range(6)]
    corpus = [{"_id": f"d{i}", "title": f"w{i}", "text": f"w{(i * 7 + 3) % 60} in the park"} for i in range(10)]
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (root / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n" for i in range(6)))
    return [f"eval.queries={root / 'queries.jsonl'}", f"eval.corpus={root / 'corpus.jsonl'}",
            f"eval.qrels={root / 'qrels.tsv'}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from transformers import BertModel

    root = tmp_path_factory.mktemp("embed")
    bert = save_directory(root / "bert", tiny_model(BertModel), lowercase=False)
    _, modern = saved_model(root, "every2-window8")
    pairs = pairs_file(root / "pairs.jsonl")
    base = [f"data.train_files=[{pairs}]", "data.negative_columns=[neg]", "data.max_seq_length=24",
            f"train.global_batch_size={BATCH}", "train.lr=1e-3", "train.warmup_ratio=0", "loss.symmetric=true"]
    models = {"bert": f"model.init_from={bert}", "modern": f"model.init_from={modern}"}

    def run(name, model, *overrides):
        return json.dumps({"name": name, "texts": PROBE, "overrides": [
            *base, models[model], f"train.output_dir={root / name}", *overrides]})

    results = {}
    for tp, world, runs in [
        (1, 1, [run("bert", "bert", *retrieval_files(root)), run("bert-cached", "bert", "train.micro_batch_size=3"),
                run("bert-padded", "bert", "train.packing=false"),
                run("modern", "modern", "model.pooling=cls")]),
        (1, 2, [run("bert-dp2-zero1-cached", "bert", "parallel.zero_stage=1", "train.micro_batch_size=2"),
                run("bert-dp2-zero2-bf16", "bert", "parallel.zero_stage=2", "train.precision=bf16"),
                run("modern-dp2-zero2", "modern", "model.pooling=cls", "parallel.zero_stage=2")]),
        (2, 2, [run("bert-tp2", "bert"),
                run("modern-tp2-cached", "modern", "model.pooling=cls", "train.micro_batch_size=4")]),
    ]:
        out = root / f"results-{world}-{tp}.json"
        run_ranks(["tests/_embed_worker.py", str(out), str(tp), *runs], world, timeout=600)
        results.update(json.loads(out.read_text()))
    return root, results


def max_weight_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.mark.parametrize("name, reference", [
    ("bert-cached", "bert"), ("bert-padded", "bert"), ("bert-dp2-zero1-cached", "bert"), ("bert-tp2", "bert"),
    ("modern-dp2-zero2", "modern"), ("modern-tp2-cached", "modern")])
def test_every_layout_and_the_cached_step_equal_one_process_with_the_global_batch(trained, name, reference):
    _, results = trained
    run, whole = results[name], results[reference]
    assert len(run["losses"]) == len(whole["losses"]) == STEPS
    assert np.allclose(run["losses"], whole["losses"], atol=1e-5, rtol=0), (run["losses"], whole["losses"])
    assert whole["losses"][-1] < whole["losses"][0]  # it learns
    assert max_weight_difference(run["weights"], whole["weights"]) < 1e-5
    before = results[reference]["weights"]  # and the weights did move from where the steps started
    assert run["dtype"] == "torch.float32" and whole["cached"] is False and whole["accumulation_steps"] == 1
    # the layout and the caching took effect
    share = BATCH // run["dp"]
    if "cached" in name:
        micro = 3 if name == "bert-cached" else (2 if "dp2" in name else 4)
        assert run["cached"] and run["accumulation_steps"] == 3 * -(-share // micro)  # 3 texts per row
    else:
        assert not run["cached"] and run["accumulation_steps"] == 1
    assert (run["tp"], run["dp"]) == ((2, 1) if "tp2" in name else (1, 2) if "dp2" in name else (1, 1))
    full, local = whole["sharded"][1], run["sharded"][1]
    assert run["sharded"][0] == whole["sharded"][0]
    assert local[0] * run["tp"] == full[0] and local[1:] == full[1:]
    assert run["zero_stage"] == (1 if "zero1" in name else 2 if "zero2" in name else 0)
    assert whole["probe_rows"] < len(PROBE)  # packed several to a row, or padded one a row
    assert (run["probe_rows"] == len(PROBE)) if name == "bert-padded" else (run["probe_rows"] == whole["probe_rows"])
    assert before


def test_bf16_at_zero_2_trains_close_to_fp32(trained):
    _, results = trained
    run, whole = results["bert-dp2-zero2-bf16"], results["bert"]
    assert run["dtype"] == "torch.bfloat16" and run["zero_stage"] == 2 and run["dp"] == 2
    assert np.allclose(run["losses"], whole["losses"], atol=0.05, rtol=0), (run["losses"], whole["losses"])
    assert 0 < max_weight_difference(run["weights"], whole["weights"]) < 0.02


def test_evaluation_is_recorded_and_selects_the_best(trained):
    root, results = trained
    history = results["bert"]["history"]
    assert [h["step"] for h in history] == [0, STEPS]
    assert set(history[0]["metrics"]) == {"ndcg@10", "mrr@10", "recall@100"}
    metrics = json.loads((root / "bert" / "metrics.json").read_text())
    assert metrics["selected_by"] == "ndcg@10" and metrics["history"] == history
    best = max(history, key=lambda h: h["metrics"]["ndcg@10"])
    assert metrics["best"]["step"] == best["step"]
    assert json.loads((root / "bert" / "best" / "embed_result.json").read_text()) == metrics["best"]
    # without an evaluation set the last step's weights are the ones kept
    assert json.loads((root / "modern" / "metrics.json").read_text())["selected_by"].startswith("the last step")
    assert (root / "bert-tp2" / "tensorboard").is_dir()


@pytest.mark.parametrize("name, pooling", [("bert-tp2", "mean"), ("modern", "cls"), ("modern-dp2-zero2", "cls")])
def test_the_export_is_a_sentence_transformers_model_giving_our_embeddings(trained, name, pooling):
    root, results = trained
    script = ("import json, sys; from sentence_transformers import SentenceTransformer; "
              "m = SentenceTransformer(sys.argv[1], device='cpu', local_files_only=True); "
              "print(json.dumps({'length': m.max_seq_length, 'modules': [type(x).__name__ for x in m], "
              "'embeddings': m.encode(json.loads(sys.argv[2]), batch_size=2).tolist()}))")
    done = run_python(["-c", script, str(root / name / "best"), json.dumps(PROBE)], timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["length"] == 24 and theirs["modules"][1:] == ["Pooling", "Normalize"]
    config = json.loads((root / name / "best" / "config.json").read_text())  # an encoder transformers.AutoModel loads
    assert config["architectures"] == ["BertModel" if name.startswith("bert") else "ModernBertModel"]
    pooling_config = json.loads((root / name / "best" / "1_Pooling" / "config.json").read_text())
    assert pooling_config[f"pooling_mode_{'mean_tokens' if pooling == 'mean' else 'cls_token'}"] is True
    ours = np.asarray(results[name]["embeddings"])
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert np.allclose(np.asarray(theirs["embeddings"]), ours, atol=1e-5), np.abs(np.asarray(theirs["embeddings"]) - ours).max()
