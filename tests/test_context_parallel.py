"""Context parallelism (pretrain/model/context_parallel.py): the attention of each rank's share of
a row equals its share of one process's attention over the whole row, forward and backward, at CP2
and CP4, for packed documents crossing the ranks' boundaries and one long document, global and
local layers; local layers exchange only the halo (half a window with each neighbour) unless the
shares are shorter than it. Training (one 4-rank job runs every configuration): ModernBERT and
BERT at CP4, CP2 x DP2 (ZeRO-1, -3), CP2 x TP2 and CP2 x PP2 equal DP4; bf16 within its rounding; a
CP2 checkpoint resumes at CP4 and CP1; activation memory per rank falls with CP, beside the
planner's estimate.
"""
import json

import pytest

from distributed import run_ranks


@pytest.fixture(scope="module")
def attention_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "attention.json"
    run_ranks(["tests/_cp_attention_worker.py", str(out)], 4, timeout=300)
    return json.loads(out.read_text())


def test_each_share_of_the_attention_equals_one_process(attention_results):
    from _cp_attention_worker import CASES, DIM, HEADS, SPLITS

    globals_ = sum(1 for _, window in CASES.values() if window is None)
    assert len(attention_results) == 2 * (len(CASES) * (len(SPLITS) - 1) + globals_)
    for case, r in attention_results.items():
        cp = int(case.split("/")[0][2:])
        if case.endswith("/ring"):
            continue
        assert r["max_abs"] < 1e-10, (case, r)  # float64: the same sums in another order
        assert r["scale"] > 0.1, case
        # the split took effect: rank 0 computed its share of the queries only, shares equal to a token
        assert r["queries"] == r["shares"][0] and max(r["shares"]) - min(r["shares"]) <= 1, case
        assert sum(r["shares"]) == r["tokens"], case
        # rank 0 sent the keys and values other ranks' windows reach (forward) and received their
        # gradients back, and the reverse: exactly the tokens the rule says, none on global layers
        assert r["exchanged"] == ([] if CASES[case.split("/")[1]][1] is None else r["expected_exchange"]), case
        lengths = CASES[case.split("/")[1]][0]
        assert sum(r["work"]) == sum(n * n for n in lengths), case
    # the local cases crossed ranks; a halo of 5 over shares of 3 reached two ranks away: rank 0
    # (positions 0-2) received 3-6, the rest of its 7-token document, from ranks 1 and 2
    assert attention_results["cp2/packed-local/even"]["exchanged"][0] > 0
    assert attention_results["cp4/short-shares-local/even"]["exchanged"][2] == 4 * 16
    # the ring equals one process without gathering anything: each step passes one share's keys and
    # values ([2, longest share, heads, dim]) to the next rank, backward the same with the gradient
    # accumulated for them, and one last hop returns each share's gradient to its owner
    for case, r in attention_results.items():
        if not case.endswith("/ring"):
            continue
        cp = int(case.split("/")[0][2:])
        assert r["max_abs"] < 1e-10 and r["scale"] > 0.1, (case, r)
        assert r["queries"] == r["shares"][0] and max(r["shares"]) - min(r["shares"]) <= 1, case
        kv = 2 * max(r["shares"]) * HEADS * DIM
        assert r["gathers"] == 0, case
        assert r["exchanged"] == [kv] * (cp - 1) + [kv] + [2 * kv] * (cp - 2) + [kv, kv], (case, r["exchanged"])
    # balanced: every document of at least cp x 2 tokens cut into one piece per rank, and the
    # global layers' work within 10 % of even where the contiguous split is 3x off
    for cp in (2, 4):
        balanced, even = (attention_results[f"cp{cp}/skewed-global/{how}"] for how in ("balanced", "even"))
        assert sum(1 for runs in balanced["runs"] if any(a == 0 and b >= 40 for a, b in runs)) == 0
        assert max(balanced["work"]) / min(balanced["work"]) < 1.1, balanced["work"]
        assert max(even["work"]) / min(even["work"]) > 3, even["work"]


MODERN = ["model.architecture=modernbert", "data.segment_pairs=none", "model.global_attn_every_n_layers=2",
          "model.local_attention=8", "model.layernorm_epsilon=1e-5", "train.train_steps=3",
          # samples of 4-32 tokens, rows of 32, 4 per micro-batch: packing puts several in a row
          "data.synthetic_min_fraction=0.1", "train.global_batch_size=16", "train.micro_batch_size=4", "eval.steps=2"]
