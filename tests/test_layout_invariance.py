"""Invariant 1: the same initial weights and data give the same per-step losses in every layout.

Each layout is one multi-process job training the tiny BERT twice (LAMB, then AdamW) for 5
optimizer steps with gradient accumulation and clipping on, dropout off, fp32. Losses, gradient
norms and the final parameter norm must equal the single-process run within 1e-5 relative.
"""
import json

import pytest

from distributed import run_ranks

RUNS = [json.dumps({"name": name, "overrides": [f"optimizer.name={name}"]}) for name in ("lamb", "adamw")]
# (label, tp, pp, world size, extra overrides); global batch 8 = micro 2 x accumulation x DP.
LAYOUTS = [
    ("tp2", 2, 1, 2, []),
    ("pp2", 1, 2, 2, []),
    ("dp2-zero1", 1, 1, 2, ["parallel.zero_stage=1"]),
    ("dp2-zero2", 1, 1, 2, ["parallel.zero_stage=2"]),
    # persistence threshold 0: ZeRO-3 must partition the small parameters too, or this proves nothing
    ("dp2-zero3", 1, 1, 2, ["parallel.zero_stage=3", "train.deepspeed_config=tests/zero3-partition-everything.json"]),
    # TP with ZeRO-3: shards of different TP ranks must not be mixed by the partitioning
    ("tp2-dp2-zero3", 2, 1, 4, ["parallel.zero_stage=3", "train.deepspeed_config=tests/zero3-partition-everything.json"]),
    ("tp2-pp2-dp2-zero1", 2, 2, 8, ["parallel.zero_stage=1"]),
]


def train_layout(tmp_path, tp, pp, world, extra):
    out = tmp_path / f"result-{tp}-{pp}-{world}.json"
    runs = [json.dumps({"name": r["name"], "overrides": r["overrides"] + extra}) for r in map(json.loads, RUNS)]
    run_ranks(["tests/_train_worker.py", str(out), str(tp), str(pp), *runs], world, timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_layout(tmp_path_factory.mktemp("single"), 1, 1, 1, [])


def assert_close(actual, expected, what, rel=1e-5):
    assert actual == pytest.approx(expected, rel=rel), f"{what}: {actual} != {expected}"


@pytest.mark.parametrize("label,tp,pp,world,extra", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_matches_single_process(reference, tmp_path, label, tp, pp, world, extra):
    result = train_layout(tmp_path, tp, pp, world, extra)
    for optimizer in ("lamb", "adamw"):
        ours, ref = result[optimizer]["history"], reference[optimizer]["history"]
        assert len(ours) == len(ref) == 5
        for step, (a, b) in enumerate(zip(ours, ref), start=1):
            for key in ("loss", "lm_loss", "nsp_loss", "grad_norm"):
                assert_close(a[key], b[key], f"{label} {optimizer} step {step} {key}")
            assert a["learning_rate"] == b["learning_rate"]
        assert_close(result[optimizer]["params_norm"], reference[optimizer]["params_norm"], f"{label} {optimizer} params norm")


def test_reference_learns_and_optimizers_differ(reference):
    """Guards against a vacuous comparison: training moves the loss, and LAMB is not AdamW."""
    lamb, adamw = reference["lamb"]["history"], reference["adamw"]["history"]
    assert lamb[0]["loss"] == adamw[0]["loss"]
    assert abs(lamb[-1]["loss"] - adamw[-1]["loss"]) > 1e-3
    assert lamb[-1]["loss"] != lamb[0]["loss"]
    assert all(h["grad_norm"] > 1.0 for h in lamb[:2]), "clipping (max norm 1.0) must be exercised"


def test_bf16_pipeline_zero1_tracks_fp32(reference, tmp_path):
    """bf16 (DeepSpeed bf16: bf16 weights and activations, fp32 master weights) in a PP2 x DP2
    ZeRO-1 layout follows the fp32 single-process run closely (not exactly: bf16 rounds)."""
    result = train_layout(tmp_path, 1, 2, 4, ["parallel.zero_stage=1", "train.precision=bf16"])
    for optimizer in ("lamb", "adamw"):
        for a, b in zip(result[optimizer]["history"], reference[optimizer]["history"]):
            assert a["loss"] == pytest.approx(b["loss"], rel=2e-3)
        assert result[optimizer]["history"][-1]["loss"] != reference[optimizer]["history"][-1]["loss"]


def test_pipeline_with_middle_stages(tmp_path):
    """PP4 over 4 layers: stages 1 and 2 never receive the data iterator from DeepSpeed
    (PipelineEngine.set_dataiterator keeps it for the first and last stage only), yet every
    stage must agree on the data position; the losses equal one process's."""
    four_layers = ["model.num_layers=4"]
    reference = train_layout(tmp_path, 1, 1, 1, four_layers)
    result = train_layout(tmp_path, 1, 4, 4, four_layers)
    for optimizer in ("lamb", "adamw"):
        for step, (a, b) in enumerate(zip(result[optimizer]["history"], reference[optimizer]["history"]), start=1):
            for key in ("loss", "lm_loss", "nsp_loss", "grad_norm"):
                assert_close(a[key], b[key], f"pp4 {optimizer} step {step} {key}")
        assert_close(result[optimizer]["params_norm"], reference[optimizer]["params_norm"], f"pp4 {optimizer} params norm")
