"""GPU pretraining throughput on one device: our trainer against Hugging Face's BertForPreTraining
on the same batches, with the planner's prediction beside every measured figure.

usage: python tools/gpu/bench.py [--models large,base] [--seqs 128,512] [--batch 128:256,512:32]
                                 [--variants ours-zero1,hf,ours-packed,ours-zero0,ours-adamw]
                                 [--precision bf16] [--steps 5] [--warmup 2] [--min-fraction 0.1]
                                 [--budget-s 300] [--json OUT]

What is measured, per model (configs/bert-<model>.yaml) and sequence length, one micro-batch per
step (global = micro batch, no accumulation, constant LR, dropout as the config has it):
- ours-zero1: our Trainer's step (forward, loss, DeepSpeed backward and step: gradient clipping,
  the layout-exact LAMB, the one-collective metric reduction), bf16 = DeepSpeed's bf16 (bf16
  weights and activations, fp32 masters and gradient accumulation), ZeRO-1;
- ours-zero0: the same at ZeRO-0 (gradients accumulated in bf16: fp32 accumulation needs ZeRO >= 1);
- ours-packed: ours-zero1 with data.packing (the step's samples share rows, block-diagonal attention);
- ours-adamw: ours-zero1 with AdamW (the optimizer Hugging Face's side uses);
- hf: BertForPreTraining with SDPA attention, fp32 weights under bf16 autocast, torch's fused AdamW
  (same lr, betas, eps, weight decay and exclusions), gradient clipping to the same norm.
Every side steps the same samples: our synthetic pretraining data with lengths drawn uniformly
from --min-fraction x seq to seq (so the padded sides compute padding and the packed side does
not), drawn before timing. Figures: sequences/s, real (non-padding) tokens/s, computed tokens/s,
model FLOP/s as MFU against the bf16 GEMM peak measured on this device up front (the best
n^3 torch.mm), peak device memory (torch's allocator), each the median of --steps timed steps
after --warmup. The planner's prediction (pretrain/plan: step time from the measured GEMM peak x
its default efficiency and the measured copy bandwidth; memory of the rank) stands beside each
padded run (the planner models padded rows, not packing).

How it runs: one child process measures the runs in priority order (the largest model first, the
padded ours and Hugging Face's side before the rest), writing each result as it finishes; a run
that crashes its process is recorded with the end of its output and the next child goes on with
the rest; at --budget-s the child is stopped and the runs left are recorded as not run. The JSON
(--json) holds the device, the calibration, every run with its status, and NVIDIA's published
figures for BERT-large (DeepLearningExamples, A100 80 GB, AMP + LAMB: 574 sequences/s per GPU at
seq 128 with batch 256, 207 at seq 512 with batch 32). Under BERT_FAKE_GPU=1 (CI's rehearsal) it
runs on the CPU test device: use fp32 (fakegpu has no autocast) and tiny models.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tools.benchmarks.train (the HF model and batch helpers), configs/

MODELS = ("tiny", "mini", "small", "medium", "base", "large")
VARIANTS = ("ours-zero1", "hf", "ours-packed", "ours-zero0", "ours-adamw")
DEFAULT_VARIANTS = "ours-zero1,hf,ours-packed,ours-zero0,ours-adamw"
# NVIDIA DeepLearningExamples PyTorch BERT-large pretraining, A100 80 GB, AMP, LAMB: sequences/s per GPU
NVIDIA_DLE_A100_BERT_LARGE = {"128": 574, "512": 207}
NVIDIA_DLE_BATCH = {"128": 256, "512": 32}
MLPERF_V3_H100_PACKED = 970
ADAMW_LR = 1e-4  # BERT's AdamW learning rate (Devlin et al.)
PLAN_EFFICIENCY = 0.7  # tools/plan.py's default share of the GEMM peak
SCHEMA = "bert-pretrain/gpu-bench/1"
GiB = 2**30


# ------------------------------------------------------------------------------------------- child

def synchronize(device) -> None:
    from pretrain.distributed.device import synchronize as device_synchronize

    device_synchronize(device)


def timed(fn, device, warmup: int, steps: int) -> list[float]:
    """`warmup` untimed calls, then the durations of `steps` calls, each until the device is done."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def calibrate(device, precision: str) -> dict:
    """The device's ceilings: the best n^3 GEMM in the run's precision, and a device-to-device copy
    (bytes read + written per second)."""
    import torch

    big = device.type == "cuda"
    n = 8192 if big else 512
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    gemm = min(timed(lambda: torch.mm(a, b, out=out), device, warmup=3, steps=10))
    del a, b, out
    elements = (2**28 if big else 2**22)  # 1 GiB of fp32 on a GPU
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    copy = min(timed(lambda: dst.copy_(src), device, warmup=3, steps=10))
    del src, dst
    return {"gemm_n": n, "gemm_tflops": 2 * n**3 / gemm / 1e12, "precision": precision,
            "copy_gb_per_s": 2 * elements * 4 / copy / 1e9}


