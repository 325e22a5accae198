"""The planner's memory prediction against what real engines hold: every rank's parameters,
gradients and optimizer state to the byte, and the activation peak the trainer measures (saved
tensors, pretrain/observability/device_memory.py) within 1% (the issue asks for 10%), across TP/PP/DP layouts, fp32
and bf16, ZeRO 0-3, recomputation none/selective/full, sequence 128 and 512, one micro-batch
and pipelines holding several in flight. The trainer itself logs both after its first step
(Trainer.first_step_memory); tests/_plan_worker.py runs the layouts of one world size in one job.

The precision matrix (tests/test_precision_matrix.py) checks the same states, exactly, for
fp32/bf16/fp16 x ZeRO 0-3 at DP2, TP2 and PP2 on the CPU and on fakegpu (and on two GPUs with the
device's allocated peak in the GPU tier); with the 4-rank layouts here and the single process,
ten TP x PP x DP layouts.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed import run_ranks
from pretrain.plan.states import wrapper_of

pytestmark = pytest.mark.slow

ZERO3 = "train.deepspeed_config=tests/zero3-partition-everything.json"
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # BERT's: the masks are activations too
SEQ128 = ["data.seq_length=128", "model.max_position_embeddings=512", "data.max_predictions_per_seq=20"]
SEQ512 = ["data.seq_length=512", "model.max_position_embeddings=512", "data.max_predictions_per_seq=76"]
# Both families compute one row of a micro-batch's real tokens (2 rows: 256 tokens at seq 128, taking
# attention.py's dense path, 1,024 at 512, its documents path). The plan takes full rows (the real
# share is data: an upper bound); these samples are full, so that it is exact here.
FULL_ROWS = ["data.short_seq_prob=0", "data.synthetic_min_fraction=1.0"]
# ModernBERT at the tests' width: layers 0 and 2 global, 1 and 3 local with +-4 keys (local layers
# take attention.py's banded path).
MODERN = ["model.architecture=modernbert", "data.segment_pairs=none", "model.ffn_hidden_size=96",
          "model.global_attn_every_n_layers=2", "model.local_attention=8", "model.layernorm_epsilon=1e-5"]


def run(name, tp, pp, precision="fp32", zero=0, recompute="none", seq512=False, micro_batches=4, layers=4,
        dropout=True, modern=False):
    """One training step of the tests' tiny model (4 layers) with `micro_batches` micro-batches of 2
    (`modern`: ModernBERT's layers, MODERN)."""
    overrides = [f"train.precision={precision}", f"parallel.zero_stage={zero}", f"model.recompute={recompute}",
                 f"model.num_layers={layers}", "train.micro_batch_size=2", *FULL_ROWS]
    overrides += MODERN if modern else []
    overrides += [ZERO3] if zero == 3 else []
    overrides += ["train.grad_accum_dtype=bf16"] if precision == "bf16" and zero == 0 else []
    overrides += DROPOUT if dropout else []
    overrides += SEQ512 if seq512 else SEQ128
    tolerance = 0.01
    return {"name": name, "tp": tp, "pp": pp, "micro_batches": micro_batches, "precision": precision, "zero": zero,
            "overrides": overrides, "tolerance": tolerance}


# world size 4: six layouts, each precision x ZeRO stage at DP > 1 somewhere, every recompute mode
# at both sequence lengths, pipelines of 2 and 4 stages holding 2-4 micro-batches in flight
FOUR = [
    run("dp4-fp32-zero0", 1, 1, "fp32", 0),
    run("dp4-bf16-zero1-selective", 1, 1, "bf16", 1, "selective"),
    run("dp4-bf16-zero2-full-512", 1, 1, "bf16", 2, "full", seq512=True),
    run("dp4-fp32-zero3", 1, 1, "fp32", 3, dropout=False),  # no dropout: the CPU's fused attention
    run("tp2dp2-fp32-zero1-512", 2, 1, "fp32", 1, seq512=True),
    run("tp2dp2-bf16-zero3-selective", 2, 1, "bf16", 3, "selective"),
    run("tp2dp2-fp32-zero2-full", 2, 1, "fp32", 2, "full"),
    run("pp2dp2-bf16-zero1-512", 1, 2, "bf16", 1, seq512=True),
    run("pp2dp2-fp32-zero0-selective", 1, 2, "fp32", 0, "selective"),
    run("pp2dp2-fp32-zero1-full-512", 1, 2, "fp32", 1, "full", seq512=True),
    run("tp2pp2-fp32-zero1", 2, 2, "fp32", 1),
    run("tp2pp2-bf16-zero1-selective-512", 2, 2, "bf16", 1, "selective", seq512=True),
    run("tp4-bf16-zero2", 4, 1, "bf16", 2),
    run("tp4-fp32-zero3-full", 4, 1, "fp32", 3, "full"),
    run("pp4-fp32-zero1", 1, 4, "fp32", 1, micro_batches=8),
    run("pp4-bf16-zero1-full", 1, 4, "bf16", 1, "full", micro_batches=8),
    # ModernBERT
    run("modern-dp4-bf16-zero1", 1, 1, "bf16", 1, seq512=True, modern=True),
    run("modern-tp2dp2-fp32-zero1-selective", 2, 1, "fp32", 1, "selective", modern=True),
    run("modern-tp2dp2-bf16-zero2-512", 2, 1, "bf16", 2, seq512=True, dropout=False, modern=True),
    run("modern-pp2dp2-fp32-zero0-512", 1, 2, "fp32", 0, seq512=True, dropout=False, modern=True),
    run("modern-tp2pp2-bf16-zero1-full", 2, 2, "bf16", 1, "full", modern=True),
]
# one process: the whole model on one rank
ONE = [
    run("single-fp32-zero0-512", 1, 1, "fp32", 0, seq512=True, micro_batches=1),
    run("single-bf16-zero1-selective-512", 1, 1, "bf16", 1, "selective", seq512=True, micro_batches=1),
    run("single-fp32-zero2-full", 1, 1, "fp32", 2, "full", micro_batches=1),
    run("single-bf16-zero3", 1, 1, "bf16", 3, micro_batches=1),
    # ModernBERT: every attention path with and without attention dropout (the spelled-out softmax)
    run("modern-single-fp32-zero0", 1, 1, "fp32", 0, micro_batches=1, modern=True),
    run("modern-single-fp32-zero0-nodropout", 1, 1, "fp32", 0, micro_batches=1, dropout=False, modern=True),
    run("modern-single-fp32-zero0-512", 1, 1, "fp32", 0, seq512=True, micro_batches=1, modern=True),
    run("modern-single-bf16-zero1-512-nodropout", 1, 1, "bf16", 1, seq512=True, micro_batches=1, dropout=False,
        modern=True),
    run("modern-single-fp32-zero2-selective-512", 1, 1, "fp32", 2, "selective", seq512=True, micro_batches=1,
        modern=True),
    run("modern-single-fp32-zero0-full", 1, 1, "fp32", 0, "full", micro_batches=1, modern=True),
]


def _job(runs, world, tmp_path):
    jobs = []
    for r in runs:
        dp = world // (r["tp"] * r["pp"])
        jobs.append(json.dumps({"name": r["name"], "tp": r["tp"], "pp": r["pp"], "overrides": r["overrides"] + [
            f"train.global_batch_size={2 * r['micro_batches'] * dp}"]}))
    out = tmp_path / f"plan{world}.json"
    run_ranks(["tests/_plan_worker.py", str(out), *jobs], world, timeout=900)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    with ThreadPoolExecutor(2) as pool:  # the single process fills the 4-rank job's idle moments
        four, one = pool.submit(_job, FOUR, 4, tmp), pool.submit(_job, ONE, 1, tmp)
        return {4: four.result(), 1: one.result()}


def cases():
    for world, runs in ((4, FOUR), (1, ONE)):
        for r in runs:
            yield pytest.param(world, r, id=r["name"])


@pytest.mark.parametrize("world,spec", list(cases()))
def test_predicted_memory_matches_every_rank(measured, world, spec):
    result = measured[world][spec["name"]]
    dp = world // (spec["tp"] * spec["pp"])
    expected_wrapper = wrapper_of(spec["precision"], spec["zero"], "bf16" if spec["zero"] == 0 else "fp32",
                                  spec["pp"] > 1)
    for rank, (report, effect) in enumerate(zip(result["memory"], result["took_effect"])):
        # the layout, precision and optimizer wrapper took effect on this rank
        assert (effect["tp"], effect["pp"], effect["dp"]) == (spec["tp"], spec["pp"], dp), (rank, effect)
        assert effect["dtypes"] == [{"fp32": "torch.float32", "bf16": "torch.bfloat16"}[spec["precision"]]]
        assert effect["wrapper"] == ("Lamb" if expected_wrapper == "none" else expected_wrapper), effect
        measured_bytes, planned = report["measured"], report["planned"]
        for key in ("parameters", "gradients", "optimizer_state"):
            assert measured_bytes[key] == planned[key], (rank, key, measured_bytes[key], planned[key])
        activations = measured_bytes["activations_peak"]
        assert activations > 0 and planned["activations_peak"] == pytest.approx(activations, rel=spec["tolerance"]), \
            (rank, activations, planned["activations_peak"])
    if spec["pp"] > 1:  # the first stage holds more micro-batches in flight than the last
        first, last = result["memory"][0], result["memory"][-1]
        assert first["measured"]["activations_peak"] != last["measured"]["activations_peak"]
