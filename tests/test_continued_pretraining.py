"""Continued pretraining from a Hugging Face BERT (issue 37): the model shape taken from the
checkpoint, every mismatch and a missing checkpoint refused before any rank starts, the heads a
BertModel lacks named with what they mean, a resume into another sample sequence refused; and
docs/training.md's "Continue pretraining a Hugging Face BERT on your own text", run as written."""
import json
import os
import subprocess
import sys

import pytest

from distributed import REPO, free_port, shell_env
from docs_blocks import documented_block
from toy_corpus import documents
from pretrain.checkpoint.data_sequence import data_sequence_changes, data_sequence_problems
from pretrain.checkpoint.starting_point import load_run_config
from pretrain.config import DataConfig, load_config

HEADING = "## Continue pretraining a Hugging Face BERT on your own text"


def bert_model_directory(path, vocab_tokens, hidden=64, max_positions=128):
    """A sentence-transformers-like BertModel directory (no pretraining heads), made here: no download."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=len(vocab_tokens), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=max_positions)
    BertModel(config).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(vocab_tokens) + "\n", encoding="utf-8")
    return path


SMALL_VOCAB = ["[PAD]"] + [f"[unused{i}]" for i in range(3)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + \
    [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["the", "and", ",", "."]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return bert_model_directory(tmp_path_factory.mktemp("minilm"), SMALL_VOCAB)


def check_config(*overrides, config="configs/continue-pretraining.yaml", without_torch=False, tmp_path=None):
    """`python -m pretrain --check-config ...`; `without_torch`: in a Python where importing torch
    fails (a stand-in package first on the path), which is what keeps the check quick: it reads
    configs and config.json files, never a tensor."""
    env = dict(os.environ)
    if without_torch:
        stub = tmp_path / "no-torch" / "torch"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text("raise ImportError('--check-config must not import torch')\n")
        env["PYTHONPATH"] = os.pathsep.join([str(stub.parent), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pretrain", "--check-config", "--world-size", "2", "--config", config,
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)


SYNTHETIC = ["data.kind=synthetic", "data.seq_length=64", "data.max_predictions_per_seq=10"]


def test_the_model_shape_is_taken_from_init_from_unless_set(hf_model):
    cfg = load_run_config("configs/continue-pretraining.yaml", [f"checkpoint.init_from={hf_model}"])
    m = cfg.model
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_size,
            m.max_position_embeddings) == (len(SMALL_VOCAB), 64, 2, 4, 96, 128)
    kept = load_run_config("configs/continue-pretraining.yaml", [f"checkpoint.init_from={hf_model}", "model.num_layers=6"])
    assert kept.model.num_layers == 6 and kept.model.hidden_size == 64  # set: kept (and refused by the check)
    scratch = load_run_config("configs/continue-pretraining.yaml", [])
    assert scratch.model.hidden_size == 768  # no init_from: the defaults


def test_check_config_refuses_a_shape_mismatch_with_the_right_key_names(hf_model, tmp_path):
    """configs/bert-tiny.yaml sets a shape: each key that differs from config.json is named, with
    model.ffn_hidden_size (not the old message's model.ffn_size), without importing torch (what
    keeps the check under a couple of seconds; a wall-time bound would be the machine's verdict)."""
    done = check_config(f"checkpoint.init_from={hf_model}", *SYNTHETIC, config="configs/bert-tiny.yaml",
                        without_torch=True, tmp_path=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "does not fit" in line]
    assert f"checkpoint.init_from {hf_model} does not fit this run's model ({hf_model}/config.json)" in line
    for expected in (f"model.vocab_size: run 30522, checkpoint {len(SMALL_VOCAB)}", "model.hidden_size: run 128, checkpoint 64",
                     "model.num_attention_heads: run 2, checkpoint 4", "model.ffn_hidden_size: run 512, checkpoint 96"):
        assert expected in line, line
    assert "model.ffn_size" not in done.stderr


def test_check_config_refuses_a_missing_init_from(tmp_path):
    done = check_config(f"checkpoint.init_from={tmp_path}/nope", *SYNTHETIC, without_torch=True, tmp_path=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"checkpoint.init_from {tmp_path}/nope does not exist" in done.stderr


@pytest.mark.slow
def test_check_config_names_the_heads_a_bert_model_lacks(hf_model):
    done = check_config(f"checkpoint.init_from={hf_model}", *SYNTHETIC)
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if line.startswith("note: ")]
    assert len(notes) == 2, done.stdout
    assert "has no MLM head" in notes[0] and "starts from random weights" in notes[0] and "'the'" in notes[0]
    assert "has no next-sentence head" in notes[1] and "data.segment_pairs=none" in notes[1]
    done = check_config(f"checkpoint.init_from={hf_model}", *SYNTHETIC, "data.segment_pairs=none")
    assert [line for line in done.stdout.splitlines() if line.startswith("note: ")] == [notes[0]]


def test_data_sequence_changes():
    saved = DataConfig(kind="indexed", paths=["/old/data/wiki_text_sentence"], vocab_file="v.txt")
    moved = DataConfig(kind="indexed", paths=["/new/place/wiki_text_sentence"], vocab_file="/else/v.txt",
                       weights=[3.0], num_workers=8, packing=True)
    assert data_sequence_changes(saved, moved) == [], "a moved directory, workers and packing keep the sequence"
    other = DataConfig(kind="indexed", paths=["/old/data/wiki_text_sentence"], vocab_file="v.txt", seq_length=256,
                       segment_pairs="sop")
    assert data_sequence_changes(saved, other) == ["data.seq_length: checkpoint 128, run 256",
                                                   "data.segment_pairs: checkpoint nsp, run sop"]
    blend = DataConfig(kind="indexed", paths=["a", "b"], weights=[1.0, 3.0])
    assert data_sequence_changes(blend, DataConfig(kind="indexed", paths=["a", "b"], weights=[2.0, 6.0])) == []
    tenths = DataConfig(kind="indexed", paths=["a", "b"], weights=[0.1, 0.2])
    assert data_sequence_changes(tenths, DataConfig(kind="indexed", paths=["a", "b"], weights=[1.0, 2.0])) == []
    assert data_sequence_changes(blend, DataConfig(kind="indexed", paths=["a", "b"])) == [
        "data.weights: checkpoint [1.0, 3.0], run []"]


def test_a_resume_compares_with_the_latest_checkpoint_that_read_samples(tmp_path):
    """The check reads the latest checkpoint's meta.json; one that read no sample (a conversion from
    Hugging Face, step 0) has no sequence to continue."""
    ck = tmp_path / "ck"
    (ck / "iter_0000010").mkdir(parents=True)
    (ck / "latest").write_text("iter_0000010")
    meta = {"step": 10, "consumed_samples": 80, "layout": {}, "config": {"data": {"seq_length": 128}}}
    (ck / "iter_0000010" / "meta.json").write_text(json.dumps(meta))
    run = load_config(None, [f"checkpoint.load_dir={ck}", "data.seq_length=256"])
    (line,) = data_sequence_problems(run)
    assert line.startswith(f"checkpoint.load_dir {ck}: its latest checkpoint was trained on another sample sequence "
                           "(data.seq_length: checkpoint 128, run 256)")
    assert data_sequence_problems(load_config(None, [f"checkpoint.load_dir={ck}", "data.seq_length=256",
                                                     "checkpoint.accept_new_data=true"])) == []
    assert data_sequence_problems(load_config(None, [f"checkpoint.init_from={ck}", "data.seq_length=256"])) == [], \
        "init_from starts a new sequence"
    (ck / "iter_0000010" / "meta.json").write_text(json.dumps({**meta, "step": 0, "consumed_samples": 0}))
    assert data_sequence_problems(run) == []


def run_guide(root):
    """The block run with its inputs made under `root` (conftest.py's guide_runs runs it beside the
    other guides): bash's CompletedProcess, the output folder and the model's vocabulary."""
    corpus = root / "domain"
    corpus.mkdir()
    for part in range(2):
        (corpus / f"part{part}.txt").write_text("\n".join(documents(800, seed=part)) + "\n", encoding="utf-8")
    # the model's vocabulary covers the corpus (a real model's does): built from it, then a BertModel of that size
    subprocess.run([sys.executable, "tools/build_vocab.py", "--input", *map(str, corpus.glob("*.txt")), "--input-format",
                    "text-lines", "--vocab-size", "600", "--output-dir", str(root / "vocab")],
                   cwd=REPO, check=True, capture_output=True, text=True)
    tokens = (root / "vocab" / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    model = bert_model_directory(root / "model", tokens)
    out = root / "run"
    env = shell_env(MODEL=str(model), CORPUS=str(corpus), STEPS="4", OUT=str(out), MASTER_PORT=str(free_port()))
    # the recipe's batch (256 x 128) for a 2-layer model of hidden 64: a few seconds a step here
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", documented_block("training.md", HEADING)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    return done, out, tokens


@pytest.mark.slow
def test_the_continued_pretraining_guide_works_as_documented(guide):
    done, out, tokens = guide
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    assert "configs/continue-pretraining.yaml: valid for 2 rank(s)" in output
    assert output.count("has no MLM head") >= 2, "named by the check and by the run's start"
    assert f"resumed from {out}/checkpoints at step 2" in output, output[-5000:]
    assert (out / "checkpoints" / "latest").read_text() == "iter_0000004"
    meta = json.loads((out / "checkpoints" / "iter_0000004" / "meta.json").read_text())
    assert meta["layout"]["tensor_parallel"] == 2 and meta["layout"]["precision"] == "bf16"
    assert meta["config"]["data"]["packing"] is True
    assert meta["config"]["model"]["hidden_size"] == 64 and meta["config"]["model"]["vocab_size"] == len(tokens)
    # the export loads in transformers with both pretraining heads, the shape of the model it came from
    from transformers import BertForPreTraining

    exported, info = BertForPreTraining.from_pretrained(out / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert exported.config.hidden_size == 64 and exported.config.intermediate_size == 96
    assert "The [MASK] was treated with antibiotics." in output
