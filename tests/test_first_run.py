"""docs/training.md's "Your first run, step by step", run as written: the fenced block is read from
the Markdown and given to bash unchanged, with its four variables set to a small generated corpus
of .txt files, MRPC-layout files, STEPS=6 and an output directory. Every command of the block
must work as the docs print it (vocabulary, preprocessing, pretraining stopped half way and
resumed by the same command, conversion, fill-mask, fine-tuning)."""
import json
import random
import re
import subprocess

import pytest

from distributed import REPO, free_port, shell_env
from docs_blocks import documented_block
from toy_corpus import documents

pytestmark = pytest.mark.slow

HEADING = "## Your first run, step by step"


def mrpc_files(directory, rows_per_split=(64, 32)):
    directory.mkdir()
    rng = random.Random(0)
    sentences = documents(200, seed=3)
    for name, rows in zip(("train.tsv", "dev.tsv"), rows_per_split):
        lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        for i in range(rows):
            a, b = rng.sample(sentences, 2)
            same = rng.random() < 0.5
            lines.append(f"{int(same)}\t{2 * i}\t{2 * i + 1}\t{a}\t{a if same else b}")
        (directory / name).write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_guide(root):
    """The block run with its inputs made under `root` (conftest.py's guide_runs runs it beside the
    other guides): bash's CompletedProcess and the output folder."""
    books = root / "books"
    books.mkdir()
    for part in range(2):  # one paragraph per line, as the block says
        (books / f"part{part}.txt").write_text("\n".join(documents(400, seed=part)) + "\n", encoding="utf-8")
    mrpc_files(root / "MRPC")
    out = root / "run"
    env = shell_env(CORPUS=str(books), GLUE_MRPC=str(root / "MRPC"), STEPS="6", OUT=str(out),
                    MASTER_PORT=str(free_port()))  # launcher.sh's default when set: other jobs run side by side
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_block("training.md", HEADING)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    return done, out


def test_the_first_run_works_as_documented(guide):
    done, out = guide
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output and "error" not in output.lower(), output[-5000:]
    # launcher.sh prints what it runs (torchrun); DeepSpeed's CPU chatter is not shown (pretrain/common/quiet.py)
    assert [line for line in done.stdout.splitlines() if line.startswith("+ ")][0].startswith(
        "+ python -m pretrain.resilience.torchrun --nnodes 1 --node-rank 0 --nproc-per-node 2")
    assert "built successfully" not in output and "Setting accelerator to CPU" not in output, output[-5000:]
    # no torchrun banner about OMP_NUM_THREADS (launcher.sh sets torchrun's own default); what a
    # launch does is said before it does it: the first line of the ranks comes before their imports,
    # an index build is announced before it runs
    assert "OMP_NUM_THREADS" not in output, output[-5000:]
    lines = done.stdout.splitlines()
    launched = next(i for i, line in enumerate(lines) if line.startswith("+ python -m pretrain.resilience.torchrun"))
    assert lines[launched + 1].startswith("starting: loading torch, DeepSpeed and megatron-core"), lines[launched:launched + 3]
    building = [i for i, line in enumerate(lines) if "building index" in line]
    built = [i for i, line in enumerate(lines) if "built index" in line]
    assert building and len(building) == len(built) and all(b < a for b, a in zip(building, built)), lines
    # no library warning reaches the user, from the ranks or from their loader processes (issue 36)
    warned = [line for line in output.splitlines() if re.search(r"\b\w*Warning\b|warnings\.warn\(|\[WARNING\]", line)]
    assert not warned, "\n".join(warned[:10])
    # the first launch stopped at step 3 with a checkpoint; the second resumed it and ran to step 6
    assert f"resumed from {out}/checkpoints at step 3" in output, output[-5000:]
    assert (out / "checkpoints" / "latest").read_text() == "iter_0000006"
    assert (out / "hf" / "config.json").exists() and (out / "hf" / "vocab.txt").exists()
    assert "It was the [MASK] of the family." in output  # fill-mask's predictions for the sentence
    metrics = json.loads((out / "mrpc" / "metrics.json").read_text())
    assert set(metrics["best"]["metrics"]) >= {"accuracy", "f1"}
    assert (out / "mrpc" / "best" / "config.json").exists()
