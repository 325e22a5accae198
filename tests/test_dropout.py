"""Dropout under tensor parallelism: masks agree where the region is replicated, differ where
it is sharded, are replayed by activation checkpointing, and a TP2 run with dropout trains."""
import json

import pytest

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier


def test_dropout_masks_under_tp2(tmp_path):
    out = tmp_path / "dropout.json"
    run_ranks(["tests/_dropout_worker.py", str(out)], 2, timeout=600)
    r = json.loads(out.read_text())
    assert r["captured"] == 3  # embedding tail + 2 layers
    assert r["dropout_changes_output"] > 1e-3  # dropout is really on
    assert r["replicated_spread"] == 0.0  # identical masks on both TP ranks
    assert r["stream_spread"] > 0.1  # the per-rank stream differs between TP ranks
    assert r["grad_scale"] > 0
    # recomputation replays the dropout masks: the same gradients, and the attention core (2 layers)
    # runs a second time in backward only when it is recomputed
    modes = r["recomputed"]
    assert {mode: m["attention_calls"] for mode, m in modes.items()} == {"none": 2, "selective": 4, "full": 4}
    for mode, m in modes.items():
        assert m["grad_diff"] <= 1e-6 * r["grad_scale"], mode


def test_tp2_with_dropout_trains(tmp_path):
    out = tmp_path / "train.json"
    overrides = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.train_steps=40",
                 "scheduler.warmup_steps=5", "optimizer.lr=0.005", "model.recompute=full",
                 "data.num_samples=16"]  # two batches seen repeatedly: dropout must not stop it fitting them
    run = json.dumps({"name": "dropout", "overrides": overrides})
    run_ranks(["tests/_train_worker.py", str(out), "2", "1", run], 2, timeout=600)
    losses = [h["lm_loss"] for h in json.loads(out.read_text())["dropout"]["history"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)
