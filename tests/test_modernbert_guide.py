"""docs/modernbert.md's "Pretraining a ModernBERT, step by step", run as written: the fenced
block is read from the Markdown and given to bash unchanged, with its four variables set to a
small generated corpus, MRPC-layout files, STEPS=16 and an output directory (BPE vocabulary,
preprocessing, the tiny recipe's phase 1 with packed rows at TP2, conversion, transformers' own
fill-mask pipeline, our fill-mask, fine-tuning exported as ModernBertForSequenceClassification).
Then docs/finetuning.md's "From an MLM-pretrained encoder to an embedding model, step by step" from
that pretrained encoder, as written, with small generated pairs and retrieval files (contrastive
training at DP2 with gradient caching, mining, a second round with the mined negatives, the export
in sentence-transformers). The figures the guides state for their default data were measured by
running the blocks with their defaults (the figures and the commands are in the guides)."""
import json
import re
import subprocess

import pytest

from distributed import REPO, free_port, shell_env
from docs_blocks import documented_block
from test_first_run import mrpc_files
from toy_corpus import documents

pytestmark = pytest.mark.slow

HEADING = "## Pretraining a ModernBERT, step by step"
EMBEDDING_HEADING = "## From an MLM-pretrained encoder to an embedding model, step by step"


def retrieval_inputs(root, pairs: int = 640, queries: int = 24):
    """PAIRS (a document's first sentence and the rest, numbered so no text repeats) and BEIR files."""
    docs = documents(pairs + queries, seed=5)
    split = [(f"{d.split('. ')[0]} (number {i}).", ". ".join(d.split(". ")[1:]) + f" (number {i})")
             for i, d in enumerate(docs)]
    (root / "pairs.jsonl").write_text("".join(json.dumps({"anchor": a, "positive": p, "source": "toy"}) + "\n"
                                              for a, p in split[:pairs]))
    beir = root / "beir"
    beir.mkdir()
    held_out = split[pairs:]
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": a}) + "\n"
                                                for i, (a, _) in enumerate(held_out)))
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": p}) + "\n"
                                               for i, (_, p) in enumerate(held_out)))
    (beir / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n"
                                                                           for i in range(len(held_out))))
    return root / "pairs.jsonl", beir


def run_guide(root):
    """Both blocks run with their inputs made under `root`, the embedding guide from the first's
    encoder unless the first failed (conftest.py's guide_runs runs them beside the other guides):
    (the pretraining block's CompletedProcess, its output folder) and (the embedding block's or None,
    its output folder)."""
    books = root / "books"
    books.mkdir()
    for part in range(2):
        (books / f"part{part}.txt").write_text("\n".join(documents(400, seed=part)) + "\n", encoding="utf-8")
    mrpc_files(root / "MRPC")
    out = root / "run"
    env = shell_env(CORPUS=str(books), GLUE_MRPC=str(root / "MRPC"), STEPS="16", OUT=str(out),
                    MASTER_PORT=str(free_port()))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_block("modernbert.md", HEADING)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    pairs, beir = retrieval_inputs(root)
    embedder = root / "embedder"
    env = shell_env(MODEL=str(out / "hf"), PAIRS=str(pairs), BEIR=str(beir), OUT=str(embedder),
                    MASTER_PORT=str(free_port()))
    embedded = None if done.returncode else subprocess.run(
        ["bash", "-euo", "pipefail", "-c", documented_block("finetuning.md", EMBEDDING_HEADING)], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=900)
    return (done, out), (embedded, embedder)


def test_the_modernbert_guide_works_as_documented(guide):
    (done, out), (embedded, embedder) = guide
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output and "error" not in output.lower(), output[-5000:]
    warned = [line for line in output.splitlines() if re.search(r"\b\w*Warning\b|warnings\.warn\(|\[WARNING\]", line)]
    assert not warned, "\n".join(warned[:10])
    assert "TP2 x PP1 x DP1" in output, output[-5000:]  # the layout took effect
    assert "optimizer stable_adamw" in output and "step 16/16" in output, output[-5000:]  # the recipe's
    assert not (out / "pydocs").exists()  # both inputs given: the default data is not made
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["model_type"] == "modernbert" and config["architectures"] == ["ModernBertForMaskedLM"]
    assert (out / "hf" / "tokenizer.json").exists() and not (out / "hf" / "vocab.txt").exists()
    # transformers' pipeline and our fill-mask each printed three predictions
    assert output.count("The [MASK] statement is used for conditional execution.") >= 1
    metrics = json.loads((out / "mrpc" / "metrics.json").read_text())
    assert set(metrics["best"]["metrics"]) >= {"accuracy", "f1"}
    best = json.loads((out / "mrpc" / "best" / "config.json").read_text())
    assert best["architectures"] == ["ModernBertForSequenceClassification"]

    # the embedding guide, from this pretrained encoder
    done = embedded
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output and "error" not in output.lower(), output[-5000:]
    warned = [line for line in output.splitlines() if re.search(r"\b\w*Warning\b|warnings\.warn\(|\[WARNING\]", line)]
    assert not warned, "\n".join(warned[:10])
    assert not (embedder / "pydocs").exists()  # both inputs given: the default data is not made
    # the layout and the caching took effect, in both rounds
    assert output.count("TP1 x PP1 x DP2") == 2 and output.count("gradient-cached in mini-batches of 16") == 2, output[-5000:]
    for round_ in ("round1", "round2"):
        metrics = json.loads((embedder / round_ / "metrics.json").read_text())
        assert metrics["selected_by"] == "ndcg@10" and metrics["history"][0]["step"] == 0
        assert set(metrics["best"]["metrics"]) == {"ndcg@10", "mrr@10", "recall@100"}
        assert (embedder / round_ / "best" / "modules.json").exists()
    mined = [json.loads(line) for line in (embedder / "mined.jsonl").read_text().splitlines()]
    assert len(mined) >= 64 and all(len(row["negatives"]) == 1 and row["source"] == "toy" for row in mined)
    last = done.stdout.strip().splitlines()[-1].split()
    assert last[0] == "64" and -1.0 <= float(last[1]) <= 1.0, output[-2000:]  # sentence-transformers' max_seq_length, a cosine
