"""Batch-size warmup counted in tokens (train.batch_warmup_tokens, pretrain/config/token_clock.py).

One 2-rank job (tests/_train_worker.py, its processes started once) runs a ramp from 4 to 16 samples
over 512 tokens (seq 32: steps of 4, 4, 8, then 16) with the LR warmup counted in tokens:
- at DP2 (ZeRO-1 and ZeRO-3), TP2 and PP2 (fp32): the per-step global batch is the ramp's (in the history and on the log
  line), the learning rate follows the tokens, and the three layouts train alike (1e-5);
- packed rows (data.packing, each step's share packed together) train as padded ones (1e-5) on
  fewer computed tokens;
- the samples after the ramp are a fixed-batch run's from the same position (that run steps over
  the ramp's 16 samples with data.skip_samples): the same tokens step by step;
- bf16, ZeRO-2 at DP2: 2 steps saved and resumed mid-ramp equal the straight run (1e-6);
- (sharing the job's processes) a new phase (checkpoint.new_phase) from that run's checkpoint
  trains with its own optimizer settings, not the checkpoint's (DeepSpeed's load of the optimizer
  states brings those), logs what it changes, and counts the tokens on.
"""
import json

import pytest

from _train_worker import TINY
from distributed import run_ranks

pytestmark = pytest.mark.slow  # one multi-process job

SEQ, TARGET, MINIMUM, RAMP_TOKENS = 32, 16, 4, 512
RAMP = ["train.global_batch_size=16", "train.batch_warmup_tokens=512", "train.batch_warmup_min_size=4",
        "train.train_steps=7", "scheduler.warmup_steps=0", "scheduler.warmup_tokens=1024", "scheduler.decay_tokens=4096",
        "optimizer.name=lamb"]
