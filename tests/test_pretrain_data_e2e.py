"""End to end on CPU, as a user runs it: raw text -> tools/build_vocab.py -> tools/preprocess_data.py
-> python -m pretrain on the indexed data (2 data-parallel ranks, loader workers) -> a checkpoint.

Holds: the MLM loss falls, MLM accuracy ends well above the unigram baseline (always answering the
most frequent token), and a resume or phase 2 with another vocabulary than the checkpoint's is
refused before it starts. (The documented first run, command by command: test_first_run.py.)
"""
import re
import subprocess
import sys

import numpy as np
import pytest

from distributed import free_port, REPO, run_python
from toy_corpus import write_jsonl

from pretrain.data.samples.bert_dataset import TokenStore
from pretrain.data.samples.token_ids import WordPieceVocab

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

STEP = re.compile(r"step (\d+)/\d+ \| loss [\d.]+ \| lm ([\d.]+) \| nsp ([\d.]+) \| mlm acc ([\d.]+)")
EVAL = re.compile(r"eval at step (\d+) \| lm ([\d.]+) \| perplexity [\d.]+ \| nsp ([\d.]+) \| mlm acc ([\d.]+) "
                  r"\| nsp acc ([\d.]+)")


def run(args, timeout=600):
    done = run_python(list(args), timeout=timeout)
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def pretrain(overrides, nproc=2):
    args = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
            "-m", "pretrain", "--config", "configs/bert-tiny.yaml", *overrides]
    return run(args)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    write_jsonl(root / "corpus.jsonl", 1500, seed=0)
    run(["tools/build_vocab.py", "--input", str(root / "corpus.jsonl"), "--vocab-size", "256",
         "--output-dir", str(root / "vocab")])
    run(["tools/preprocess_data.py", "--input", str(root / "corpus.jsonl"), "--output-prefix", str(root / "toy"),
         "--vocab-file", str(root / "vocab" / "vocab.txt"), "--split-sentences", "--workers", "2"])
    return root


def common(root, vocab_size):
    return [f"model.vocab_size={vocab_size}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
            "data.kind=indexed", f"data.paths=[{root}/toy_text_sentence]", f"data.vocab_file={root}/vocab/vocab.txt",
            "data.split=95,5", "data.num_workers=1", "optimizer.lr=1e-2", "train.global_batch_size=32",
            "train.micro_batch_size=16", "eval.steps=4", "logging.interval=50", "checkpoint.save_interval=0"]


