"""The GPU code path, run on devices that are not the CPU.

Each scenario runs twice:
- on `fakegpu` (BERT_FAKE_GPU=1; tests/bert-fakegpu/), in CI on the CPU: a second device type whose
  only communication backend is bound to it, so a CPU tensor handed to a collective, a tensor
  made without `device=` that meets a device tensor, or a CPU generator drawing for device
  tensors fails as it would under CUDA/NCCL. fakegpu runs the CPU kernels, so its results equal
  the CPU run's to rounding (1e-5);
- on real GPUs with NCCL (marker gpu: skipped with the reason on a machine without CUDA, failing
  instead where CUDA is present or REQUIRE_GPU=1), within what TF32-free fp32 or bf16/fp16
  rounding allows.
Every scenario also checks that the device took effect: the rank's device and backend, and where
the parameters, ZeRO partitions and optimizer tensors live.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from distributed import REPO, child_env, gpu_env, run_python, run_ranks, session_gpu_count
from side_by_side import side_by_side
from test_fill_mask import SENTENCES, VOCAB, check_against_transformers, models  # noqa: F401 (fixture)
from test_finetune_ner import synthetic_files, tiny_ner  # noqa: F401 (fixture)
from test_finetune_tasks import QUIET, repeat_task, tiny  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

CPU_ENV = {"BERT_FAKE_GPU": "0", "CUDA_VISIBLE_DEVICES": ""}
DEVICES = {"fakegpu": ({"BERT_FAKE_GPU": "1"}, "fakeccl"), "cuda": (gpu_env(BERT_FAKE_GPU="0"), "nccl")}
ZERO3 = ["parallel.zero_stage=3", "train.deepspeed_config=tests/zero3-partition-everything.json"]


def on_devices(gpus: int, fakegpu: bool = True):
    """Parameters for a scenario: fakegpu (unless excluded) and cuda with `gpus` GPUs."""
    params = [pytest.param("fakegpu", id="fakegpu")] if fakegpu else []
    return params + [pytest.param("cuda", id="cuda", marks=pytest.mark.gpu(gpus))]


def tolerance(device_type: str, precision: str = "fp32") -> float:
    if device_type == "fakegpu":
        return 1e-5  # the CPU's kernels (attention: SDPA's math path instead of the fused one)
    return 1e-4 if precision == "fp32" else 3e-2  # cuBLAS/cuDNN accumulation orders; bf16/fp16 rounding


def train(out_dir, tp, pp, world, overrides, env) -> dict:
    """The tests' tiny BERT, LAMB, dropout off, 5 steps (tests/_train_worker.py); the last stage's record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "result.json"
    run = json.dumps({"name": "lamb", "overrides": ["optimizer.name=lamb", *overrides]})
    run_ranks(["tests/_train_worker.py", str(out), str(tp), str(pp), run], world, timeout=900, env=env)
    return json.loads(out.read_text())["lamb"]