def run_config(job: dict, settings: dict):
    """Our Config of a run: one micro-batch per step, constant LR, nothing saved or evaluated."""
    from pretrain.config import load_config

    seq, batch = job["seq"], job["batch"]
    variant = job["variant"]
    overrides = [
        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
        f"train.precision={settings['precision']}", f"train.train_steps={settings['warmup'] + settings['steps']}",
        "eval.interval=0", "checkpoint.save_interval=0", "checkpoint.save_dir=null", "checkpoint.load_dir=null",
        "logging.tensorboard_dir=null", "scheduler.warmup_steps=0", "scheduler.decay=constant",
        "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
        f"parallel.zero_stage={0 if variant == 'ours-zero0' else 1}",
        f"optimizer.name={'adamw' if variant in ('ours-adamw', 'hf') else 'lamb'}",
        f"data.seq_length={seq}", f"data.synthetic_min_fraction={settings['min_fraction']}",
        f"data.packing={'true' if variant == 'ours-packed' else 'false'}",
        # Google BERT: 20 predictions at 128, 80 at 512 (~0.15 x seq, rounded up)
        f"data.max_predictions_per_seq={-(-seq * 15 // 100)}",
    ]
    if variant in ("ours-adamw", "hf"):
        overrides.append(f"optimizer.lr={ADAMW_LR}")  # the configs' LR is LAMB's, which diverges under AdamW
    if variant == "ours-zero0" and settings["precision"] == "bf16":
        overrides.append("train.grad_accum_dtype=bf16")  # fp32 accumulation needs ZeRO >= 1
    cfg = load_config(str(REPO / "configs" / f"bert-{job['model']}.yaml"), overrides)
    cfg.validate(world_size=1)
    return cfg


def draw_batches(cfg, count: int, device, packed: bool) -> list:
    """`count` micro-batches of our synthetic data on `device`, drawn before any timing."""
    from pretrain.data.samples.batches import MicroBatchIterator
    from pretrain.data.samples.synthetic import SyntheticDataset

    d = cfg.data
    dataset = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions(), d.num_samples,
                               d.seed, d.masked_lm_prob, d.synthetic_min_fraction)
    batches = MicroBatchIterator(dataset, 0, cfg.train.micro_batch_size, 0, 1, device, pack_group=int(packed))
    drawn = [next(batches) for _ in range(count)]
    batches.close()
    return drawn


def measure_ours(job: dict, settings: dict, parallel) -> dict:
    from pretrain.training.trainer import Trainer

    cfg = run_config(job, settings)
    trainer = Trainer(cfg, parallel)
    count = settings["warmup"] + settings["steps"]
    batches = iter(draw_batches(cfg, count, parallel.device, packed=cfg.data.packing))
    metrics = []
    times = timed(lambda: metrics.append(trainer.train_step(batches)), parallel.device, settings["warmup"],
                  settings["steps"])
    timed_metrics = metrics[settings["warmup"]:]
    where = str(next(trainer.model.parameters()).device)
    dtype = str(next(trainer.model.parameters()).dtype)
    trainer.close_loaders()
    del trainer
    return {"times": times, "losses": [m["loss"] for m in metrics],
            "real_tokens": [m["real_tokens"] for m in timed_metrics],
            "computed_tokens": [m["computed_tokens"] for m in timed_metrics],
            "parameter_device": where, "parameter_dtype": dtype}, cfg


def hf_optimizer(model, cfg, device):
    """torch's AdamW (fused on CUDA) with our config's hyperparameters and exclusions by kind."""
    import torch

    o = cfg.optimizer
    excluded = {"bias": lambda n: n.endswith("bias"), "layernorm": lambda n: "LayerNorm" in n}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        kinds = {kind for kind, match in excluded.items() if match(name)}
        (no_decay if kinds & set(o.no_weight_decay) else decay).append(param)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=device.type == "cuda", foreach=None if device.type == "cuda" else False)