# (name, tp, pp, cp, overrides): one process group of 4 ranks runs them all; recomputation (full,
# selective) must not change the numbers either
# (CP2 x DP2 with ZeRO-1: the resume runs' first half, against the straight DP4 run)
LAYOUTS = [("dp4", 1, 1, 1, []), ("cp4", 1, 1, 4, []), ("cp2-dp2-zero3", 1, 1, 2, ["parallel.zero_stage=3"]),
           ("cp2-tp2-recompute-full", 2, 1, 2, ["model.recompute=full"]),
           ("cp2-pp2-recompute-selective", 1, 2, 2, ["model.recompute=selective"]),
           ("cp4-ring", 1, 1, 4, ["parallel.context_attention=ring"])]
# one step on rows of one 2,048-token sample each, one per rank and micro-batch
LONG_ROW = ["data.seq_length=2048", "model.max_position_embeddings=2048", "data.synthetic_min_fraction=1.0",
            "data.short_seq_prob=0", "train.global_batch_size=4", "train.micro_batch_size=1", "train.train_steps=1",
            "data.max_predictions_per_seq=null", "scheduler.warmup_steps=0"]
# BERT's: rows of 512 with attention dropout (its softmax spelled out off CUDA: the scores are kept)
BERT_LONG_ROW = ["data.seq_length=512", "model.max_position_embeddings=512", "model.attention_dropout=0.1",
                 "data.max_predictions_per_seq=null",
                 "train.global_batch_size=4", "train.micro_batch_size=1", "train.train_steps=1",
                 "scheduler.warmup_steps=0"]
# BERT (learned positions, full attention, the next-sentence head): the same, and ZeRO-3
BERT = [("bert-dp4", 1, 1, 1, []), ("bert-cp4", 1, 1, 4, []), ("bert-cp2-dp2-zero3", 1, 1, 2, ["parallel.zero_stage=3"]),
        ("bert-cp2-tp2", 2, 1, 2, []), ("bert-cp2-pp2-recompute-selective", 1, 2, 2, ["model.recompute=selective"])]
BERT_DATA = ["data.synthetic_min_fraction=0.1", "train.global_batch_size=16", "train.micro_batch_size=4",
             "train.train_steps=3", "eval.steps=2"]
# packed input (ModernBERT: unpadded into the same row as padded input) at these layouts
PACKED = ("cp4", "cp2-tp2-recompute-full")
BF16 = [("dp4-bf16", 1, 1, 1, ["train.precision=bf16", "parallel.zero_stage=2"]),
        ("cp2-dp2-zero2-bf16", 1, 1, 2, ["train.precision=bf16", "parallel.zero_stage=2"]),
        ("cp2-dp2-zero2-bf16-ring", 1, 1, 2, ["train.precision=bf16", "parallel.zero_stage=2",
                                              "parallel.context_attention=ring"])]


def resume_runs(directory) -> list[dict]:
    """3 of 6 steps at CP2 x DP2 (ZeRO-1) saved, resumed at CP4 and at CP1 (DP4), and 6 steps straight at DP4."""
    six = MODERN + ["train.train_steps=6", "parallel.zero_stage=1"]
    saved = f"checkpoint.load_dir={directory}/cp2"
    return [{"name": "first-cp2", "cp": 2, "overrides": six + [f"checkpoint.save_dir={directory}/cp2",
                                                                "resilience.exit_after_steps=3"]},
            {"name": "straight-dp4", "cp": 1, "overrides": six},
            {"name": "second-cp4", "cp": 4, "overrides": six + [saved, f"checkpoint.save_dir={directory}/cp4"]},
            {"name": "second-cp1", "cp": 1, "overrides": six + [saved, f"checkpoint.save_dir={directory}/cp1"]}]


