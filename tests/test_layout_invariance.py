"""Invariant 1: the same initial weights and data give the same per-step losses in every layout.

Each layout trains the tiny BERT (4 layers, so that 4 pipeline stages fit) with LAMB, AdamW
and StableAdamW (no gradient clipping, its own update clipping engaged; LEFT_OUT names the few
layouts that skip one), at the default
data.num_workers, for 5 optimizer steps with gradient accumulation and clipping on (LAMB, AdamW),
dropout off, fp32, then evaluating. Losses, gradient norms, the final parameter
norm, every final weight tensor (read back from the checkpoint) and the evaluation metrics must
equal the single-process run within 1e-5 relative.

Every layout also proves it took effect, from what megatron-core and DeepSpeed themselves
report on every rank (sizes, what each rank holds, the optimizer wrapper, ZeRO-3 partitions),
and that the optimizer steps each parameter, by name, with the intended weight decay and
trust-ratio settings. A negative control shows the 1e-5 tolerance is tight enough to catch
LAMB trust ratios (and StableAdamW's RMS terms) computed per shard instead of per whole parameter. Also here: the optimizer
groups on BERT-base's real parameter list, the micro-batch split of the global batch (1x8 = 4x2),
and bf16 tracking fp32.
"""
import json

import pytest
import torch
from concurrent.futures import ThreadPoolExecutor

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

# at the default data.num_workers: loader processes started from the forkserver, for training
# and once for the evaluations (pretrain/data/samples/batches.py)
FOUR_LAYERS = ["model.num_layers=4", "eval.steps=2", "data.num_workers=2"]
# AdamW also leaves the embeddings undecayed: "embeddings as configured" is checked both ways.
RUNS = [{"name": "lamb", "overrides": ["optimizer.name=lamb"], "evaluate": True},
        {"name": "adamw", "overrides": ["optimizer.name=adamw", "optimizer.no_weight_decay=[bias,layernorm,embedding]"],
         "evaluate": True}]
PER_SHARD = {"name": "lamb-per-shard", "overrides": ["optimizer.name=lamb"], "per_shard": True}
# StableAdamW (ModernBERT's optimizer) at its defaults: no gradient clipping (grad_clip unset). Its update
# clipping engages (RMS > 1, up to ~1.3, measured single-process: 77 tensor-steps, the attention and
# MLP matrices from step 3 on), so the whole-parameter RMS is what these runs compare
# (test_per_shard_stable_adamw_rms_is_caught proves it engaged on TP shards). lr 0.005, not tests'
# 0.01: without gradient clipping 0.01 is where rounding starts to grow past the tolerance in any
# Adam (measured at TP2, worst tensor: torch's AdamW 1.0e-5 at lr 0.01 and 5.5e-5 at 0.02, this
# optimizer 1.0e-5 and 2.0e-5; at 0.005 it is 4.8e-6).
SAW_RUN = {"name": "stable_adamw", "overrides": ["optimizer.name=stable_adamw", "optimizer.grad_clip=null",
                                                 "optimizer.lr=0.005"], "evaluate": True}