EXPECTED_BATCHES = [4, 4, 8, 16, 16, 16, 16]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ramp")
    ckpt = str(tmp / "ckpt")
    # dropout on: the resumed run must restore every RNG stream (the layouts compare without: their
    # dropout masks differ by construction)
    bf16 = ["train.precision=bf16", "parallel.zero_stage=2", "model.hidden_dropout=0.1"]
    named = {
        "dp2": ({}, RAMP + ["parallel.zero_stage=1"]),
        "tp2": ({"tp": 2}, RAMP),
        "pp2": ({"pp": 2}, RAMP),
        "zero3": ({}, RAMP + ["parallel.zero_stage=3", "train.deepspeed_config=tests/zero3-partition-everything.json"]),
        # packed rows, each step's share of the ramp packed together: the padded run's training
        "packed": ({}, RAMP + ["parallel.zero_stage=1", "data.packing=true", "data.synthetic_min_fraction=0.1"]),
        "padded": ({}, RAMP + ["parallel.zero_stage=1", "data.synthetic_min_fraction=0.1"]),
        # the full batch from the sample the ramp ends at (4 + 4 + 8 = 16): its steps 1-4 are the ramp's 4-7
        "fixed": ({}, [o for o in RAMP if not o.startswith("train.batch_warmup")]
                  + ["train.train_steps=4", "data.skip_samples=[[0,16]]"]),
        "first": ({}, RAMP + bf16 + [f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=2"]),
        "straight": ({}, RAMP + bf16),
        "second": ({}, RAMP + bf16 + [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]),
        # a new phase from that checkpoint with other optimizer settings (sharing the processes), at its
        # layout: DeepSpeed then loads the optimizer states itself, their group settings with them
        "phase": ({}, RAMP + bf16 + [f"checkpoint.init_from={ckpt}",
                                     "checkpoint.new_phase=true", f"checkpoint.save_dir={tmp / 'phase'}",
                                     "optimizer.weight_decay=0.002", "optimizer.beta2=0.95", "optimizer.lr=0.005",
                                     "train.train_steps=2", "scheduler.warmup_tokens=128"]),
    }
    out = tmp / "runs.json"
    run_ranks(["tests/_train_worker.py", str(out), "1", "1",
               *[json.dumps(dict(layout, name=name, overrides=TINY + overrides))
                 for name, (layout, overrides) in named.items()]], 2, timeout=900)
    return json.loads(out.read_text())


def test_the_global_batch_ramps_in_tokens_and_the_log_says_so(runs):
    from pretrain.config.token_clock import TokenClock
    from pretrain.optim import lr_at

    history = runs["dp2"]["history"]
    assert [h["global_batch_size"] for h in history] == EXPECTED_BATCHES
    clock = TokenClock(TARGET, SEQ, RAMP_TOKENS, MINIMUM)
    assert [h["tokens_seen"] for h in history] == [clock.tokens_before(k + 1) for k in range(7)]
    # the LR warmup is counted in the same tokens: each step's rate is that of its position
    for k, h in enumerate(history):
        assert h["learning_rate"] == pytest.approx(lr_at(clock.tokens_before(k), 0.01, 1024, 4096,
                                                         size=clock.batch(k) * SEQ))
    lines = [line for line in runs["dp2"]["log"] if line.startswith("step ")]
    assert [int(line.split("| batch ")[1].split()[0]) for line in lines] == EXPECTED_BATCHES
    assert "| tokens 128 |" in lines[0] and "| tokens 1.54K |" in lines[4]


def test_packed_rows_during_the_ramp_train_as_padded_ones(runs):
    packed, padded = runs["packed"]["history"], runs["padded"]["history"]
    assert [h["global_batch_size"] for h in packed] == EXPECTED_BATCHES
    for step, (a, b) in enumerate(zip(packed, padded), start=1):
        assert a["real_tokens"] == b["real_tokens"] == a["computed_tokens"] == b["computed_tokens"], step
        for key in ("loss", "lm_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"step {step} {key}"
    # the packing took effect: the same samples came in fewer rows (both compute real tokens only)
    given = [sum(r["input_tokens"] for r in runs[name]["ranks"] if r["input_tokens"] is not None)
             for name in ("packed", "padded")]
    assert 0 < given[0] < 0.8 * given[1], given


@pytest.mark.parametrize("layout", ["tp2", "pp2", "zero3"])
def test_layouts_train_alike_during_the_ramp(runs, layout):
    reference, ours = runs["dp2"], runs[layout]
    ranks = ours["ranks"][0]
    assert (ranks["megatron_tp_size"], ranks["deepspeed_stages"], ranks["deepspeed_dp_size"]) == \
        {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "zero3": (1, 1, 2)}[layout]
    if layout == "zero3":  # partitioned parameters: ZeRO-3 took effect
        assert ranks["zero3_partitioned"] > 0 and ranks["optimizer_wrapper"] == "DeepSpeedZeroOptimizer_Stage3"
    assert [h["global_batch_size"] for h in ours["history"]] == EXPECTED_BATCHES
    for step, (a, b) in enumerate(zip(ours["history"], reference["history"]), start=1):
        for key in ("loss", "lm_loss", "grad_norm", "real_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"{layout} step {step} {key}"


def test_after_the_ramp_the_samples_are_a_fixed_batch_runs_from_the_same_position(runs):
    ramped, fixed = runs["dp2"]["history"][3:], runs["fixed"]["history"]
    assert [h["global_batch_size"] for h in fixed] == [16] * 4
    assert [(h["real_tokens"], h["computed_tokens"]) for h in ramped] == \
        [(h["real_tokens"], h["computed_tokens"]) for h in fixed]


def test_a_resume_in_the_middle_of_the_ramp_is_exact(runs):
    first, straight, second = runs["first"]["history"], runs["straight"]["history"], runs["second"]["history"]
    assert len(first) == 2 and len(second) == 5
    # bf16 under ZeRO-2 at DP2 took effect
    assert runs["second"]["ranks"][0]["optimizer_wrapper"] == "DeepSpeedZeroOptimizer"
    assert "torch.bfloat16" in runs["second"]["ranks"][0]["parameter_dtypes"]
    assert runs["second"]["ranks"][0]["deepspeed_dp_size"] == 2
    for step, (a, b) in enumerate(zip(first + second, straight), start=1):
        assert a["global_batch_size"] == b["global_batch_size"]
        for key in ("loss", "lm_loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=0.0), f"step {step} {key}"
    assert runs["second"]["params_norm"] == pytest.approx(runs["straight"]["params_norm"], rel=1e-6)


def test_a_new_phase_trains_with_its_own_optimizer_settings_and_counts_tokens_on(runs):
    phase = runs["phase"]
    decays = {wd for rank in phase["ranks"] for wd, _ in rank["optimizer_groups"].values()}
    assert decays == {0.002, 0.0}, decays  # the config's, not the checkpoint's 0.01
    loaded = next(line for line in phase["log"] if line.startswith("initialised weights and optimizer states"))
    assert "layout-free" not in loaded, loaded  # DeepSpeed's own load, the one that brings group settings
    start = next(line for line in phase["log"] if line.startswith("checkpoint.new_phase: a new phase from"))
    for change in ("optimizer.weight_decay 0.01 -> 0.002", "optimizer.beta2 0.999 -> 0.95", "optimizer.lr 0.01 -> 0.005",
                   "train.train_steps 7 -> 2"):
        assert change in start, start
    seen = runs["second"]["history"][-1]["tokens_seen"]
    assert f"{seen:,} tokens seen" in start
    assert [h["tokens_seen"] for h in phase["history"]] == [seen + 4 * SEQ, seen + 8 * SEQ]  # the ramp starts over
