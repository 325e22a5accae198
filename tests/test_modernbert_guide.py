"""docs/modernbert.md's "Pretraining a ModernBERT, step by step", run as written: the fenced
block is read from the Markdown and given to bash unchanged, with its four variables set to a
small generated corpus, MRPC-layout files, STEPS=16 and an output directory (BPE vocabulary,
preprocessing, the tiny recipe's phase 1 with packed rows at TP2, conversion, transformers' own
fill-mask pipeline, our fill-mask, fine-tuning exported as ModernBertForSequenceClassification).
The accuracy the guide states for its default data was measured by running the block with its
defaults (the figures and the command are in the guide)."""
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


def test_the_modernbert_guide_works_as_documented(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    for part in range(2):
        (books / f"part{part}.txt").write_text("\n".join(documents(400, seed=part)) + "\n", encoding="utf-8")
    mrpc_files(tmp_path / "MRPC")
    out = tmp_path / "run"
    env = shell_env(CORPUS=str(books), GLUE_MRPC=str(tmp_path / "MRPC"), STEPS="16", OUT=str(out),
                    MASTER_PORT=str(free_port()))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_block("modernbert.md", HEADING)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
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