def test_raw_text_to_pretrained_model(prepared):
    root = prepared
    vocab = WordPieceVocab.from_file(root / "vocab" / "vocab.txt")
    out = pretrain(common(root, vocab.size) + [
        "data.seq_length=64", "data.max_predictions_per_seq=10", "train.train_steps=250", "scheduler.warmup_steps=25",
        "eval.interval=250", f"checkpoint.save_dir={root}/phase1"])
    steps = [(int(s), float(lm), float(nsp), float(acc)) for s, lm, nsp, acc in STEP.findall(out)]
    evals = [tuple(float(x) for x in e) for e in EVAL.findall(out)]
    assert steps and evals, out[-3000:]
    assert "built index segments" in out

    # Unigram baseline: accuracy of always predicting the most frequent non-special token.
    store = TokenStore(str(root / "toy_text_sentence"))
    tokens = np.asarray(store.tokens, dtype=np.int64)
    counts = np.bincount(tokens, minlength=vocab.size)
    counts[vocab.special_ids] = 0
    unigram = counts.max() / counts.sum()

    first_lm, last_lm = steps[0][1], steps[-1][1]
    _, eval_lm, eval_nsp, eval_acc, eval_nsp_acc = evals[-1]
    assert last_lm < first_lm - 1.5, steps
    assert eval_acc > unigram + 0.25, (eval_acc, unigram)

    # Another vocabulary of the same size (two tokens swapped): resuming phase 1, or starting phase 2
    # from it, is refused before any rank starts, naming both files; checkpoint.accept_new_vocab allows it.
    # (Phase 2 from phase 1's weights: test_checkpoint_interop's init_from tests.)
    tokens = (root / "vocab" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens[100], tokens[101] = tokens[101], tokens[100]
    swapped = root / "swapped_vocab.txt"
    swapped.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    phase2_args = common(root, vocab.size) + ["data.seq_length=128", "data.max_predictions_per_seq=20",
                                              "train.train_steps=25", "scheduler.warmup_steps=5"]
    for how, load in (("resumes", f"checkpoint.load_dir={root}/phase1"),
                      ("starts from (checkpoint.init_from)", f"checkpoint.init_from={root}/phase1")):
        where = f"{root}/phase1/iter_0000250"
        args = [sys.executable, "-m", "pretrain", "--check-config", "--world-size", "2", "--config",
                "configs/bert-tiny.yaml", *phase2_args, load, f"data.vocab_file={swapped}"]
        refused = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert (f"data.vocab_file {swapped} is not the vocabulary of the checkpoint this run {how}, {where}/vocab.txt: "
                f"2 of the ids have another token (e.g. id 100: {tokens[100]!r} here, {tokens[101]!r} there)"
                in refused.stderr), refused.stderr
        # the data was made with the original vocabulary too; and phase 2's seq 128 is another sample sequence
        accept = ["checkpoint.accept_new_vocab=true", "data.accept_dataset_vocab=true", "checkpoint.accept_new_data=true"]
        accepted = subprocess.run(args + accept, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr


def test_separate_validation_and_test_corpora(prepared, tmp_path):
    """data.valid_paths / data.test_paths (Megatron's --valid-data-path / --test-data-path): the
    validation set is evaluated every eval_interval and the test set once at the end, from the
    held-out corpus (all its documents; the training corpus gives all of its own to training),
    into the console, TensorBoard and eval.results."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = prepared
    held = tmp_path / "held"
    held.mkdir()
    write_jsonl(held / "held.jsonl", 150, seed=7)
    run(["tools/preprocess_data.py", "--input", str(held / "held.jsonl"), "--output-prefix", str(held / "held"),
         "--vocab-file", str(root / "vocab" / "vocab.txt"), "--split-sentences"])
    vocab = WordPieceVocab.from_file(root / "vocab" / "vocab.txt")
    results = tmp_path / "eval.json"
    overrides = common(root, vocab.size) + [
        "data.seq_length=64", "data.max_predictions_per_seq=10", "data.split=100,0,0", "train.train_steps=4",
        "scheduler.warmup_steps=1",
        "logging.interval=1", "eval.interval=2", "eval.steps=1", f"eval.results={results}",
        f"logging.tensorboard_dir={tmp_path / 'tb'}"]
    held_prefix = f"[{held}/held_text_sentence]"
    out = pretrain(overrides + [f"data.valid_paths={held_prefix}", f"data.test_paths={held_prefix}"], nproc=1)
    assert re.findall(r"^(eval|test) at step (\d+)", out, re.M) == [("eval", "2"), ("eval", "4"), ("test", "4")], out
    assert list((held / "index-cache").glob("segments-*")), "the held-out corpus was not read"
    saved = json.loads(results.read_text())
    assert [e["step"] for e in saved["valid"]] == [2, 4] and [e["step"] for e in saved["test"]] == [4]
    assert saved["test"][0]["consumed_samples"] == 4 * 32
    assert {"lm_loss", "perplexity", "mlm_accuracy", "nsp_accuracy"} <= set(saved["test"][0]["metrics"])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("test/lm_loss")] == [4]
    assert [e.step for e in events.Scalars("eval/lm_loss")] == [2, 4]

    # without them the split's empty validation share is refused, naming the fix
    done = run_python(["-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}", "-m",
                       "pretrain", "--config", "configs/bert-tiny.yaml", *overrides], timeout=600)
    assert done.returncode != 0
    assert "leaves no validation documents (set data.valid_paths" in done.stdout + done.stderr