def measure_hf(job: dict, settings: dict, parallel) -> dict:
    import torch

    from tools.benchmarks.train import hf_batch, hf_model, hf_step

    cfg = run_config(job, settings)
    device = parallel.device
    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg).to(device).train()
    optimizer = hf_optimizer(model, cfg, device)
    count = settings["warmup"] + settings["steps"]
    drawn = draw_batches(cfg, count, device, packed=False)
    real = [int(inputs[2].sum()) for inputs, _ in drawn]
    batches = iter([hf_batch(*b) for b in drawn])
    del drawn
    losses = []
    step = hf_step(model, optimizer, batches, device, settings["precision"], cfg.optimizer.clip(), losses)
    times = timed(step, device, settings["warmup"], settings["steps"])
    where, dtype = str(next(model.parameters()).device), str(next(model.parameters()).dtype)
    del model, optimizer
    return {"times": times, "losses": [float(x) for x in losses], "real_tokens": real[settings["warmup"]:],
            "computed_tokens": [job["batch"] * job["seq"]] * settings["steps"],
            "parameter_device": where, "parameter_dtype": dtype}, cfg


def planned(cfg, device_type: str, calibration: dict | None) -> dict:
    """The planner's step time and memory for this run on one device of the measured ceilings."""
    from pretrain.plan import predict_rank_memory
    from pretrain.plan.layouts import layout_of
    from pretrain.plan.shapes import stage_parameters
    from pretrain.plan.step_time import Hardware, predict_step_time

    memory = predict_rank_memory(cfg, 1, 0, device_type)
    out = {"memory_gib": memory.total / GiB, "memory_breakdown_gib": {k: v / GiB for k, v in memory.breakdown().items()}}
    if calibration:
        peak = calibration["gemm_tflops"] * 1e12 * PLAN_EFFICIENCY
        bandwidth = calibration["copy_gb_per_s"] * 1e9
        hw = Hardware(gpus_per_node=1, flops={cfg.train.precision: peak}, intra_node_bandwidth=bandwidth,
                      inter_node_bandwidth=bandwidth, memory_bandwidth=bandwidth)
        grad_bytes = 2 if cfg.train.precision != "fp32" and cfg.train.grad_accum_dtype != "fp32" else 4
        stages = [s.numel for s in stage_parameters(cfg, 1, 1)]
        step = predict_step_time(cfg, layout_of(cfg, 1), hw, stages, grad_bytes)
        out.update(step_s=step.total, sequences_per_s=cfg.train.global_batch_size / step.total,
                   step_breakdown_s={"compute": step.compute, "optimizer": step.optimizer, "dp": step.dp})
    return out


def summarize(job: dict, raw: dict, cfg, calibration: dict | None) -> dict:
    from pretrain.model.flops import encoder_flops_per_row, head_flops_per_sample

    step = statistics.median(raw["times"])
    real = statistics.median(raw["real_tokens"])
    computed = statistics.median(raw["computed_tokens"])
    rows = computed / job["seq"]
    flops = encoder_flops_per_row(cfg) * rows + head_flops_per_sample(cfg) * job["batch"]
    out = {"step_s": step, "min_step_s": min(raw["times"]), "sequences_per_s": job["batch"] / step,
           "real_tokens_per_s": real / step,
           "computed_tokens_per_s": computed / step, "real_token_share": real / computed,
           "model_tflops": flops / step / 1e12, **{k: raw[k] for k in ("times", "losses", "parameter_device",
                                                                       "parameter_dtype")}}
    if calibration:
        out["mfu"] = out["model_tflops"] / calibration["gemm_tflops"]
    return out