SAW_PER_SHARD = dict(SAW_RUN, name="stable_adamw-per-shard", per_shard=True, evaluate=False)
ZERO3 = ["parallel.zero_stage=3", "train.deepspeed_config=tests/zero3-partition-everything.json"]
# (label, tp, pp, world size, extra overrides, DeepSpeed's optimizer wrapper or None for the
# client optimizer itself); global batch 8 = micro 2 x accumulation x DP.
LAYOUTS = [
    ("dp2-zero0", 1, 1, 2, [], None),  # the default configuration
    ("tp2", 2, 1, 2, [], None),
    ("tp2-zero2", 2, 1, 4, ["parallel.zero_stage=2"], "DeepSpeedZeroOptimizer"),
    ("pp2", 1, 2, 2, [], None),
    ("pp2-dp2-zero0", 1, 2, 4, [], None),
    ("pp4", 1, 4, 4, [], None),  # middle stages never draw from their data iterator
    ("dp2-zero1", 1, 1, 2, ["parallel.zero_stage=1"], "DeepSpeedZeroOptimizer"),
    ("dp2-zero2", 1, 1, 2, ["parallel.zero_stage=2"], "DeepSpeedZeroOptimizer"),
    # persistence threshold 0: ZeRO-3 must partition the small parameters too, or this proves nothing
    ("dp2-zero3", 1, 1, 2, ZERO3, "DeepSpeedZeroOptimizer_Stage3"),
    # TP with ZeRO-3: shards of different TP ranks must not be mixed by the partitioning
    ("tp2-dp2-zero3", 2, 1, 4, ZERO3, "DeepSpeedZeroOptimizer_Stage3"),
    ("tp2-pp2-dp2-zero1", 2, 2, 8, ["parallel.zero_stage=1"], "DeepSpeedZeroOptimizer"),
]
TOLERANCE = 1e-5
# AdamW is elementwise: past the gradients (LAMB's runs prove them in every layout) what a layout changes
# for it is DeepSpeed's wrapper, proven wherever ZeRO is on. The 4- and 8-rank jobs, the slowest per run
# on 2 cores, leave it out of their ZeRO-0 pipelines; the 8-rank one also leaves out StableAdamW, whose
# whole-parameter RMS over TP and DP at once the 4-rank tp2-dp2-zero3 proves.
OPTIMIZERS = {"lamb": "Lamb", "adamw": "AdamW", "stable_adamw": "StableAdamW"}
LEFT_OUT = {"pp2-dp2-zero0": {"adamw"}, "pp4": {"adamw"}, "tp2-pp2-dp2-zero1": {"adamw", "stable_adamw"}}


# Sequence packing (data.packing): samples of 8-32 tokens (rows of 32), 4 per micro-batch, packed
# in the layouts below and padded in the reference's job; both runs must be one and the same training.
SPREAD_LENGTHS = ["optimizer.name=lamb", "data.synthetic_min_fraction=0.1", "train.micro_batch_size=4"]
PADDED_RUN = {"name": "padded", "overrides": SPREAD_LENGTHS, "evaluate": True}
PACKED_RUN = {"name": "packed", "overrides": SPREAD_LENGTHS + ["data.packing=true"], "evaluate": True}
PACKED_LAYOUTS = ["tp2", "pp2", "dp2-zero1", "tp2-pp2-dp2-zero1"]

# ModernBERT (model.architecture modernbert, issue 40) in the same jobs: the tiny model's 4 layers
# with global attention on 0 and 2 and windows of +-4 tokens on 1 and 3 (rows of 32), the MLP and
# LayerNorm biases on, no next-sentence head; LAMB, padded and packed.
MODERN = ["optimizer.name=lamb", "model.architecture=modernbert", "data.segment_pairs=none", "model.ffn_hidden_size=96",
          "model.global_attn_every_n_layers=2", "model.local_attention=8", "model.layernorm_epsilon=1e-5",
          "model.norm_bias=true", "model.mlp_bias=true"]
MODERN_RUN = {"name": "modern", "overrides": MODERN, "evaluate": True}
MODERN_PADDED_RUN = {"name": "modern-padded", "overrides": MODERN + SPREAD_LENGTHS[1:], "evaluate": True}
MODERN_PACKED_RUN = {"name": "modern-packed", "overrides": MODERN + SPREAD_LENGTHS[1:] + ["data.packing=true"],
                     "evaluate": True}
MODERN_LAYOUTS = ["tp2", "pp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2-pp2-dp2-zero1"]
# activation recomputation: the same training, full at TP2 and selective at PP2
MODERN_RECOMPUTE = {"tp2": {"name": "modern-recompute", "overrides": MODERN + ["model.recompute=full"]},
                    "pp2": {"name": "modern-recompute", "overrides": MODERN + ["model.recompute=selective"]}}

# Beside the layouts, in the same jobs: the negative control, bf16 and the micro-batch split.
PER_SHARD_LAYOUT = ("tp2-per-shard", 2, 1, 2, [], [PER_SHARD, SAW_PER_SHARD])
BF16_LAYOUT = ("bf16-pp2-dp2-zero1", 1, 2, 4, ["parallel.zero_stage=1", "train.precision=bf16"],
               RUNS + [PACKED_RUN, MODERN_RUN, MODERN_PACKED_RUN])
MICRO_8_LAYOUT = ("micro-8", 1, 1, 1, ["train.micro_batch_size=8"], RUNS)


