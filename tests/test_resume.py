"""Invariant 4: N steps + save + resume N steps equals 2N steps straight; bad resumes fail clearly."""
import json
import os
import subprocess
import sys

import pytest

from _train_worker import TINY
from distributed import REPO, run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

# Dropout on: the resumed run must also restore every RNG stream to draw the same masks.
COMMON = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.train_steps=6",
          "optimizer.name=lamb"]


def train(tmp_path, name, tp, pp, world, overrides):
    out = tmp_path / f"{name}.json"
    run = json.dumps({"name": name, "overrides": COMMON + overrides})
    run_ranks(["tests/_train_worker.py", str(out), str(tp), str(pp), run], world, timeout=600)
    return json.loads(out.read_text())[name]


def resume_matches_straight(tmp_path, tp, pp, world, extra):
    """One job (its processes started once) runs the first half with a save, then the straight
    run, then the resumed second half: the straight run in between leaves every random generator
    of the process far from where the first half left it, so only a resume that restores them
    draws the straight run's dropout masks."""
    ckpt = str(tmp_path / "ckpt")
    out = tmp_path / "runs.json"
    runs = {"first": extra + [f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=3"], "straight": extra,
            "second": extra + [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]}
    run_ranks(["tests/_train_worker.py", str(out), str(tp), str(pp),
               *[json.dumps({"name": name, "overrides": COMMON + overrides}) for name, overrides in runs.items()]],
              world, timeout=600)
    results = json.loads(out.read_text())
    first, straight, second = results["first"], results["straight"], results["second"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000006"  # the second half saved at its end
    assert (tmp_path / "ckpt" / "iter_0000003").is_dir()
    assert len(first["history"]) == 3 and len(second["history"]) == 3
    assert any("resumed from" in line and "at step 3" in line for line in second["log"]), second["log"]
    return straight, first["history"] + second["history"], second


def test_single_process_resume_is_bitwise(tmp_path):
    straight, resumed, second = resume_matches_straight(tmp_path, 1, 1, 1, [])
    for key in ("loss", "lm_loss", "nsp_loss", "grad_norm", "learning_rate"):
        assert [h[key] for h in resumed] == [h[key] for h in straight["history"]], key
    assert second["params_norm"] == straight["params_norm"]


def test_distributed_packed_resume_pp2_dp2_zero1(tmp_path):
    """Packed (data.packing: samples of 8-32 tokens share rows of 32; the pipeline exchanges
    shapes per micro-batch), PP2 x DP2, ZeRO-1. Unpacked multi-rank resumes: test_signals."""
    packed = ["parallel.zero_stage=1", "data.packing=true", "data.synthetic_min_fraction=0.1"]
    straight, resumed, second = resume_matches_straight(tmp_path, 1, 2, 4, packed)
    assert sum(h["computed_tokens"] for h in resumed) < 0.9 * 6 * 8 * 32, "hardly packed (6 steps of 8 x 32)"
    for step, (a, b) in enumerate(zip(resumed, straight["history"]), start=1):
        for key in ("loss", "lm_loss", "nsp_loss", "grad_norm", "real_tokens", "computed_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), f"step {step} {key}"
    assert second["params_norm"] == pytest.approx(straight["params_norm"], rel=1e-6)


def test_modernbert_packed_resume_tp2_zero1_is_exact(tmp_path):
    """ModernBERT (rotary, windows, GeGLU; dropout on in its embedding, attention and MLP) resumes
    exactly too: packed rows at TP2, ZeRO-1, the tensor-parallel dropout streams restored."""
    from test_hf_training_parity import MODERN

    packed = MODERN + ["parallel.zero_stage=1", "data.packing=true", "data.synthetic_min_fraction=0.1"]
    straight, resumed, second = resume_matches_straight(tmp_path, 2, 1, 2, packed)
    assert sum(h["computed_tokens"] for h in resumed) < 0.9 * 6 * 8 * 32, "hardly packed (6 steps of 8 x 32)"
    for key in ("loss", "lm_loss", "grad_norm", "real_tokens", "computed_tokens", "learning_rate"):
        assert [h[key] for h in resumed] == [h[key] for h in straight["history"]], key
    assert second["params_norm"] == straight["params_norm"]
    assert straight["history"][0]["nsp_loss"] == 0.0  # no next-sentence head: it is ModernBERT


def test_checkpoint_of_other_model_shape_is_refused(tmp_path):
    """Another layout loads (tests/test_checkpoint_interop.py); another model shape must not."""
    ckpt = str(tmp_path / "ckpt")
    train(tmp_path, "first", 1, 1, 1, [f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=1"])
    out = tmp_path / "never.json"
    run = json.dumps({"name": "bad", "overrides": COMMON + [f"checkpoint.load_dir={ckpt}", "model.ffn_hidden_size=128"]})
    results = run_ranks(["tests/_train_worker.py", str(out), "2", "1", run], 2, timeout=600, expect_success=False)
    assert all(r.returncode != 0 for r in results)
    log = results[0].stdout
    assert "does not fit this run's model" in log
    assert "model.ffn_hidden_size (the feed-forward width; unset = 4 x model.hidden_size): checkpoint 256 vs run 128" in log
    assert not out.exists()




def check_config(overrides, tmp_path):
    """`python -m pretrain --check-config` in a Python where importing torch fails (a stand-in package
    first on the path): the check reads the config and the checkpoint's meta.json, never a tensor."""
    stub = tmp_path / "no-torch" / "torch"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text("raise ImportError('--check-config must not import torch')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub.parent), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pretrain", "--check-config", "--world-size", "1", "--config",
                           "configs/bert-tiny.yaml", *overrides], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=env)


def test_resume_with_other_data_settings_is_refused_or_starts_the_new_sequence_over(tmp_path):
    """A checkpoint at seq 32 resumed at seq 64: refused before any rank starts (and by the trainer
    itself), naming the key; checkpoint.accept_new_data resumes with the new sequence from sample 0."""
    ckpt = str(tmp_path / "ckpt")
    save = [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]
    runs = {"first": save + ["resilience.exit_after_steps=2"],
            "refused": save + ["data.seq_length=64", "data.max_predictions_per_seq=10"],
            "accepted": save + ["data.seq_length=64", "data.max_predictions_per_seq=10", "checkpoint.accept_new_data=true",
                                "train.train_steps=3"]}
    out = tmp_path / "runs.json"
    run_ranks(["tests/_train_worker.py", str(out), "1", "1",
               *[json.dumps({"name": name, "overrides": COMMON + overrides, "expect_error": name == "refused"})
                 for name, overrides in runs.items()]], 1, timeout=600)
    results = json.loads(out.read_text())
    assert "data.seq_length: checkpoint 32, run 64" in results["refused"]["error"]
    assert "checkpoint.accept_new_data=true" in results["refused"]["error"]
    accepted = results["accepted"]
    assert len(accepted["history"]) == 1, "resumed at step 2 of 3"
    assert any("starts over from its first sample (16 samples of the old one seen)" in line
               for line in accepted["log"]), accepted["log"]
    assert any("at step 2 (0 samples)" in line for line in accepted["log"]), accepted["log"]

    # the same refusal before any rank starts, from the config and the checkpoint's meta.json alone
    # (the latest checkpoint is now the accepted run's, at seq 64)
    same = TINY + ["model.ffn_hidden_size=256", "data.seq_length=64", "data.max_predictions_per_seq=10",
                   f"checkpoint.load_dir={ckpt}"]  # the workers' run
    result = check_config(same, tmp_path)
    assert result.returncode == 0, result.stderr
    result = check_config(same + ["data.seq_length=32", "data.masking=dynamic"], tmp_path)  # torch unimportable
    assert result.returncode == 2, result.stdout + result.stderr
    assert "data.seq_length: checkpoint 64, run 32; data.masking: checkpoint static, run dynamic" in result.stderr


def test_a_resume_that_moves_the_lr_schedule_says_so_and_a_finished_run_says_it_is_finished(tmp_path):
    """A run trained to its end (4 steps, linear decay to 0 at step 4) relaunched with 8 steps: the
    start-up line names both horizons and the next step's rate under each schedule, and the run
    follows the new one from its first step (not the rate the optimizer state was saved with);
    relaunched once more it trains nothing and says the run is finished. bf16 ZeRO-1, whose load
    restores the saved param groups' rates."""
    ckpt = str(tmp_path / "ckpt")
    save = [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}", "train.precision=bf16",
            "parallel.zero_stage=1"]
    phase = [f"checkpoint.init_from={ckpt}", "checkpoint.new_phase=true", f"checkpoint.save_dir={tmp_path / 'phase'}",
             "train.precision=bf16", "parallel.zero_stage=1", "train.train_steps=3"]
    runs = {"first": save + ["train.train_steps=4"], "longer": save + ["train.train_steps=8"],
            "again": save + ["train.train_steps=8"], "phase": phase}
    out = tmp_path / "runs.json"
    run_ranks(["tests/_train_worker.py", str(out), "1", "1",
               *[json.dumps({"name": name, "overrides": COMMON + overrides}) for name, overrides in runs.items()]],
              1, timeout=600)
    results = json.loads(out.read_text())
    assert len(results["first"]["history"]) == 4
    longer = results["longer"]
    moved = [line for line in longer["log"] if "the LR schedule differs from the checkpoint's" in line]
    assert len(moved) == 1, longer["log"]
    assert "decay horizon 4 steps -> 8 steps" in moved[0], moved[0]
    # warmup 2, peak 0.01: step 5 is at min_lr 0 in the old schedule, at 0.01 * (1 - 2/6) in the new
    assert "The rate of step 5 is 0 in the checkpoint's schedule and 0.006667 in this run's" in moved[0], moved[0]
    assert len(longer["history"]) == 4
    assert longer["history"][0]["learning_rate"] == pytest.approx(0.01 * 2 / 3)
    again = results["again"]
    assert again["history"] == []
    assert not any("LR schedule differs" in line for line in again["log"]), again["log"]
    finished = [line for line in again["log"] if line.startswith("nothing to train")]
    assert finished and "at step 8, at train.train_steps 8; the run is finished" in finished[0], again["log"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000008"
    # a new phase with the optimizer states of step 8 (saved with the rate 0) starts its own warmup
    assert [h["learning_rate"] for h in results["phase"]["history"]] == pytest.approx([0.005, 0.01, 0.01])