def child_main(args) -> None:
    import gc

    import torch

    from pretrain.distributed.device import configure_math, device_memory_allocated, peak_memory_allocated, reset_peak_memory
    from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
    from pretrain.observability.quiet import hide_library_warnings
    from tools.benchmarks.train import _free_port

    hide_library_warnings()
    plan = json.loads(Path(args.child).read_text())
    settings, calibration = plan["settings"], plan.get("calibration")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1)
    device = parallel.device
    configure_math(device, tf32=True)
    results = open(args.child_results, "a", buffering=1)

    def record(kind: str, **fields) -> None:
        results.write(json.dumps({"kind": kind, **fields}) + "\n")

    if calibration is None:
        calibration = calibrate(device, settings["precision"])
        record("calibration", **calibration, device=device_facts(device))
    for job in plan["jobs"]:
        record("started", id=job["id"])
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        reset_peak_memory(device)
        before = device_memory_allocated(device)
        allocator_before = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        started = time.perf_counter()
        try:
            measure = measure_hf if job["variant"] == "hf" else measure_ours
            raw, cfg = measure(job, settings, parallel)
        except torch.cuda.OutOfMemoryError as error:  # torch.OutOfMemoryError since 2.5
            record("result", id=job["id"], status="failed", error=f"out of memory: {str(error).splitlines()[0]}",
                   seconds=time.perf_counter() - started)
            continue
        measured = summarize(job, raw, cfg, calibration)
        if device.type == "cuda":  # the caching allocator's work during the run: new shapes cost device mallocs
            stats = torch.cuda.memory_stats(device)
            measured["allocator"] = {key: stats.get(key, 0) - allocator_before.get(key, 0)
                                     for key in ("num_device_alloc", "num_alloc_retries")}
        peak = peak_memory_allocated(device)
        if peak is not None:
            measured["peak_memory_gib"] = (peak - (before or 0)) / GiB
            measured["memory_before_gib"] = (before or 0) / GiB
        try:
            prediction = None if job["variant"] in ("hf", "ours-packed") else planned(cfg, device.type, calibration)
        except Exception as error:  # a planner bug must not lose the measurement: say it
            prediction = {"error": f"{type(error).__name__}: {error}"}
        record("result", id=job["id"], status="ok", measured=measured, planned=prediction,
               seconds=time.perf_counter() - started)
    shutdown_parallel()


def device_facts(device) -> dict:
    import torch

    facts = {"type": device.type, "torch": torch.__version__}
    for name in ("deepspeed", "transformers", "megatron.core"):
        try:
            facts[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as error:  # a version is a fact, not a requirement
            facts[name] = f"unknown ({type(error).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, capability=f"{props.major}.{props.minor}",
                     memory_gib=props.total_memory / GiB, multiprocessors=props.multi_processor_count,
                     cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return facts


# ------------------------------------------------------------------------------------------- parent

def job_list(args) -> list[dict]:
    """Every run, in the order they are measured: per (model, seq) the padded ours and HF's side,
    then packed; ZeRO-0 and AdamW after all of those (the budget cuts from the end)."""
    batches = dict(item.split(":") for item in args.batch.split(",") if item)
    variants = [v for v in args.variants.split(",") if v]
    first = [v for v in variants if v in ("ours-zero1", "hf", "ours-packed")]
    later = [v for v in variants if v not in first]
    jobs = []
    for group in (first, later):
        for model in args.models.split(","):
            for seq in args.seqs.split(","):
                for variant in group:
                    jobs.append({"id": f"{model}-s{seq}-{variant}", "model": model, "seq": int(seq),
                                 "batch": int(batches[seq]), "variant": variant})
    return jobs


def validate(args, parser) -> None:
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"--models: unknown model {model!r}; choose from {', '.join(MODELS)}")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    try:
        batches = dict(item.split(":") for item in args.batch.split(",") if item)
        assert all(int(b) > 0 for b in batches.values())
    except (ValueError, AssertionError):
        parser.error(f"--batch {args.batch!r}: give SEQ:BATCH pairs, e.g. 128:256,512:32")
    missing = [s for s in args.seqs.split(",") if s not in batches]
    if missing:
        parser.error(f"--batch {args.batch!r} has no batch for seq {', '.join(missing)}")