def assert_same_training(result, reference, rel, what):
    assert len(result["history"]) == len(reference["history"])
    for step, (a, b) in enumerate(zip(result["history"], reference["history"]), start=1):
        for key in ("loss", "lm_loss", "nsp_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=rel), f"{what} step {step} {key}"
    assert result["params_norm"] == pytest.approx(reference["params_norm"], rel=rel), f"{what} params norm"


def assert_ran_on(result, device_type: str, backend: str):
    where = result["device"]
    assert where["device"].startswith(f"{device_type}:") and where["backend"] == backend, where
    assert where["parameters"] == [where["device"]], f"parameters not (only) on {where['device']}: {where}"
    assert where["optimizer_tensors"] == [where["device"]], f"optimizer tensors not on {where['device']}: {where}"


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    """Single-process CPU runs, one per model shape the scenarios use."""
    cache = {}

    def get(*extra):
        if extra not in cache:
            cache[extra] = train(tmp_path_factory.mktemp("cpu"), 1, 1, 1, list(extra), CPU_ENV)
        return cache[extra]

    return get


# ----------------------------------------------------------------------------- pretraining steps
LAYOUTS = [  # (label, tp, pp, world, overrides); one GPU per rank. On fakegpu the TP, DP and PP
    # groups run in tests/test_precision_matrix.py instead, in every precision and ZeRO stage
    ("tp2-dp2-zero1", 2, 1, 4, ["parallel.zero_stage=1"]),
    ("dp2-zero3", 1, 1, 2, ZERO3),
    ("pp2", 1, 2, 2, []),
]


@pytest.mark.parametrize("label,tp,pp,world,extra,device_type",
                         [pytest.param(*layout, *device.values, id=f"{device.id}-{layout[0]}", marks=device.marks)
                          for layout in LAYOUTS for device in on_devices(layout[3], fakegpu=False)])
def test_pretraining_layouts(cpu_reference, tmp_path, device_type, label, tp, pp, world, extra):
    env, backend = DEVICES[device_type]
    result = train(tmp_path, tp, pp, world, extra + ["train.tf32=false"], env)
    assert_ran_on(result, device_type, backend)
    assert_same_training(result, cpu_reference(), tolerance(device_type), f"{device_type} {label}")


@pytest.mark.parametrize("device_type", on_devices(2, fakegpu=False))
def test_packed_bf16_pipeline(cpu_reference, tmp_path, device_type):
    """data.packing on the GPUs, bf16 ZeRO-1, PP2 (a micro-batch's rows change from one to the
    next: the stages exchange shapes per micro-batch) = the padded fp32 CPU run of the same
    samples within bf16's rounding: the block-diagonal attention of packed rows on CUDA's fused
    SDPA kernels against the padded path. (fakegpu runs the CPU's kernels, which
    test_layout_invariance compares packed and padded with; run on it, 31 s of CI time, in the
    making of this test: passed.)"""
    spread = ["data.synthetic_min_fraction=0.1", "train.micro_batch_size=4"]  # 8-32 tokens, 2 micro-batches
    env, backend = DEVICES[device_type]
    result = train(tmp_path, 1, 2, 2, spread + ["data.packing=true", "train.precision=bf16", "parallel.zero_stage=1",
                                               "train.tf32=false"], env)
    assert_ran_on(result, device_type, backend)
    padded = cpu_reference(*spread)
    assert_same_training(result, padded, 3e-2, f"{device_type} packed bf16 pp2")
    assert [h["real_tokens"] for h in result["history"]] == [h["real_tokens"] for h in padded["history"]]
    assert sum(h["computed_tokens"] for h in result["history"]) < 0.8 * sum(h["computed_tokens"]
                                                                            for h in padded["history"])


@pytest.mark.gpu(2)
@pytest.mark.parametrize("precision,stage", [(precision, stage) for precision in ("fp32", "bf16", "fp16")
                                             for stage in (0, 1, 2, 3) if (precision, stage) != ("fp16", 0)])
def test_nccl_zero_stages_and_precisions(cpu_reference, tmp_path, stage, precision):
    """fp16 starts at a loss scale of 2**8 (2**16 overflows this tiny model's first steps, which would
    then be skipped and differ from the CPU's by design); bf16 at ZeRO-0 accumulates in bf16 (fp32
    accumulation needs ZeRO >= 1); fp16 at ZeRO-0 is refused. tests/test_precision_matrix.py holds
    the run controls."""
    env, backend = DEVICES["cuda"]
    extra = ZERO3 if stage == 3 else [f"parallel.zero_stage={stage}"]
    extra += {"fp16": ["fp16.initial_scale_power=8"], "bf16": ["train.grad_accum_dtype=bf16"] if stage == 0 else []
              }.get(precision, [])
    result = train(tmp_path, 1, 1, 2, extra + [f"train.precision={precision}", "train.tf32=false"], env)
    assert_ran_on(result, "cuda", backend)
    assert [h["skipped_steps"] for h in result["history"]] == [0] * len(result["history"]), "a step overflowed"
    assert_same_training(result, cpu_reference(), tolerance("cuda", precision), f"dp2 zero{stage} {precision}")


@pytest.mark.parametrize("device_type", on_devices(3, fakegpu=False))
def test_pipeline_of_three_stages(cpu_reference, tmp_path, device_type):
    env, backend = DEVICES[device_type]
    result = train(tmp_path, 1, 3, 3, ["model.num_layers=3", "train.tf32=false"], env)
    assert_ran_on(result, device_type, backend)
    assert_same_training(result, cpu_reference("model.num_layers=3"), tolerance(device_type), f"{device_type} pp3")


@pytest.mark.parametrize("device_type", on_devices(1))
def test_resume_of_a_cpu_written_checkpoint(cpu_reference, tmp_path, device_type):
    """Two steps on the CPU, saved; the next three on the device; equal to five on the CPU."""
    env, backend = DEVICES[device_type]
    save = [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"checkpoint.load_dir={tmp_path / 'ckpt'}", "train.tf32=false"]
    first = train(tmp_path / "cpu", 1, 1, 1, save + ["resilience.exit_after_steps=2"], CPU_ENV)
    resumed = train(tmp_path / "device", 1, 1, 1, save, env)
    assert_ran_on(resumed, device_type, backend)
    reference = cpu_reference()
    assert len(first["history"]) == 2 and len(resumed["history"]) == 3
    combined = {"history": first["history"] + resumed["history"], "params_norm": resumed["params_norm"]}
    assert_same_training(combined, reference, tolerance(device_type), f"{device_type} resume")


def test_lamb_with_the_optimizer_offloaded_to_the_cpu(cpu_reference, tmp_path):
    """ZeRO-1 with the optimizer on the CPU: LAMB steps CPU tensors, and its norm sums must be
    reduced on the model's device (fakeccl, like NCCL, has no CPU backend)."""
    env, backend = DEVICES["fakegpu"]
    result = train(tmp_path, 1, 1, 2, ["parallel.zero_stage=1",
                                       "train.deepspeed_config=tests/zero-offload-optimizer.json"], env)
    where = result["device"]
    assert where["backend"] == backend and where["parameters"] == [where["device"]], where
    assert where["optimizer_tensors"] == ["cpu"], f"the optimizer was not offloaded: {where}"
    assert_same_training(result, cpu_reference(), tolerance("fakegpu"), "fakegpu dp2 zero1 offload")


@pytest.mark.parametrize("optimizer", ["lamb", "adamw"])
def test_host_reads_per_step(tmp_path, optimizer):
    """Metrics stay on the device until the log line, LAMB's trust ratios never leave it, the
    stop flag is agreed every few steps: over 20 steps with a log line every 10, the values read
    back from the device are those of the two log lines and four stop checks (f5ae60b: 9.75 per step),
    plus the non-finite guard's one agreed decision per step (resilience.skip_nonfinite_steps), the
    checkpoint series drawn at the start and the memory breakdown's one gather after the first step,
    and unpadding's one per micro-batch (the real tokens' count: the shape the layers compute, as
    the ModernBERT codebase's unpad_input reads it)."""
    out = tmp_path / "reads.json"
    run_ranks(["tests/_sync_worker.py", str(out), "20", f"optimizer.name={optimizer}"], 1, timeout=300,
              env=DEVICES["fakegpu"][0])
    result = json.loads(out.read_text())
    assert result["device"].startswith("fakegpu:")
    guard = sum(n for where, n in result["reads"].items() if "guard.py" in where)
    assert guard == 20, result["reads"]
    # once per run (all_gather_object, 2 reads each): the checkpoint series' id drawn by rank 0 at
    # the start, the first step's memory breakdown gathered from every rank
    once = sum(n for where, n in result["reads"].items() if "distributed_c10d.py" in where)
    assert once <= 4, result["reads"]
    unpadding = sum(n for where, n in result["reads"].items() if "unpadding.py" in where)
    assert unpadding == 20 * 4, result["reads"]  # 20 steps of 4 micro-batches
    total = sum(result["reads"].values()) - guard - once - unpadding
    assert total <= 8, f"{total / 20:.2f} host reads per step besides the guard's: {result['reads']}"


# ----------------------------------------------------------------------------- fine-tuning and tools
@pytest.mark.parametrize("device_type", on_devices(2))
def test_finetuning_tp2_keeps_the_best_weights(tiny, tmp_path, device_type):  # noqa: F811
    """TP2 with keep_best (the default): the best epoch's weights are gathered over TP at the
    end of epoch 1, on the device; the run equals the CPU's."""
    files = repeat_task(tmp_path, seed=5, train=128, dev=32)
    common = [*QUIET, f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]", "train.epochs=2",
              "train.lr=1e-3", "task.max_seq_length=12", "train.global_batch_size=32", "train.micro_batch_size=8",
              f"model.init_from={tiny / 'hf'}", "parallel.tensor_parallel=2", "train.tf32=false"]
    runs = {}
    for name, env in (("cpu", CPU_ENV), (device_type, DEVICES[device_type][0])):
        outputs = run_ranks(["-m", "finetune", "rte", *common, f"train.output_dir={tmp_path / name}"], 2,
                            timeout=600, env=env)
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
        assert (tmp_path / name / "best" / "config.json").exists()
    assert f"{device_type}:" in outputs[0].stdout, "the fine-tuning log names the device it ran on"
    assert runs[device_type]["train_losses"] == pytest.approx(runs["cpu"]["train_losses"], rel=tolerance(device_type))
    from safetensors.torch import load_file

    best = {name: load_file(tmp_path / name / "best" / "model.safetensors") for name in runs}
    assert best[device_type].keys() == best["cpu"].keys()
    for name, value in best["cpu"].items():
        torch.testing.assert_close(best[device_type][name], value, rtol=tolerance(device_type), atol=1e-5)


