"""docs/modernbert.md's "The three phases on one machine", run as written: the fenced block is read
from the Markdown and given to bash unchanged, with DATA and VOCAB set to a small generated corpus
tokenized with a byte-level BPE (tools/build_vocab.py, tools/preprocess_data.py). Phase 1 ramps its
batch in tokens, phase 2 extends the context to 4x at TP2 with a new rotary base, phase 3 decays;
each phase starts from the last with its overrides logged, the tokens seen count on, and every
phase's transformers export loads in transformers and reads a sequence of the phase's length."""
import json
import re
import subprocess

import pytest

from distributed import REPO, free_port, run_python, shell_env
from docs_blocks import documented_block
from toy_corpus import documents

pytestmark = pytest.mark.slow

HEADING = "### The three phases on one machine"


def tool(*args, **kwargs):
    done = run_python(list(args), timeout=300, **kwargs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_three_phases_run_as_documented(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(documents(300, seed=3)) + "\n", encoding="utf-8")
    tool("tools/build_vocab.py", "--model", "bpe", "--input", str(corpus), "--input-format", "text-lines",
         "--vocab-size", "1000", "--output-dir", str(tmp_path / "vocab"))
    tool("tools/preprocess_data.py", "--input", str(corpus), "--input-format", "text-lines", "--split-sentences",
         "--tokenizer-json", str(tmp_path / "vocab" / "tokenizer.json"), "--output-prefix", str(tmp_path / "data" / "toy"))
    out = tmp_path / "recipe"
    env = shell_env(DATA=str(tmp_path / "data" / "toy_text_sentence"), VOCAB=str(tmp_path / "vocab" / "tokenizer.json"),
                    OUT=str(out), MASTER_PORT=str(free_port()))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_block("modernbert.md", HEADING)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "Traceback" not in output, output[-6000:]

    # phase 1: the batch ramps 8 -> 32 in multiples of 8; the LR warms up in tokens, then holds
    steps = [line for line in output.splitlines() if re.search(r"step \d+/16 \|", line)]
    batches = [int(re.search(r"\| batch (\d+) ", line).group(1)) for line in steps]
    assert batches[0] == 8 and batches[-1] == 32 and batches == sorted(batches) and len(set(batches)) >= 3, batches
    # phases 2 and 3 start from the last one, saying what they change
    starts = [line for line in output.splitlines() if "checkpoint.new_phase: a new phase from" in line]
    assert len(starts) == 2, output[-6000:]
    assert f"{out}/phase1/iter_0000016" in starts[0] and f"{out}/phase2/iter_0000008" in starts[1]
    for change in ("data.seq_length 64 -> 256", "model.global_rope_theta 10000.0 -> 160000.0",
                   "model.max_position_embeddings 64 -> 256", "optimizer.lr 0.003 -> 0.001",
                   "data.masked_lm_prob 0.3 -> 0.15", "train.global_batch_size 32 -> 16"):
        assert change in starts[0], starts[0]
    for change in ("scheduler.decay constant -> 1-sqrt", "data.masked_lm_prob 0.15 -> 0.05"):
        assert change in starts[1], starts[1]
    assert "TP2 x PP1 x DP1" in output  # phase 2 ran at TP2 (phase 1 at TP1: a layout-free start)
    # the tokens seen count on across phases: phase 1's 16 steps, phase 2's 8 x 16 x 256
    tokens_1 = int(re.search(r"a new phase from \S+ \(its step 16, ([\d,]+) tokens seen\)", starts[0]).group(1).replace(",", ""))
    tokens_2 = int(re.search(r"\(its step 8, ([\d,]+) tokens seen\)", starts[1]).group(1).replace(",", ""))
    assert tokens_2 == tokens_1 + 8 * 16 * 256
    # phase 3 decays 1 - sqrt to 0.001x: its last step's rate is about the floor
    last = [line for line in output.splitlines() if re.search(r"step 6/6 \|", line)][-1]
    assert float(re.search(r"\| lr ([\d.e+-]+) ", last).group(1)) < 0.5e-3

    from transformers import AutoModelForMaskedLM
    import torch

    for phase, length, theta in ((1, 64, 10000.0), (2, 256, 160000.0), (3, 256, 160000.0)):
        directory = out / f"phase{phase}-hf"
        config = json.loads((directory / "config.json").read_text())
        assert config["architectures"] == ["ModernBertForMaskedLM"] and config["max_position_embeddings"] == length
        assert config["global_rope_theta"] == theta
        # the length trained at, every phase so far, where transformers and sentence-transformers read it
        assert json.loads((directory / "tokenizer_config.json").read_text())["model_max_length"] == length
        assert json.loads((directory / "sentence_bert_config.json").read_text())["max_seq_length"] == length
        saves = out / f"phase{phase}"
        meta = json.loads((saves / (saves / "latest").read_text().strip() / "meta.json").read_text())
        assert meta["trainer_state"]["trained_seq_length"] == length
        model = AutoModelForMaskedLM.from_pretrained(directory).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.randint(10, 1000, (1, length))).logits
        assert logits.shape == (1, length, config["vocab_size"]) and torch.isfinite(logits).all()