def jobs() -> dict[int, list]:
    """world size -> (label, tp, pp, extra overrides, runs) of everything one job of that size
    trains: a job runs its layouts one after the other, its processes (and their loader
    forkservers) started once."""
    by_world = {}
    def runs_of(label):
        packed = [PACKED_RUN] if label in PACKED_LAYOUTS else []
        modern = ([MODERN_RUN] if label in MODERN_LAYOUTS else []) + \
            ([MODERN_PACKED_RUN] if label in MODERN_LAYOUTS and label in PACKED_LAYOUTS else [])
        optimizers = [run for run in RUNS + [SAW_RUN] if run["name"] not in LEFT_OUT.get(label, ())]
        return optimizers + packed + modern + ([MODERN_RECOMPUTE[label]] if label in MODERN_RECOMPUTE else [])

    everything = [("reference", 1, 1, 1, [], RUNS + [SAW_RUN, PADDED_RUN, PACKED_RUN, MODERN_RUN, MODERN_PADDED_RUN,
                                                     MODERN_PACKED_RUN]),
                  *[layout[:5] + (runs_of(layout[0]),) for layout in LAYOUTS],
                  PER_SHARD_LAYOUT, BF16_LAYOUT, MICRO_8_LAYOUT]
    for label, tp, pp, world, extra, runs in everything:
        by_world.setdefault(world, []).append((label, tp, pp, extra, runs))
    return by_world


def train_layouts(tmp_path, world, layouts) -> dict:
    """{label: {run name: result}} of one job, each run's final weights read back from the
    checkpoint it saved (whole tensors by Hugging Face name, whatever the layout)."""
    from pretrain.checkpoint.logical import read_native

    out, runs, saves = tmp_path / "result.json", [], {}
    for label, tp, pp, extra, layout_runs in layouts:
        for run in layout_runs:
            name = f"{label}/{run['name']}"
            saves[name] = tmp_path / f"ckpt-{label}-{run['name']}"
            overrides = run["overrides"] + FOUR_LAYERS + extra + [f"checkpoint.save_dir={saves[name]}"]
            runs.append(json.dumps(dict(run, name=name, tp=tp, pp=pp, overrides=overrides)))
    run_ranks(["tests/_train_worker.py", str(out), "1", "1", *runs], world, timeout=1200)
    results = {}
    for name, result in json.loads(out.read_text()).items():
        result["weights"] = read_native(str(saves[name]), with_optimizer=False).weights
        label, run = name.split("/")
        results.setdefault(label, {})[run] = result
    return results


def weight_errors(ours: dict, reference: dict) -> dict[str, float]:
    """Each parameter's difference, relative: ||ours - reference|| / ||reference|| (L2; the largest
    single element would measure zero-initialised biases against their own rounding).

    Left out: the attention key biases. Their gradient is zero in exact arithmetic (a softmax
    ignores a constant added to all of a query's scores), so what they hold after a few steps
    of Adam or LAMB is rounding noise normalised to steps of size lr: it differs between any two
    summation orders, single-process runs included."""
    assert ours.keys() == reference.keys()
    return {name: ((ours[name] - ref).norm() / ref.norm()).item() for name, ref in reference.items()
            if not name.endswith("attention.self.key.bias")}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """label -> that layout's runs. One job per world size, two jobs at a time (a job keeps 2
    cores about half busy), the largest first; each test waits for its own job (a failed job
    fails its tests only)."""
    pool = ThreadPoolExecutor(2)
    by_world = {world: pool.submit(train_layouts, tmp_path_factory.mktemp(f"world{world}"), world, layouts)
                for world, layouts in sorted(jobs().items(), reverse=True)}
    labels = {layout[0]: world for world, layouts in jobs().items() for layout in layouts}
    yield lambda label: by_world[labels[label]].result()[label]
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def reference(layout_runs):
    return layout_runs("reference")


def assert_close(actual, expected, what, rel=TOLERANCE):
    assert actual == pytest.approx(expected, rel=rel), f"{what}: {actual} != {expected}"