def run_children(jobs: list[dict], settings: dict, budget_s: float, log) -> tuple[dict | None, dict, dict]:
    """Measure `jobs` in child processes until done or the budget is spent; (calibration, the
    results by job id, the device facts)."""
    deadline = time.monotonic() + budget_s
    calibration, facts, results = None, {}, {}
    remaining = list(jobs)
    with tempfile.TemporaryDirectory() as tmp:
        while remaining and time.monotonic() < deadline - 5:
            plan_file, results_file, output_file = (Path(tmp) / name for name in ("plan.json", "results.jsonl",
                                                                                  "output.log"))
            plan_file.write_text(json.dumps({"settings": settings, "calibration": calibration, "jobs": remaining}))
            results_file.write_text("")
            env = dict(os.environ, PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
            with open(output_file, "w") as output:
                proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(plan_file),
                                         "--child-results", str(results_file)], env=env, stdout=output,
                                        stderr=subprocess.STDOUT)
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                    stopped = False
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    stopped = True
            started = None
            for line in results_file.read_text().splitlines():
                record = json.loads(line)
                if record["kind"] == "calibration":
                    facts = record.pop("device")
                    calibration = {k: v for k, v in record.items() if k != "kind"}
                    log(f"calibration on {facts.get('name', facts['type'])}: {calibration['precision']} GEMM "
                        f"{calibration['gemm_tflops']:.1f} TFLOP/s (n={calibration['gemm_n']}), "
                        f"copy {calibration['copy_gb_per_s']:.0f} GB/s")
                elif record["kind"] == "started":
                    started = record["id"]
                else:
                    record.pop("kind")
                    results[record["id"]] = record
                    started = None
                    log(describe(next(j for j in jobs if j["id"] == record["id"]), record))
            if started is not None:
                tail = output_file.read_text()[-3000:]
                why = ("stopped: the benchmark's time budget ran out during this run" if stopped
                       else f"the measuring process died (exit {proc.returncode}) during this run")
                results[started] = {"id": started, "status": "failed", "error": why, "output_tail": tail}
                log(f"{started}: FAILED: {why}\n{tail[-1500:]}")
            elif proc.returncode not in (0, None) and not stopped:
                tail = output_file.read_text()[-3000:]
                log(f"the measuring process failed before its first run (exit {proc.returncode}):\n{tail[-2000:]}")
                for job in remaining:
                    results[job["id"]] = {"id": job["id"], "status": "failed", "output_tail": tail,
                                          "error": f"the measuring process failed before this run (exit {proc.returncode})"}
                break
            remaining = [j for j in remaining if j["id"] not in results]
    for job in remaining:
        results[job["id"]] = {"id": job["id"], "status": "not run",
                              "error": f"the benchmark's time budget ({budget_s:.0f} s) was spent before this run"}
    return calibration, results, facts


def describe(job: dict, record: dict) -> str:
    if record["status"] != "ok":
        return f"{job['id']}: {record['status'].upper()}: {record.get('error')}"
    m, p = record["measured"], record.get("planned") or {}
    text = (f"{job['id']}: B{job['batch']} {m['sequences_per_s']:.1f} seq/s, {m['real_tokens_per_s']:.0f} real tok/s "
            f"({100 * m['real_token_share']:.0f}% real), step {1e3 * m['step_s']:.1f} ms")
    if "mfu" in m:
        text += f", MFU {100 * m['mfu']:.1f}%"
    if "peak_memory_gib" in m:
        text += f", peak {m['peak_memory_gib']:.2f} GiB"
    if "step_s" in p:
        text += f" | planned step {1e3 * p['step_s']:.1f} ms ({p['step_s'] / m['step_s']:.2f}x measured)"
    if "memory_gib" in p:
        text += f", planned memory {p['memory_gib']:.2f} GiB"
    return text


def comparisons(jobs: list[dict], results: dict) -> list[dict]:
    """Per model and seq: ours against HF's side, packed against padded, and NVIDIA's figure."""
    out = []
    keys = sorted({(j["model"], j["seq"], j["batch"]) for j in jobs}, key=lambda k: (MODELS.index(k[0]), k[1]))
    for model, seq, batch in reversed(keys):
        def seqs(variant):
            r = results.get(f"{model}-s{seq}-{variant}", {})
            return r["measured"]["sequences_per_s"] if r.get("status") == "ok" else None

        def real(variant):
            r = results.get(f"{model}-s{seq}-{variant}", {})
            return r["measured"]["real_tokens_per_s"] if r.get("status") == "ok" else None

        row = {"model": model, "seq": seq, "batch": batch,
               "sequences_per_s": {v: seqs(v) for v in VARIANTS}, "real_tokens_per_s": {v: real(v) for v in VARIANTS}}
        ratio = lambda a, b: a / b if a and b else None  # noqa: E731
        row["ours_zero1_over_hf"] = ratio(seqs("ours-zero1"), seqs("hf"))
        row["ours_adamw_over_hf"] = ratio(seqs("ours-adamw"), seqs("hf"))
        row["packed_over_padded_real_tokens"] = ratio(real("ours-packed"), real("ours-zero1"))
        if model == "large" and str(seq) in NVIDIA_DLE_A100_BERT_LARGE:
            anchor = NVIDIA_DLE_A100_BERT_LARGE[str(seq)]
            row["nvidia_dle_a100_sequences_per_s"] = anchor
            row["nvidia_dle_batch"] = NVIDIA_DLE_BATCH[str(seq)]
            row["ours_zero1_over_nvidia_a100"] = ratio(seqs("ours-zero1"), anchor)
        out.append(row)
    return out