@pytest.fixture(scope="module")
def training_results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cp")
    out = directory / "training.json"
    def run(name, tp, pp, cp, overrides, data, base):
        return json.dumps({"name": f"{name}/{data}", "tp": tp, "pp": pp, "cp": cp, "evaluate": True,
                           "overrides": base + overrides + [f"data.packing={str(data == 'packed').lower()}"]})

    runs = [run(*layout, "padded", MODERN) for layout in LAYOUTS]
    runs += [run(*layout, "packed", MODERN) for layout in LAYOUTS if layout[0] in PACKED + ("dp4",)]
    runs += [run(*layout, "packed", MODERN) for layout in BF16]
    runs += [run(*layout, "padded", BERT_DATA) for layout in BERT]
    runs += [run(*layout, "packed", BERT_DATA) for layout in BERT if layout[0] in ("bert-dp4", "bert-cp4")]
    runs += [json.dumps(run) for run in resume_runs(directory)]
    runs += [json.dumps({"name": f"memory-cp{cp}", "cp": cp, "overrides": MODERN + LONG_ROW}) for cp in (1, 2, 4)]
    runs += [json.dumps({"name": "memory-cp4-ring", "cp": 4,
                         "overrides": MODERN + LONG_ROW + ["parallel.context_attention=ring"]})]
    runs += [json.dumps({"name": f"memory-bert-cp{cp}", "cp": cp, "overrides": BERT_LONG_ROW}) for cp in (2, 4)]
    # grouped by layout: building a layout's process groups costs more than a run (about 2 s against
    # 0.4-1 s); CP2 first, so that the resume runs' CP2 half precedes their CP1 and CP4 halves
    order = {(1, 1, 2): 0, (1, 1, 1): 1, (1, 1, 4): 2}
    runs.sort(key=lambda run: order.get(tuple(json.loads(run).get(k, 1) for k in ("tp", "pp", "cp")), 3)
              * 10 + json.loads(run).get("tp", 1) * 3 + json.loads(run).get("pp", 1))
    run_ranks(["tests/_train_worker.py", str(out), "1", "1", *runs], 4, timeout=600)
    results = json.loads(out.read_text())
    print({name: round(r.get("seconds", 0), 1) for name, r in results.items()})
    return results


def check_layout(run, name, tp, pp, cp):
    """What proves the layout took effect: megatron-core's CP size, DeepSpeed averaging over context x
    data, and each rank's first encoder layer computing its share of every row (up to one token per
    forward: a share is the row over CP rounded up or down)."""
    forwards = len(run["history"]) * 4 * 2 + 2 * 4  # steps x micro-batches x (forward, recompute) + evaluation
    for rank in run["ranks"]:
        assert rank["megatron_cp_size"] == cp and rank["deepspeed_dp_size"] == 4 // (tp * pp), (name, rank)
        if rank["ring_calls"] is not None:  # ModernBERT: ring attention ran in its ring layouts only
            assert (rank["ring_calls"] > 0) == ("ring" in name), (name, rank["ring_calls"])
        if rank["tokens_computed"] is not None:  # ranks of the first pipeline stage
            local, row, _, _ = rank["tokens_computed"]
            assert row > 0 and abs(local - row / cp) <= forwards, (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["padded", "packed"])
def test_training_at_every_context_parallel_layout_equals_one_replica(training_results, data):
    """Losses per step, the weights after them (their norm) and the evaluation at CP4 (all-gather
    and ring), CP2 x DP2 with ZeRO-1 and ZeRO-3, CP2 x TP2 and CP2 x PP2 equal DP4 (the same
    global batch) in fp32; bf16 with ZeRO-2 at CP2 x DP2 (all-gather and ring) equals DP4's
    within bf16's rounding (packed input). Packed input (fewer rows, the same samples, unpadded
    into the same row of real tokens) at CP4 and CP2 x TP2."""
    reference = training_results[f"dp4/{data}"]
    losses = [step["lm_loss"] for step in reference["history"]]
    assert len(losses) == 3 and all(loss > 1.0 for loss in losses)
    local, row, documents, forwards = reference["ranks"][0]["tokens_computed"]
    assert local == row and documents == 4 * forwards  # one replica computes every token of its 4 samples
    for name, tp, pp, cp, _ in LAYOUTS[1:]:
        if data == "packed" and name not in PACKED:
            continue
        run = training_results[f"{name}/{data}"]
        assert [step["lm_loss"] for step in run["history"]] == pytest.approx(losses, abs=1e-5), name
        assert run["params_norm"] == pytest.approx(reference["params_norm"], abs=1e-5), name
        assert run["evaluation"]["lm_loss"] == pytest.approx(reference["evaluation"]["lm_loss"], abs=1e-5), name
        check_layout(run, name, tp, pp, cp)
    if data == "padded":
        return
    bf16, *cp_bf16 = (training_results[f"{name}/{data}"] for name, *_ in BF16)
    for run, (name, *_) in zip(cp_bf16, BF16[1:]):
        assert all(rank["parameter_dtypes"] == "torch.bfloat16" for rank in run["ranks"]), name
        assert [step["lm_loss"] for step in run["history"]] == pytest.approx(
            [step["lm_loss"] for step in bf16["history"]], abs=2e-2), name
        check_layout(run, name, 1, 1, 2)