def expected_groups(name: str, embeddings_decay: bool, weight_decay: float = 0.01) -> list:
    """[weight decay, layer adaptation] by the Hugging Face name alone: biases and LayerNorm get
    neither (BERT's and transformers' run_mlm convention), embeddings decay as configured."""
    if name.endswith("bias") or ".LayerNorm." in name or name.endswith("norm.weight"):  # BERT's, ModernBERT's
        return [0.0, False]
    if "embeddings." in name:
        return [weight_decay if embeddings_decay else 0.0, True]
    return [weight_decay, True]


def assert_layout_took_effect(run: dict, reference_run: dict, label, tp, pp, world, wrapper, client):
    ranks = run["ranks"]
    dp = world // (tp * pp)
    reference_rank = reference_run["ranks"][0]
    whole_model = reference_rank["counted_elements"]
    assert reference_rank["local_elements"] == whole_model
    assert len(ranks) == world
    assert {(r["tp_rank"], r["pp_rank"], r["dp_rank"]) for r in ranks} == \
        {(t, p, d) for t in range(tp) for p in range(pp) for d in range(dp)}, f"{label}: coordinates"
    for r in ranks:
        where = f"{label} rank {r['rank']}"
        assert r["megatron_tp_size"] == tp, where
        assert r["deepspeed_dp_size"] == dp, where
        assert r["deepspeed_stages"] == pp and r["deepspeed_stage_id"] == r["pp_rank"], where
        assert r["optimizer_wrapper"] == (wrapper or client), where
        assert r["parameter_dtypes"] == "torch.float32", where
        if tp * pp > 1:
            assert r["local_elements"] < whole_model, f"{where}: holds the whole model"
        if r["zero3_parameters"]:
            assert r["zero3_partitioned"] == r["zero3_parameters"], f"{where}: unpartitioned ZeRO-3 parameters"
        elif tp * pp == 1:
            assert r["local_elements"] == whole_model, where
    assert (wrapper == "DeepSpeedZeroOptimizer_Stage3") == all(r["zero3_parameters"] > 0 for r in ranks), label
    # Over one data-parallel replica the ranks hold the whole model, each parameter once.
    assert sum(r["counted_elements"] for r in ranks if r["dp_rank"] == 0) == whole_model, label


def assert_groups_by_name(run: dict, reference_run: dict, label: str, embeddings_decay: bool,
                          weight_decay: float = 0.01):
    names = set(reference_run["ranks"][0]["logical_names"])
    seen = {}
    for r in run["ranks"]:
        for name, settings in r["optimizer_groups"].items():
            assert seen.setdefault(name, settings) == settings, f"{label}: ranks disagree on {name}'s group"
    assert set(seen) == names, f"{label}: parameters no optimizer group steps: {sorted(names - set(seen))}"
    for name, settings in seen.items():
        assert settings == expected_groups(name, embeddings_decay, weight_decay), \
            f"{label}: {name} is stepped with {settings}"