def print_table(jobs, results, log) -> None:
    log(f"{'run':<28}{'status':<8}{'seq/s':>9}{'real tok/s':>12}{'MFU %':>7}{'peak GiB':>9}"
        f"{'plan ms':>9}{'meas ms':>9}{'plan GiB':>9}")
    for job in jobs:
        r = results[job["id"]]
        if r["status"] != "ok":
            log(f"{job['id']:<28}{r['status']:<8}{r.get('error', '')}")
            continue
        m, p = r["measured"], r.get("planned") or {}
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        log(f"{job['id']:<28}{'ok':<8}{m['sequences_per_s']:>9.1f}{m['real_tokens_per_s']:>12.0f}"
            f"{fmt(100 * m['mfu'] if 'mfu' in m else None, '>7.1f'):>7}{fmt(m.get('peak_memory_gib'), '>9.2f'):>9}"
            f"{fmt(1e3 * p['step_s'] if 'step_s' in p else None, '>9.1f'):>9}{1e3 * m['step_s']:>9.1f}"
            f"{fmt(p.get('memory_gib'), '>9.2f'):>9}")


def parent_main(args, parser) -> int:
    validate(args, parser)
    jobs = job_list(args)
    settings = {"precision": args.precision, "steps": args.steps, "warmup": args.warmup,
                "min_fraction": args.min_fraction}
    started = time.monotonic()
    log = lambda text: print(text, flush=True)  # noqa: E731
    calibration, results, facts = run_children(jobs, settings, args.budget_s, log)
    log("")
    print_table(jobs, results, log)
    table = comparisons(jobs, results)
    for row in table:
        if "nvidia_dle_a100_sequences_per_s" in row:
            ours = row["sequences_per_s"]["ours-zero1"]
            log(f"BERT-large seq {row['seq']} B{row['batch']}: ours {ours and round(ours, 1)} seq/s on this device, "
                f"NVIDIA DLE {row['nvidia_dle_a100_sequences_per_s']} seq/s per A100 80 GB "
                f"(batch {row['nvidia_dle_batch']}); HF {row['sequences_per_s']['hf'] and round(row['sequences_per_s']['hf'], 1)}")
    counts = {status: sum(r["status"] == status for r in results.values()) for status in ("ok", "failed", "not run")}
    log(f"gpu bench: {counts['ok']} ok, {counts['failed']} failed, {counts['not run']} not run, "
        f"{time.monotonic() - started:.0f} s")
    if args.json:
        report = {"schema": SCHEMA, "device": facts, "calibration": calibration, "settings": {
                      **settings, "batch": args.batch, "budget_s": args.budget_s, "plan_efficiency": PLAN_EFFICIENCY},
                  "anchors": {"nvidia_dle_a100_80gb_bert_large_sequences_per_s": NVIDIA_DLE_A100_BERT_LARGE,
                              "nvidia_dle_batch": NVIDIA_DLE_BATCH,
                              "mlperf_v3_h100_packed_sequences_per_s": MLPERF_V3_H100_PACKED},
                  "runs": [{**job, **results[job["id"]]} for job in jobs], "comparisons": table,
                  "elapsed_s": time.monotonic() - started}
        tmp = Path(f"{args.json}.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.json)
    return 0 if counts["ok"] and not counts["failed"] else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python tools/gpu/bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="large,base", help=f"comma list of: {', '.join(MODELS)}")
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--batch", default="128:256,512:32", help="SEQ:BATCH pairs (default NVIDIA's: 128:256,512:32)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of: {', '.join(VARIANTS)}")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--min-fraction", type=float, default=0.1,
                        help="sample lengths uniform in [this x seq, seq] (default 0.1)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop and report after this many seconds")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-results", help=argparse.SUPPRESS)
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    return parent_main(args, parser)


if __name__ == "__main__":
    sys.exit(main())