@pytest.mark.parametrize("device_type", on_devices(1))
def test_ner_fine_tuned_and_feature_based(tiny_ner, tmp_path, device_type):  # noqa: F811
    """Token classification on the device: the fine-tuning losses and the feature-based tagger's
    scores (features extracted on the device, the BiLSTM trained there) equal the CPU's. The
    tagger's dropout is off: a GPU draws its masks from Philox, the CPU from Mersenne Twister
    (fakegpu shares the CPU's generator, so only a real GPU would tell)."""
    files = synthetic_files(tmp_path, seed=8, train_docs=24, dev_docs=6)
    common = [*QUIET, f"model.init_from={tiny_ner}", f"task.train_file={files['train']}",
              f"task.dev_files=[{files['dev']}]", "task.max_seq_length=24", "task.doc_stride=8", "train.epochs=1",
              "train.lr=1e-3", "train.global_batch_size=16", "train.keep_best=false", "train.tf32=false",
              "features.layers=[-1,-2]", "features.lstm_hidden=16", "features.epochs=2", "features.batch_size=8",
              "features.dropout=0"]
    runs = {}
    for name, env in (("cpu", CPU_ENV), (device_type, DEVICES[device_type][0])):
        out = tmp_path / name
        tuned = run_ranks(["-m", "finetune", "conll2003", *common, f"train.output_dir={out}"], 1, timeout=600, env=env)
        tagged = run_ranks(["-m", "finetune", "conll2003", "--feature-based", *common, f"train.output_dir={out}"], 1,
                           timeout=600, env=env)
        runs[name] = (json.loads((out / "metrics.json").read_text()),
                      json.loads((out / "feature_based" / "metrics.json").read_text()))
    assert f"{device_type}:" in tuned[0].stdout and f"the tagger trains on {device_type}:" in tagged[0].stdout
    (tuned_dev, tagged_dev), (tuned_cpu, tagged_cpu) = runs[device_type], runs["cpu"]
    assert tuned_dev["train_losses"] == pytest.approx(tuned_cpu["train_losses"], rel=tolerance(device_type))
    for a, b in zip(tagged_dev["history"], tagged_cpu["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=tolerance(device_type) * 10)


@pytest.mark.parametrize("device_type", on_devices(2))
def test_fill_mask_tp2(models, device_type):  # noqa: F811
    outputs = run_ranks(["tools/fill_mask.py", "--checkpoint", str(models / "native-tp2"), "--tp", "2", "--json",
                         "--top-k", "10", *SENTENCES], 2, timeout=300, env=DEVICES[device_type][0])
    records = [json.loads(line) for line in outputs[0].stdout.splitlines() if line.startswith("{")]
    assert len(records) == len(SENTENCES)
    check_against_transformers(models, records, 10, ordered=10)


@pytest.mark.parametrize("device_type", on_devices(1))
def test_extract_features(tiny, tmp_path, device_type):  # noqa: F811
    lines = tmp_path / "lines.txt"
    lines.write_text("w1 w2 w3\nw4 w5 ||| w6 w7 w8\n")
    features = {}
    for name, env in (("cpu", CPU_ENV), (device_type, DEVICES[device_type][0])):
        out = tmp_path / f"{name}.jsonl"
        done = run_python(["tools/extract_features.py", "--checkpoint", str(tiny / "hf"), "--input-file", str(lines),
                           "--output-file", str(out), "--layers=-1,0", "--max-seq-length", "16"],
                          child_env({"PYTHONPATH": str(REPO)}, env), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        features[name] = [json.loads(line) for line in out.read_text().splitlines()]
    for ours, cpu in zip(features[device_type], features["cpu"]):
        for a, b in zip(ours["features"], cpu["features"]):
            assert a["token"] == b["token"]
            for la, lb in zip(a["layers"], b["layers"]):
                assert la["values"] == pytest.approx(lb["values"], abs=1e-5 if device_type == "fakegpu" else 1e-3)


# On the CPU test device the GPU kit's rehearsal covers this (tests/test_gpu_kit.py: tools/gpu/bench.py
# measures both sides through this benchmark's model and step functions, every run's parameters on
# fakegpu:0); on a GPU the benchmark's own command line runs here
@pytest.mark.parametrize("device_type", on_devices(1, fakegpu=False))
def test_bench_train_runs_both_sides_on_the_device(tmp_path, device_type):
    precisions = "fp32" if device_type == "fakegpu" else "fp32,bf16"  # fakegpu has no autocast kernels
    out = tmp_path / "bench.json"
    # the benchmark and its three children (the GEMM peak, ours, Hugging Face's) forked from the zygote
    # where `forkable` (the CPU test device); a fresh interpreter on the GPU
    done = run_python(["tools/benchmarks/train.py", "--configs", "mini", "--precisions", precisions,
                       "--batch", "2", "--seq", "32", "--steps", "1", "--warmup", "1", "--retries", "0",
                       "--threads", "1", "--json", str(out)], timeout=600, children_too=True,
                      env=child_env({"PYTHONPATH": str(REPO)}, DEVICES[device_type][0]))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        for side in ("ours", "hf"):
            assert row[side]["device"].startswith(f"{device_type}:"), (side, row[side]["device"])
            assert row[side]["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- the GPU tier's switch
def test_gpu_tests_skip_without_a_gpu_and_fail_when_one_is_required():
    if session_gpu_count():
        pytest.skip("the switch is about machines without a GPU")

    def pytest_run(env, select="extract_features and cuda"):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               "tests/test_devices.py", "-k", select], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, **env))

    # the three sessions side by side (each is one process, mostly importing)
    runs = side_by_side({"skipped": lambda: pytest_run({"REQUIRE_GPU": "0"}),
                         "failed": lambda: pytest_run({"REQUIRE_GPU": "1"}),
                         # a one-GPU machine (tools/gpu/check.sh): the tests needing more GPUs than promised skip, by name
                         "beyond": lambda: pytest_run({"REQUIRE_GPU": "1"}, "fill_mask_tp2 and cuda")})
    skipped, failed, beyond = runs["skipped"], runs["failed"], runs["beyond"]
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    assert "GPU test: needs 1 CUDA GPU(s), this machine has 0" in skipped.stdout
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout[-2000:]  # failed in set-up
    assert "needs 1 CUDA GPU(s), this machine has 0 (REQUIRE_GPU=1, CUDA absent): GPU tests fail rather than skip" \
        in failed.stdout
    assert beyond.returncode == 0 and "1 skipped" in beyond.stdout, beyond.stdout[-2000:]
    assert "needs 2 CUDA GPU(s), this machine has 0; REQUIRE_GPU=1 promises 1" in beyond.stdout