@pytest.mark.parametrize("label,tp,pp,world,extra,wrapper", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_matches_single_process(reference, layout_runs, label, tp, pp, world, extra, wrapper):
    result = layout_runs(label)
    assert set(result) >= set(OPTIMIZERS) - LEFT_OUT.get(label, set())
    for optimizer, client in OPTIMIZERS.items():
        if optimizer in LEFT_OUT.get(label, ()):
            continue
        ours, ref = result[optimizer]["history"], reference[optimizer]["history"]
        assert len(ours) == len(ref) == 5
        for step, (a, b) in enumerate(zip(ours, ref), start=1):
            for key in ("loss", "lm_loss", "nsp_loss", "grad_norm"):
                assert_close(a[key], b[key], f"{label} {optimizer} step {step} {key}")
            assert a["learning_rate"] == b["learning_rate"]
        assert_close(result[optimizer]["params_norm"], reference[optimizer]["params_norm"], f"{label} {optimizer} params norm")
        errors = weight_errors(result[optimizer]["weights"], reference[optimizer]["weights"])
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{label} {optimizer}: {worst} differs by {errors[worst]:.2e} of its norm"
        for key, value in reference[optimizer]["evaluation"].items():
            assert_close(result[optimizer]["evaluation"][key], value, f"{label} {optimizer} evaluation {key}")
        assert_layout_took_effect(result[optimizer], reference[optimizer], label, tp, pp, world, wrapper, client)
        assert_groups_by_name(result[optimizer], reference[optimizer], label, embeddings_decay=optimizer != "adamw")


@pytest.mark.parametrize("tp,stage,world", [(1, 0, 1), (2, 1, 4)], ids=["tp1-zero0", "tp2-dp2-zero1"])
def test_bert_base_parameter_groups_by_name(tmp_path, tp, stage, world):
    """BERT-base's real parameter list (configs/bert-base.yaml): every parameter transformers'
    BertForPreTraining has is stepped, with the settings its name calls for, in whole tensors and
    in TP shards inside ZeRO's flat groups."""
    from transformers import BertConfig, BertForPreTraining

    with torch.device("meta"):
        hf_names = [name for name, _ in BertForPreTraining(BertConfig()).named_parameters()]  # BERT-base
    out = tmp_path / "groups.json"
    run_ranks(["tests/_groups_worker.py", str(out), str(tp), str(stage)], world, timeout=600)
    result = json.loads(out.read_text())
    assert result["no_weight_decay"] == ["bias", "layernorm"]  # so the embeddings decay
    assert {r["megatron_tp_size"] for r in result["ranks"]} == {tp} and len(result["ranks"]) == world
    assert sorted(result["ranks"][0]["logical_names"]) == sorted(hf_names) and len(hf_names) == 206
    assert_groups_by_name(result, result, f"BERT-base tp{tp} zero{stage}", embeddings_decay=True,
                          weight_decay=result["weight_decay"])


@pytest.mark.parametrize("label", MODERN_LAYOUTS)
def test_modernbert_layout_matches_single_process(reference, layout_runs, label):
    """ModernBERT (rotary positions, GeGLU, pre-LN, windowed layers) is as layout-free as BERT: the
    same steps, weights and evaluation in every layout, which took effect."""
    _, tp, pp, world, _, wrapper = next(layout for layout in LAYOUTS if layout[0] == label)
    result, ref = layout_runs(label)["modern"], reference["modern"]
    assert len(result["history"]) == len(ref["history"]) == 5
    for step, (a, b) in enumerate(zip(result["history"], ref["history"]), start=1):
        for key in ("loss", "lm_loss", "grad_norm"):
            assert_close(a[key], b[key], f"{label} modernbert step {step} {key}")
        assert a["nsp_loss"] == b["nsp_loss"] == 0.0
    assert_close(result["params_norm"], ref["params_norm"], f"{label} modernbert params norm")
    errors = weight_errors(result["weights"], ref["weights"])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, f"{label} modernbert: {worst} differs by {errors[worst]:.2e} of its norm"
    for key, value in ref["evaluation"].items():
        assert_close(result["evaluation"][key], value, f"{label} modernbert evaluation {key}")
    assert_layout_took_effect(result, ref, label, tp, pp, world, wrapper, "Lamb")
    assert_groups_by_name(result, ref, label, embeddings_decay=True)


@pytest.mark.parametrize("label", list(MODERN_RECOMPUTE))
def test_modernbert_recomputation_is_the_same_training(reference, layout_runs, label):
    """Recomputing ModernBERT's layers (full) or its attention core (selective) in backward changes
    what is kept, not what is computed: the steps equal the single-process run's within 1e-5."""
    result, ref = layout_runs(label)["modern-recompute"], reference["modern"]
    for step, (a, b) in enumerate(zip(result["history"], ref["history"], strict=True), start=1):
        for key in ("loss", "grad_norm"):
            assert_close(a[key], b[key], f"{label} {MODERN_RECOMPUTE[label]['overrides'][-1]} step {step} {key}")
    assert_close(result["params_norm"], ref["params_norm"], f"{label} recompute params norm")


def test_modernbert_reference_is_modernbert_and_learns(reference):
    """The runs above trained ModernBERT's parameters (transformers' names, the optional biases
    asked for, layer 0 without attn_norm), and training moved them."""
    modern = reference["modern"]
    names = modern["ranks"][0]["logical_names"]
    assert len(names) == 3 + 8 + 3 * 10 + 5 + 1, names  # embeddings, layer 0, layers 1-3, head, decoder bias
    assert "model.layers.1.attn_norm.bias" in names and "model.layers.0.attn_norm.weight" not in names
    assert "model.layers.0.mlp.Wi.bias" in names and not any(".attn.Wqkv.bias" in n for n in names)
    assert modern["history"][-1]["loss"] < modern["history"][0]["loss"]
    assert modern["history"][0]["loss"] != reference["lamb"]["history"][0]["loss"]


def test_reference_learns_and_optimizers_differ(reference):
    """Guards against a vacuous comparison: training moves the loss, LAMB is not AdamW, the
    evaluation sees other data than training, and the groups are checked on every parameter."""
    lamb, adamw = reference["lamb"]["history"], reference["adamw"]["history"]
    assert lamb[0]["loss"] == adamw[0]["loss"]
    assert abs(lamb[-1]["loss"] - adamw[-1]["loss"]) > 1e-3
    assert lamb[-1]["loss"] != lamb[0]["loss"]
    assert all(h["grad_norm"] > 1.0 for h in lamb[:2]), "clipping (max norm 1.0) must be exercised"
    assert reference["lamb"]["evaluation"]["loss"] != lamb[-1]["loss"]
    assert reference["lamb"]["evaluation"]["loss"] != reference["adamw"]["evaluation"]["loss"]
    names = reference["lamb"]["ranks"][0]["logical_names"]
    assert len(names) == 5 + 4 * 16 + 9  # embeddings, 16 per layer, heads (the decoder is tied)


def test_per_shard_trust_ratios_are_caught(reference, layout_runs):
    """Negative control: TP2 with each rank's shard taken for a whole parameter (what a LAMB
    unaware of TP computes) must miss the reference by far more than the tolerance, or the
    tolerance could not tell a right layout from a wrong one."""
    result = layout_runs(PER_SHARD_LAYOUT[0])["lamb-per-shard"]
    ours, ref = result["history"], reference["lamb"]["history"]
    assert ours[0]["loss"] == pytest.approx(ref[0]["loss"], rel=TOLERANCE)  # the first loss precedes any step
    # The losses alone move by less than the tolerance in 5 steps (a shard's norms are close to
    # half its parameter's): the weights, compared tensor by tensor, are what catches it.
    errors = weight_errors(result["weights"], reference["lamb"]["weights"])
    caught = [name for name, error in errors.items() if error > 100 * TOLERANCE]
    assert caught, f"per-shard trust ratios stay within {100 * TOLERANCE} of the reference: {errors}"


def test_per_shard_stable_adamw_rms_is_caught(reference, layout_runs):
    """The same control for StableAdamW: its update-clipping RMS taken per TP shard. Where the RMS
    of the whole parameter and of its shards are both <= 1 the two steps are the same bits, so
    being caught also proves that the clipping engaged on TP-sharded parameters in these 5 steps."""
    result = layout_runs(PER_SHARD_LAYOUT[0])["stable_adamw-per-shard"]
    assert result["history"][0]["loss"] == pytest.approx(reference["stable_adamw"]["history"][0]["loss"], rel=TOLERANCE)
    errors = weight_errors(result["weights"], reference["stable_adamw"]["weights"])
    caught = [name for name, error in errors.items() if error > 100 * TOLERANCE]
    assert caught, f"per-shard RMS terms stay within {100 * TOLERANCE} of the reference: {errors}"


def test_bf16_pipeline_zero1_tracks_fp32(reference, layout_runs):
    """bf16 (DeepSpeed bf16: bf16 weights and activations, fp32 master weights) in a PP2 x DP2
    ZeRO-1 layout follows the fp32 single-process run closely (not exactly: bf16 rounds).

    Tolerances from bf16's 8-bit significand (relative rounding 2**-9 = 0.2%): losses are fp32
    reductions of bf16 activations, ~0.1% off; gradient norms sum squares of bf16 gradients,
    each ~0.4% off at most, and the errors partly cancel."""
    result = layout_runs(BF16_LAYOUT[0])
    for optimizer in ("lamb", "adamw", "modern"):
        for step, (a, b) in enumerate(zip(result[optimizer]["history"], reference[optimizer]["history"]), start=1):
            assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), f"{optimizer} step {step} loss"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2), f"{optimizer} step {step} grad norm"
        assert result[optimizer]["history"][-1]["loss"] != reference[optimizer]["history"][-1]["loss"]
        assert {r["optimizer_wrapper"] for r in result[optimizer]["ranks"]} == {"BF16_Optimizer"}  # fp32 accumulation
        assert {r["parameter_dtypes"] for r in result[optimizer]["ranks"]} == {"torch.bfloat16"}