@pytest.mark.slow
def test_a_checkpoint_written_at_cp2_resumes_at_cp4_and_cp1(training_results):
    """CP leaves no trace in the weights: the CP2 run's step-3 checkpoint resumed at CP4 and at CP1
    (layout-free: another context x data size) continues as the straight run (1e-5)."""
    straight = [step["lm_loss"] for step in training_results["straight-dp4"]["history"]]
    first = [step["lm_loss"] for step in training_results["first-cp2"]["history"]]
    assert len(straight) == 6 and first == pytest.approx(straight[:3], abs=1e-5)  # CP2 x DP2 with ZeRO-1 = DP4
    check_layout(training_results["first-cp2"], "first-cp2", 1, 1, 2)
    for name in ("second-cp4", "second-cp1"):
        second = training_results[name]["history"]
        assert len(second) == 3, name  # steps 4-6
        assert [step["lm_loss"] for step in second] == pytest.approx(straight[3:], abs=1e-5), name
        assert training_results[name]["params_norm"] == pytest.approx(
            training_results["straight-dp4"]["params_norm"], abs=1e-5), name
        assert any("context_parallel: checkpoint 2 vs run" in line and "loaded layout-free" in line
                   for line in training_results[name]["log"]), name


@pytest.mark.slow
def test_activation_memory_per_rank_falls_with_the_context_parallel_size(training_results):
    """The same 2,048-token rows at CP1, CP2 and CP4 (and CP4 with the ring): each rank's measured
    activation peak (the trainer's own measurement after its first step) and the planner's
    prediction beside it; BERT's 512-token rows at CP2 and CP4 within the same band."""
    peaks, planned = {}, {}
    for cp in (1, 2, 4, "4-ring"):
        memory = training_results[f"memory-cp{cp}"]["memory"]
        peaks[cp] = max(rank["measured"]["activations_peak"] for rank in memory)
        planned[cp] = max(rank["planned"]["activations_peak"] for rank in memory)
    print({"measured": peaks, "planned": planned})
    assert 0.4 < peaks[2] / peaks[1] < 0.65 and 0.2 < peaks[4] / peaks[1] < 0.4, peaks
    # the ring keeps no other share's keys and values (but its own and a float32 context): less
    # than the all-gather at the same CP, by about the planner's difference
    assert peaks["4-ring"] < peaks[4], peaks
    assert 0.5 < (peaks[4] - peaks["4-ring"]) / (planned[4] - planned["4-ring"]) < 2, (peaks, planned)
    for cp in (1, 2, 4, "4-ring"):
        assert 0.8 < planned[cp] / peaks[cp] < 1.25, (cp, planned, peaks)
    # BERT: each rank's queries attend the whole row, so its scores shrink as the share, not its square
    for cp in (2, 4):
        memory = training_results[f"memory-bert-cp{cp}"]["memory"]
        peak = max(rank["measured"]["activations_peak"] for rank in memory)
        plan = max(rank["planned"]["activations_peak"] for rank in memory)
        print({"bert": cp, "measured": peak, "planned": plan})
        assert 0.8 < plan / peak < 1.25, (cp, plan, peak)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["padded", "packed"])
def test_bert_at_every_context_parallel_layout_equals_one_replica(training_results, data):
    """BERT (learned positions, full attention, masked LM and next sentence): CP4, CP2 x DP2 with
    ZeRO-3, CP2 x TP2 and CP2 x PP2 (selective recomputation) equal DP4 in fp32 (1e-5), losses of
    both heads, weights and evaluation; DeepSpeed averaged over context x data."""
    reference = training_results[f"bert-dp4/{data}"]
    assert all(step["nsp_loss"] > 0.1 for step in reference["history"])
    for name, tp, pp, cp, _ in BERT[1:]:
        if data == "packed" and name != "bert-cp4":
            continue
        run = training_results[f"{name}/{data}"]
        for key in ("lm_loss", "nsp_loss"):
            assert [s[key] for s in run["history"]] == pytest.approx([s[key] for s in reference["history"]],
                                                                     abs=1e-5), (name, key)
        assert run["params_norm"] == pytest.approx(reference["params_norm"], abs=1e-5), name
        assert run["evaluation"]["lm_loss"] == pytest.approx(reference["evaluation"]["lm_loss"], abs=1e-5), name
        for rank in run["ranks"]:
            assert rank["megatron_cp_size"] == cp and rank["deepspeed_dp_size"] == 4 // (tp * pp), (name, rank)