def test_micro_batch_split_does_not_change_the_step(reference, layout_runs):
    """Gradient accumulation: the MLM loss of a step is one mean over every masked token of the
    global batch (PretrainingLoss), so global batch 8 as one micro-batch of 8 gives the step that
    4 micro-batches of 2 give, although those hold different numbers of masked tokens (checked
    below: under a mean of per-micro-batch means, Megatron's definition, the two would differ)."""
    from test_hf_training_parity import global_batches

    masked = [int(labels[1][i:i + 2].sum()) for _, labels in global_batches(FOUR_LAYERS) for i in range(0, 8, 2)]
    assert len(set(masked)) > 1, masked
    result = layout_runs(MICRO_8_LAYOUT[0])
    for optimizer in ("lamb", "adamw"):
        for step, (a, b) in enumerate(zip(result[optimizer]["history"], reference[optimizer]["history"]), start=1):
            for key in ("loss", "lm_loss", "nsp_loss", "grad_norm"):
                assert_close(a[key], b[key], f"1x8 vs 4x2 {optimizer} step {step} {key}")
        assert_close(result[optimizer]["params_norm"], reference[optimizer]["params_norm"], f"1x8 {optimizer} params norm")


PACKED_CASES = [(label, "") for label in ["reference", *PACKED_LAYOUTS, BF16_LAYOUT[0]]] + \
    [(label, "modern-") for label in ["reference", *[l for l in PACKED_LAYOUTS if l in MODERN_LAYOUTS], BF16_LAYOUT[0]]]


@pytest.mark.parametrize("label,family", PACKED_CASES, ids=[f"{family}{label}" for label, family in PACKED_CASES])
def test_packed_run_is_the_padded_run(reference, layout_runs, label, family):
    """data.packing is a speed switch, nothing else: packed at TP1, TP2, PP2 (the pipeline
    exchanging shapes per micro-batch), DP2 ZeRO-1 and TP2 x PP2 x DP2 ZeRO-1, the 5 steps'
    losses, gradient norms, final weights and evaluation equal the padded single-process run of
    the same samples within 1e-5 (bf16: within its rounding, as test_bf16_pipeline_zero1_tracks_fp32).
    Both compute real tokens only (computed = real on both sides, outside context parallelism:
    unpadding.py); the packing took effect: the same samples came in fewer rows."""
    packed, padded = layout_runs(label)[f"{family}packed"], reference[f"{family}padded"]
    bf16 = label == BF16_LAYOUT[0]
    loss_tolerance, norm_tolerance = (2e-3, 1e-2) if bf16 else (TOLERANCE, TOLERANCE)
    assert len(packed["history"]) == len(padded["history"]) == 5
    for step, (a, b) in enumerate(zip(packed["history"], padded["history"]), start=1):
        for key in ("loss", "lm_loss", "nsp_loss"):
            assert_close(a[key], b[key], f"{label} packed step {step} {key}", rel=loss_tolerance)
        assert_close(a["grad_norm"], b["grad_norm"], f"{label} packed step {step} grad norm", rel=norm_tolerance)
        assert a["real_tokens"] == b["real_tokens"], f"step {step}: other samples"
        assert a["computed_tokens"] == a["real_tokens"] and b["computed_tokens"] == b["real_tokens"]
    given = [sum(r["input_tokens"] for r in run["ranks"] if r["input_tokens"] is not None and r["tp_rank"] == 0)
             for run in (packed, padded)]
    assert 0 < given[0] <= 0.8 * given[1], f"{label}: hardly packed ({given[0]} of {given[1]} row tokens)"
    if not bf16:
        assert_close(packed["params_norm"], padded["params_norm"], f"{label} packed params norm")
        errors = weight_errors(packed["weights"], padded["weights"])
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"{label} packed: {worst} differs by {errors[worst]:.2e} of its norm"
    for key, value in padded["evaluation"].items():
        assert_close(packed["evaluation"][key], value, f"{label} packed evaluation {key}",
                     rel=loss_tolerance if bf16 else TOLERANCE)
    other = reference["modern" if family else "lamb"]
    assert padded["history"][-1]["loss"] != other["history"][-1]["loss"]  # other data than that run
