"""GPU pretraining throughput on one device: our trainer against Hugging Face's BertForPreTraining
and ModernBertForMaskedLM on the same batches, with the planner's prediction beside every padded
BERT figure.

usage: python tools/gpu/bench.py [--models modernbert-base,large,base] [--seqs 128,512] [--batch 128:256,512:32]
                                 [--variants ours-zero1,hf,ours-packed,hf-sparse,ours-zero0,ours-adamw,ours-flex,
                                             ours-eager]
                                 [--precision bf16] [--steps 5] [--warmup 2] [--min-fraction 0.1]
                                 [--profile | --no-profile] [--budget-s 300] [--json OUT]

Models: BERT sizes (tiny ... large: configs/bert-<model>.yaml) and ModernBERT (modernbert-tiny,
-base, -large: configs/<model>.yaml). Without --seqs/--batch each family takes its peers'
shapes: BERT seq 128 x 256 and 512 x 32 (NVIDIA's), ModernBERT 1024 x 64 and 8192 x 8.

ModernBERT, per model and sequence length (AdamW at ZeRO-1 on every side, lr 1e-4, 30% masking as
its recipe, dropout as the config has it, model.compile and model.attention_kernel at their "auto"):
- ours-zero1: padded rows in, computed as real tokens only (the model unpads them);
- ours-packed: data.packing (the step's samples share rows);
- hf: transformers' ModernBertForMaskedLM with SDPA, fp32 weights under bf16 autocast, torch's fused
  AdamW, sparse_prediction false (its decoder over every token, as the published configs);
- hf-sparse: the same with sparse_prediction true (its decoder at the masked positions only, as ours);
- ours-flex (after every model's main runs): ours-packed with model.attention_kernel=flex, beside
  ours-packed's auto (varlen where torch has it): the measurement that picks the kernel;
- ours-eager (either family, only when --variants names it): ours-zero1 with model.compile=false,
  what the compiled element-wise kernels bring.
Beside the BERT figures each ModernBERT run reports the time to its first timed step (model
construction, compilation and the warmup steps), torch's compile counters (graphs compiled before
and during the timed steps: a recompilation shows as more graphs), step time min/median/max, and
(--profile, on by default) one more step under torch's profiler, its device time grouped into
matrix products, attention, element-wise, optimizer and copies.

BERT, per model and sequence length, one micro-batch per
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
n^3 torch.mm) and against the card's datasheet (dense bf16), peak device memory (torch's allocator),
each the median of --steps timed steps after --warmup. Model FLOPs are the real work
(pretrain/model/flops.py document_training_flops: each sample's tokens, attention within the sample,
the heads at the masked positions), the same count for every side whatever it computes. The
planner's prediction (pretrain/plan: step time from the measured GEMM peak and copy bandwidth at the
shares calibrated for the family, pretrain/plan/calibration.py; memory of the rank) stands beside
each padded run (the planner models padded rows, not packing). The summary ends with issue 50's
targets (TARGETS), each met, NOT MET or not run, also under "targets" in the JSON.

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

BERT_MODELS = ("tiny", "mini", "small", "medium", "base", "large")
MODERN_MODELS = ("modernbert-tiny", "modernbert-base", "modernbert-large")
MODELS = BERT_MODELS + MODERN_MODELS
VARIANTS = ("ours-zero1", "hf", "ours-packed", "hf-sparse", "ours-zero0", "ours-adamw", "ours-flex", "ours-eager")
# each family's runs in the order measured (the budget cuts from the end)
FAMILY_VARIANTS = {"bert": ("ours-zero1", "hf", "ours-packed", "ours-zero0", "ours-adamw"),
                   "modernbert": ("ours-packed", "ours-zero1", "hf", "hf-sparse", "ours-flex")}
ON_REQUEST = ("ours-eager",)  # runs of either family that only --variants asks for
LATER = ("ours-zero0", "ours-adamw", "ours-flex", "ours-eager")  # measured after every model's main runs
FAMILY_SHAPES = {"bert": "128:256,512:32", "modernbert": "1024:64,8192:8"}  # SEQ:BATCH
DEFAULT_MODELS = "modernbert-base,large,base"
MODERN_MASKING = 0.3  # ModernBERT's recipe (Warner et al. 2024): 30% of tokens predicted
# dense bf16 TFLOP/s of the datasheets (without sparsity), by a name the device's contains
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0,
                         "H100 NVL": 835.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
# NVIDIA DeepLearningExamples PyTorch BERT-large pretraining, A100 80 GB, AMP, LAMB: sequences/s per GPU
NVIDIA_DLE_A100_BERT_LARGE = {"128": 574, "512": 207}
NVIDIA_DLE_BATCH = {"128": 256, "512": 32}
MLPERF_V3_H100_PACKED = 970
ADAMW_LR = 1e-4  # BERT's AdamW learning rate (Devlin et al.)
SCHEMA = "bert-pretrain/gpu-bench/2"
GiB = 2**30


# ------------------------------------------------------------------------------------------- child

def synchronize(device) -> None:
    from pretrain.distributed.device import synchronize as device_synchronize

    device_synchronize(device)


def timed(fn, device, warmup: int, steps: int, on_warm=None) -> list[float]:
    """`warmup` untimed calls, then the durations of `steps` calls, each until the device is done;
    `on_warm()` is called between the two (when the device finished the warmup)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    if on_warm is not None:
        on_warm()
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


def family(model: str) -> str:
    return "modernbert" if model in MODERN_MODELS else "bert"


def config_path(model: str) -> Path:
    return REPO / "configs" / (f"{model}.yaml" if family(model) == "modernbert" else f"bert-{model}.yaml")


def run_config(job: dict, settings: dict):
    """Our Config of a run: one micro-batch per step, constant LR, nothing saved or evaluated."""
    from pretrain.config import load_config

    seq, batch = job["seq"], job["batch"]
    variant = job["variant"]
    modern = family(job["model"]) == "modernbert"
    adamw = modern or variant in ("ours-adamw", "hf")
    overrides = [
        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
        f"train.precision={settings['precision']}", f"train.train_steps={settings['warmup'] + settings['steps'] + 1}",
        "eval.interval=0", "checkpoint.save_interval=0", "checkpoint.save_dir=null", "checkpoint.load_dir=null",
        "logging.tensorboard_dir=null", "scheduler.warmup_steps=0", "scheduler.decay=constant",
        "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
        f"parallel.zero_stage={0 if variant == 'ours-zero0' else 1}",
        f"optimizer.name={'adamw' if adamw else 'lamb'}",
        f"data.seq_length={seq}", f"data.synthetic_min_fraction={settings['min_fraction']}",
        f"data.packing={'true' if variant in ('ours-packed', 'ours-flex') else 'false'}",
    ]
    if variant == "ours-flex":
        overrides.append("model.attention_kernel=flex")
    if variant == "ours-eager":
        overrides.append("model.compile=false")
    if modern:
        overrides += [f"data.masked_lm_prob={MODERN_MASKING}",
                      f"data.max_predictions_per_seq={-(-seq * int(MODERN_MASKING * 100) // 100)}",
                      f"model.max_position_embeddings={max(seq, 512)}"]
    else:  # Google BERT: 20 predictions at 128, 80 at 512 (~0.15 x seq, rounded up)
        overrides.append(f"data.max_predictions_per_seq={-(-seq * 15 // 100)}")
    if adamw:
        overrides.append(f"optimizer.lr={ADAMW_LR}")  # the BERT configs' LR is LAMB's, which diverges under AdamW
    if variant == "ours-zero0" and settings["precision"] == "bf16":
        overrides.append("train.grad_accum_dtype=bf16")  # fp32 accumulation needs ZeRO >= 1
    cfg = load_config(str(config_path(job["model"])), overrides)
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


def batch_work(batch) -> dict:
    """What a micro-batch holds to be computed: its samples' lengths (a padded row's real tokens, a
    packed row's runs of one sample id) and its masked tokens."""
    import torch

    inputs, labels = batch
    if len(inputs) == 6:  # packed rows: a sample is a run of one sample id
        ids = inputs[2].cpu()
        lengths = torch.bincount(ids.reshape(-1))[1:]
        lengths = lengths[lengths > 0]
    else:
        lengths = (inputs[2] != 0).sum(1).cpu()
    return {"lengths": [int(n) for n in lengths], "masked": int((labels[1] > 0).sum())}


def measure_ours(job: dict, settings: dict, parallel) -> dict:
    from pretrain.model.fused import compile_counters
    from pretrain.training.trainer import Trainer

    started = time.perf_counter()
    graphs_before = compile_counters()["unique_graphs"]
    cfg = run_config(job, settings)
    trainer = Trainer(cfg, parallel)
    count = settings["warmup"] + settings["steps"]
    drawn = draw_batches(cfg, count + 1, parallel.device, packed=cfg.data.packing)
    work = [batch_work(b) for b in drawn]
    batches = iter(drawn)
    metrics, graphs = [], []

    def step():
        metrics.append(trainer.train_step(batches))
        graphs.append(compile_counters()["unique_graphs"] - graphs_before)

    warm = []
    times = timed(step, parallel.device, settings["warmup"], settings["steps"],
                  on_warm=lambda: warm.append(time.perf_counter() - started))
    profile = profile_step(step, parallel.device) if settings["profile"] else None
    timed_metrics = metrics[settings["warmup"]:settings["warmup"] + settings["steps"]]
    where = str(next(trainer.model.parameters()).device)
    dtype = str(next(trainer.model.parameters()).dtype)
    trainer.close_loaders()
    del trainer
    return {"times": times, "losses": [m["loss"] for m in metrics],
            "real_tokens": [m["real_tokens"] for m in timed_metrics],
            "computed_tokens": [m["computed_tokens"] for m in timed_metrics],
            "work": work[settings["warmup"]:count], "first_timed_step_after_s": warm[0],
            "compiled_graphs_per_step": graphs, "profile": profile,
            "parameter_device": where, "parameter_dtype": dtype,
            "attention_kernel": attention_kernel_used(cfg, parallel.device, dtype)}, cfg


def attention_kernel_used(cfg, device, dtype: str) -> str:
    """What the model's attention ran on (attention.py): on CUDA without attention dropout the kernel
    model.attention_kernel resolves to, with dropout SDPA; elsewhere attention.py's paths."""
    import torch

    from pretrain.model.attention import cuda_kernel

    if device.type != "cuda":
        return f"attention.py's paths on {device.type}"
    if cfg.model.attention_dropout > 0:
        return "sdpa (attention dropout)"
    return cuda_kernel(cfg.model.attention_kernel, getattr(torch, dtype.removeprefix("torch.")))


def hf_optimizer(model, cfg, device):
    """torch's AdamW (fused on CUDA) with our config's hyperparameters and exclusions by kind."""
    import torch

    o = cfg.optimizer
    excluded = {"bias": lambda n: n.endswith("bias"),  # BERT's LayerNorm, ModernBERT's *norm modules
                "layernorm": lambda n: "LayerNorm" in n or n.split(".")[-2].endswith("norm")}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        kinds = {kind for kind, match in excluded.items() if match(name)}
        (no_decay if kinds & set(o.no_weight_decay) else decay).append(param)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=device.type == "cuda", foreach=None if device.type == "cuda" else False)


def hf_modern_model(cfg, sparse: bool):
    """transformers' ModernBertForMaskedLM (SDPA) with our config's shapes and dropout."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    m = cfg.model
    return ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
        max_position_embeddings=m.max_position_embeddings, global_attn_every_n_layers=m.global_attn_every_n_layers,
        local_attention=m.local_attention, global_rope_theta=m.global_rope_theta, local_rope_theta=m.local_rope_theta,
        norm_eps=m.layernorm_epsilon, embedding_dropout=m.hidden_dropout, mlp_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, sparse_prediction=sparse, pad_token_id=0,
        attn_implementation="sdpa"))


def hf_modern_batch(inputs, labels) -> dict:
    """Our padded (inputs, labels) micro-batch as ModernBertForMaskedLM's keyword arguments."""
    import torch

    input_ids, _types, padding_mask, masked_positions = inputs
    masked_labels, masked_weights, _ = labels
    mlm_labels = torch.full_like(input_ids, -100)
    rows, slots = torch.nonzero(masked_weights > 0, as_tuple=True)
    mlm_labels[rows, masked_positions[rows, slots]] = masked_labels[rows, slots]
    return dict(input_ids=input_ids, attention_mask=padding_mask, labels=mlm_labels)


def measure_hf(job: dict, settings: dict, parallel) -> dict:
    import torch

    from pretrain.model.fused import compile_counters
    from tools.benchmarks.train import hf_batch, hf_model, hf_step

    started = time.perf_counter()
    graphs_before = compile_counters()["unique_graphs"]
    cfg = run_config(job, settings)
    device = parallel.device
    torch.manual_seed(cfg.train.seed)
    modern = family(job["model"]) == "modernbert"
    model = (hf_modern_model(cfg, job["variant"] == "hf-sparse") if modern else hf_model(cfg)).to(device).train()
    optimizer = hf_optimizer(model, cfg, device)
    count = settings["warmup"] + settings["steps"]
    drawn = draw_batches(cfg, count + 1, device, packed=False)
    work = [batch_work(b) for b in drawn]
    real = [int(inputs[2].sum()) for inputs, _ in drawn]
    batches = iter([(hf_modern_batch if modern else hf_batch)(*b) for b in drawn])
    del drawn
    losses, graphs = [], []
    hf_one_step = hf_step(model, optimizer, batches, device, settings["precision"], cfg.optimizer.clip(), losses)

    def step():
        hf_one_step()
        graphs.append(compile_counters()["unique_graphs"] - graphs_before)

    warm = []
    times = timed(step, device, settings["warmup"], settings["steps"],
                  on_warm=lambda: warm.append(time.perf_counter() - started))
    profile = profile_step(step, device) if settings["profile"] else None
    where, dtype = str(next(model.parameters()).device), str(next(model.parameters()).dtype)
    del model, optimizer
    return {"times": times, "losses": [float(x) for x in losses], "real_tokens": real[settings["warmup"]:count],
            "computed_tokens": [job["batch"] * job["seq"]] * settings["steps"],
            "work": work[settings["warmup"]:count], "first_timed_step_after_s": warm[0],
            "compiled_graphs_per_step": graphs, "profile": profile,
            "parameter_device": where, "parameter_dtype": dtype,
            "attention_kernel": "transformers' sdpa"}, cfg


# What a profiled step's kernels are, by name (CUDA kernels; on the CPU test device, aten ops).
# The first group that matches takes a kernel; what none matches is "other".
PROFILE_GROUPS = (
    ("attention", r"flash|fmha|attention|flex|sdpa|_efficient_attention|varlen|softmax"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|xmma|s\d+gemm|aten::(mm|addmm|bmm|matmul|linear|baddbmm)$"),
    ("optimizer", r"multi_tensor|adam|lamb|foreach|_fused_"),
    ("copies", r"memcpy|memset|copy|cat_|catarray|aten::(copy_|cat|contiguous|clone|to|_to_copy|index_select|gather|scatter)"),
    ("element-wise", r"elementwise|vectorized|triton|layer_norm|layernorm|gelu|reduce|unrolled|aten::"),
)


def profile_step(step, device) -> dict:
    """One more step under torch's profiler: its device time (CUDA kernels) or, off CUDA, its
    operators' own CPU time, summed by PROFILE_GROUPS (milliseconds), with the top kernels."""
    import re

    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    groups = {name: 0.0 for name, _ in PROFILE_GROUPS} | {"other": 0.0}
    kernels = []
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)
            if getattr(event, "device_type", None) is not None and "CUDA" not in str(event.device_type):
                continue
        else:
            us = event.self_cpu_time_total
            if not event.key.startswith("aten::"):
                continue
        if us <= 0:
            continue
        name = event.key.lower()
        group = next((g for g, pattern in PROFILE_GROUPS if re.search(pattern, name)), "other")
        groups[group] += us / 1e3
        kernels.append((us / 1e3, group, event.key[:120]))
    kernels.sort(reverse=True)
    return {"kind": "device time" if cuda else "operators' own CPU time", "total_ms": sum(groups.values()),
            "groups_ms": groups, "top": [{"ms": ms, "group": g, "name": n} for ms, g, n in kernels[:15]]}


def plan_shares() -> dict:
    """The planner's shares of the measured ceilings, per model family (pretrain/plan/calibration.py)."""
    from pretrain.plan.calibration import CALIBRATIONS

    return {family: {"matrix_products": c.matrix_products, "elementwise": c.elementwise}
            for family, c in CALIBRATIONS.items()}


def planned(cfg, device_type: str, calibration: dict | None) -> dict:
    """The planner's step time and memory for this run on one device of the measured ceilings."""
    from pretrain.plan import predict_rank_memory
    from pretrain.plan.calibration import calibration_for, predict_step

    memory = predict_rank_memory(cfg, 1, 0, device_type)
    out = {"memory_gib": memory.total / GiB, "memory_breakdown_gib": {k: v / GiB for k, v in memory.breakdown().items()}}
    if calibration:  # the measured ceilings at the shares calibrated for the family
        step = predict_step(cfg, calibration, calibration_for(cfg.model.architecture), device_type)
        out.update(step_s=step.total, sequences_per_s=cfg.train.global_batch_size / step.total,
                   step_breakdown_s={"compute": step.compute, "optimizer": step.optimizer, "dp": step.dp})
    return out


def summarize(job: dict, raw: dict, cfg, calibration: dict | None) -> dict:
    from pretrain.model.flops import document_training_flops

    step = statistics.median(raw["times"])
    real = statistics.median(raw["real_tokens"])
    computed = statistics.median(raw["computed_tokens"])
    flops = statistics.median(document_training_flops(cfg.model, w["lengths"], w["masked"], cfg.model.vocab_size,
                                                      cfg.binary_head) for w in raw["work"])
    graphs = raw["compiled_graphs_per_step"]
    out = {"step_s": step, "min_step_s": min(raw["times"]), "max_step_s": max(raw["times"]),
           "sequences_per_s": job["batch"] / step, "real_tokens_per_s": real / step,
           "computed_tokens_per_s": computed / step, "real_token_share": real / computed,
           "model_tflops": flops / step / 1e12, "first_timed_step_after_s": raw["first_timed_step_after_s"],
           # torch's compile counters: graphs compiled by the end of each step (warmup steps included)
           "compiled_graphs_per_step": graphs,
           "recompiled_after_step_3": graphs[-1] - graphs[min(2, len(graphs) - 1)] if graphs else 0,
           "profile": raw["profile"],
           **{k: raw[k] for k in ("times", "losses", "parameter_device", "parameter_dtype")},
           **({"attention_kernel": raw["attention_kernel"]} if "attention_kernel" in raw else {})}
    if calibration:
        out["mfu"] = out["model_tflops"] / calibration["gemm_tflops"]
    return out


def datasheet_tflops(facts: dict) -> float | None:
    """The card's dense bf16 TFLOP/s from DATASHEET_BF16_TFLOPS, by its name (None: not listed)."""
    name = facts.get("name", "")
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS.items() if key in name), None)


def child_main(args) -> None:
    import gc

    import torch

    from pretrain.distributed.device import configure_math, device_memory_allocated, peak_memory_allocated, reset_peak_memory
    from pretrain.distributed.parallel import shutdown_parallel
    from tools.benchmarks.harness import one_rank_world

    plan = json.loads(Path(args.child).read_text())
    settings, calibration = plan["settings"], plan.get("calibration")
    parallel = one_rank_world()
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
            measure = measure_hf if job["variant"] in ("hf", "hf-sparse") else measure_ours
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
            # the planner models BERT's rows as full (every token real: compare its step time with a
            # run at --min-fraction 1); not packing, not ModernBERT
            prediction = None if job["variant"] in ("hf", "hf-sparse", "ours-packed") or cfg.model.modern \
                else planned(cfg, device.type, calibration)
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

def shapes(args, model: str) -> list[tuple[int, int]]:
    """(seq, batch) pairs of `model`: --batch's pairs (or its family's, FAMILY_SHAPES), those of
    --seqs when given."""
    pairs = dict(item.split(":") for item in (args.batch or FAMILY_SHAPES[family(model)]).split(",") if item)
    seqs = args.seqs.split(",") if args.seqs else list(pairs)
    return [(int(seq), int(pairs[seq])) for seq in seqs]


def variants(args, model: str) -> list[str]:
    """`model`'s runs in the order measured: --variants (those its family has, ON_REQUEST's too) or
    its family's."""
    if not args.variants:
        return list(FAMILY_VARIANTS[family(model)])
    own = FAMILY_VARIANTS[family(model)] + ON_REQUEST
    return [v for v in args.variants.split(",") if v in own]


def job_list(args) -> list[dict]:
    """Every run, in the order they are measured, so that the budget cuts what matters least: per
    model (in --models' order) and shape the family's main runs (ModernBERT: ours packed and padded,
    HF's two sides; BERT: the padded ours, HF's side, packed), then after all of those the LATER
    runs (BERT's ZeRO-0 and AdamW, ModernBERT's FlexAttention, ours-eager where asked for)."""
    jobs, later = [], []
    for model in args.models.split(","):
        for seq, batch in shapes(args, model):
            for variant in variants(args, model):
                job = {"id": f"{model}-s{seq}-{variant}", "model": model, "seq": seq, "batch": batch,
                       "variant": variant}
                (later if variant in LATER else jobs).append(job)
    return jobs + later


def validate(args, parser) -> None:
    for model in args.models.split(","):
        if model not in MODELS:
            parser.error(f"--models: unknown model {model!r}; choose from {', '.join(MODELS)}")
    for variant in (args.variants or "").split(","):
        if variant and variant not in VARIANTS:
            parser.error(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    for text in filter(None, (args.batch,)):
        try:
            pairs = dict(item.split(":") for item in text.split(",") if item)
            assert pairs and all(int(b) > 0 and int(s) > 0 for s, b in pairs.items())
        except (ValueError, AssertionError):
            parser.error(f"--batch {text!r}: give SEQ:BATCH pairs, e.g. 128:256,512:32")
    for model in args.models.split(","):
        pairs = (args.batch or FAMILY_SHAPES[family(model)]).split(",")
        known = {item.split(":")[0] for item in pairs if item}
        missing = [seq for seq in (args.seqs.split(",") if args.seqs else []) if seq not in known]
        if missing:
            parser.error(f"--seqs {args.seqs}: no batch for seq {', '.join(missing)} of {model} "
                         f"(its SEQ:BATCH pairs: {','.join(pairs)}; give them with --batch)")
        if not variants(args, model):
            parser.error(f"--variants {args.variants}: none of them is a run of {model} "
                         f"({', '.join(FAMILY_VARIANTS[family(model)])})")


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
    if "attention_kernel" in m:
        text += f", attention: {m['attention_kernel']}"
    text += (f", steps {1e3 * m['min_step_s']:.1f}-{1e3 * m['max_step_s']:.1f} ms, first timed step after "
             f"{m['first_timed_step_after_s']:.1f} s, graphs compiled {m['compiled_graphs_per_step']}")
    if m.get("profile"):
        groups = m["profile"]["groups_ms"]
        text += " | profile ms: " + ", ".join(f"{g} {ms:.1f}" for g, ms in groups.items() if ms > 0)
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
        row["compiled_over_eager"] = ratio(real("ours-zero1"), real("ours-eager"))  # model.compile's gain
        if family(model) == "modernbert":  # per real token: the issue's targets are stated so
            row["hf_over_ours_packed_real_tokens"] = ratio(real("hf"), real("ours-packed"))
            row["hf_sparse_over_ours_packed_real_tokens"] = ratio(real("hf-sparse"), real("ours-packed"))
            row["padded_over_packed_real_tokens"] = ratio(real("ours-zero1"), real("ours-packed"))
            # the kernel choice (model.attention_kernel): auto's (ours-packed) against FlexAttention
            row["auto_kernel_over_flex_real_tokens"] = ratio(real("ours-packed"), real("ours-flex"))
        if model == "large" and str(seq) in NVIDIA_DLE_A100_BERT_LARGE:
            anchor = NVIDIA_DLE_A100_BERT_LARGE[str(seq)]
            row["nvidia_dle_a100_sequences_per_s"] = anchor
            row["nvidia_dle_batch"] = NVIDIA_DLE_BATCH[str(seq)]
            row["ours_zero1_over_nvidia_a100"] = ratio(seqs("ours-zero1"), anchor)
        out.append(row)
    return out


def comparison_lines(table: list[dict], results: dict) -> list[str]:
    """The summary's lines of the comparisons: BERT-large against NVIDIA's figure, ModernBERT's sides
    per real token, the attention kernel's and compilation's ratios where their runs were measured."""
    lines = []
    shown = lambda v: f"{v:,.0f}" if v else "-"  # noqa: E731
    for row in table:
        if "nvidia_dle_a100_sequences_per_s" in row:
            ours, hf = row["sequences_per_s"]["ours-zero1"], row["sequences_per_s"]["hf"]
            lines.append(f"BERT-large seq {row['seq']} B{row['batch']}: ours {ours and round(ours, 1)} seq/s on this "
                         f"device, NVIDIA DLE {row['nvidia_dle_a100_sequences_per_s']} seq/s per A100 80 GB "
                         f"(batch {row['nvidia_dle_batch']}); HF {hf and round(hf, 1)}")
        if family(row["model"]) == "modernbert":
            real = row["real_tokens_per_s"]
            lines.append(f"{row['model']} seq {row['seq']} B{row['batch']} real tok/s: ours packed "
                         f"{shown(real['ours-packed'])}, ours padded {shown(real['ours-zero1'])}, transformers "
                         f"{shown(real['hf'])}, transformers sparse {shown(real['hf-sparse'])}")
        if row.get("auto_kernel_over_flex_real_tokens"):
            kernel = results[f"{row['model']}-s{row['seq']}-ours-packed"]["measured"].get("attention_kernel")
            lines.append(f"{row['model']} seq {row['seq']}: attention kernel auto ({kernel}) "
                         f"{row['auto_kernel_over_flex_real_tokens']:.2f}x FlexAttention's real tok/s "
                         "(ours-packed / ours-flex)")
        if row.get("compiled_over_eager"):
            lines.append(f"{row['model']} seq {row['seq']}: model.compile's kernels {row['compiled_over_eager']:.2f}x "
                         "the eager layers' real tok/s (ours-zero1 / ours-eager)")
    return lines


# Issue 50's targets on one H100/H200 (docs/performance.md): (name, run id, what is read, at least/most, bound)
TARGETS = (
    ("ModernBERT-base seq 1024 packed, real tok/s", "modernbert-base-s1024-ours-packed", "real_tokens_per_s",
     ">=", 400e3),
    ("ModernBERT-base seq 1024 padded / packed, real tok/s", "modernbert-base-s1024", "padded_over_packed",
     ">=", 0.9),
    ("ModernBERT-base seq 1024 transformers (sdpa) / ours packed", "modernbert-base-s1024", "hf_over_packed",
     "<=", 0.3),
    ("ModernBERT-base seq 8192 packed, real tok/s", "modernbert-base-s8192-ours-packed", "real_tokens_per_s",
     ">=", 250e3),
    ("ModernBERT-base seq 8192 packed, first timed step (s)", "modernbert-base-s8192-ours-packed",
     "first_timed_step_after_s", "<=", 60.0),
    ("ModernBERT-base seq 8192 packed, graphs compiled after step 3", "modernbert-base-s8192-ours-packed",
     "recompiled_after_step_3", "<=", 0),
    ("ModernBERT-base seq 8192 packed, slowest / fastest step", "modernbert-base-s8192-ours-packed", "step_spread",
     "<=", 1.10),
    ("BERT-large 128 x 256, LAMB ZeRO-1, seq/s", "large-s128-ours-zero1", "sequences_per_s", ">=", 1600.0),
    ("BERT-large 512 x 32, LAMB ZeRO-1, seq/s", "large-s512-ours-zero1", "sequences_per_s", ">=", 300.0),
    ("BERT-large 512 packed, real tok/s", "large-s512-ours-packed", "real_tokens_per_s", ">=", 160e3),
    ("BERT-large 128 x 256, LAMB step - AdamW step (ms)", "large-s128", "lamb_over_adamw_ms", "<=", 3.0),
    ("BERT-large 128 x 256, bf16 ZeRO-0 / ZeRO-1 step time", "large-s128", "zero0_over_zero1", "<=", 1.0),
)


def target_verdicts(results: dict) -> list[dict]:
    """Each of TARGETS with its measured value and whether it is met (None: its runs did not run)."""
    def measured(run_id):
        r = results.get(run_id, {})
        return r["measured"] if r.get("status") == "ok" else None

    def value(run, what):
        if what in ("padded_over_packed", "hf_over_packed"):
            padded, packed = measured(f"{run}-ours-zero1"), measured(f"{run}-ours-packed")
            hf = measured(f"{run}-hf")
            other = padded if what == "padded_over_packed" else hf
            return other["real_tokens_per_s"] / packed["real_tokens_per_s"] if other and packed else None
        if what in ("lamb_over_adamw_ms", "zero0_over_zero1"):
            lamb, adamw, zero0 = (measured(f"{run}-{v}") for v in ("ours-zero1", "ours-adamw", "ours-zero0"))
            if what == "lamb_over_adamw_ms":
                return 1e3 * (lamb["step_s"] - adamw["step_s"]) if lamb and adamw else None
            return zero0["step_s"] / lamb["step_s"] if zero0 and lamb else None
        m = measured(run)
        if m is None:
            return None
        return m["max_step_s"] / m["min_step_s"] if what == "step_spread" else m[what]

    out = []
    for name, run, what, sense, bound in TARGETS:
        got = value(run, what)
        met = None if got is None else (got >= bound if sense == ">=" else got <= bound)
        out.append({"target": f"{name} {sense} {bound:g}", "measured": got, "met": met})
    return out


def print_table(jobs, results, log) -> None:
    log(f"{'run':<36}{'status':<8}{'seq/s':>9}{'real tok/s':>12}{'MFU %':>7}{'peak GiB':>9}"
        f"{'plan ms':>9}{'meas ms':>9}{'max ms':>9}{'1st s':>7}{'graphs':>7}{'plan GiB':>9}")
    for job in jobs:
        r = results[job["id"]]
        if r["status"] != "ok":
            log(f"{job['id']:<36}{r['status']:<8}{r.get('error', '')}")
            continue
        m, p = r["measured"], r.get("planned") or {}
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        graphs = m["compiled_graphs_per_step"]
        log(f"{job['id']:<36}{'ok':<8}{m['sequences_per_s']:>9.1f}{m['real_tokens_per_s']:>12.0f}"
            f"{fmt(100 * m['mfu'] if 'mfu' in m else None, '>7.1f'):>7}{fmt(m.get('peak_memory_gib'), '>9.2f'):>9}"
            f"{fmt(1e3 * p['step_s'] if 'step_s' in p else None, '>9.1f'):>9}{1e3 * m['step_s']:>9.1f}"
            f"{1e3 * m['max_step_s']:>9.1f}{m['first_timed_step_after_s']:>7.1f}{graphs[-1] if graphs else 0:>7}"
            f"{fmt(p.get('memory_gib'), '>9.2f'):>9}")


def parent_main(args, parser) -> int:
    validate(args, parser)
    jobs = job_list(args)
    settings = {"precision": args.precision, "steps": args.steps, "warmup": args.warmup,
                "min_fraction": args.min_fraction, "profile": args.profile}
    started = time.monotonic()
    log = lambda text: print(text, flush=True)  # noqa: E731
    calibration, results, facts = run_children(jobs, settings, args.budget_s, log)
    log("")
    print_table(jobs, results, log)
    table = comparisons(jobs, results)
    for line in comparison_lines(table, results):
        log(line)
    spec = datasheet_tflops(facts)
    for result in results.values():
        if result.get("status") == "ok" and spec:
            result["measured"]["mfu_datasheet"] = result["measured"]["model_tflops"] / spec
    verdicts = target_verdicts(results)
    for v in verdicts:
        shown = "not run" if v["met"] is None else f"{v['measured']:,.3g}: {'met' if v['met'] else 'NOT MET'}"
        log(f"target {v['target']}: {shown}")
    counts = {status: sum(r["status"] == status for r in results.values()) for status in ("ok", "failed", "not run")}
    log(f"gpu bench: {counts['ok']} ok, {counts['failed']} failed, {counts['not run']} not run, "
        f"{time.monotonic() - started:.0f} s")
    if args.json:
        report = {"schema": SCHEMA, "device": {**facts, "datasheet_bf16_tflops": spec}, "calibration": calibration,
                  "settings": {
                      **settings, "batch": args.batch, "budget_s": args.budget_s, "plan_shares": plan_shares()},
                  "anchors": {"nvidia_dle_a100_80gb_bert_large_sequences_per_s": NVIDIA_DLE_A100_BERT_LARGE,
                              "nvidia_dle_batch": NVIDIA_DLE_BATCH,
                              "mlperf_v3_h100_packed_sequences_per_s": MLPERF_V3_H100_PACKED},
                  "runs": [{**job, **results[job["id"]]} for job in jobs], "comparisons": table, "targets": verdicts,
                  "elapsed_s": time.monotonic() - started}
        tmp = Path(f"{args.json}.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(args.json)
    return 0 if counts["ok"] and not counts["failed"] else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python tools/gpu/bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list of: {', '.join(MODELS)}")
    parser.add_argument("--seqs", default=None, help="sequence lengths among the SEQ:BATCH pairs (default all)")
    parser.add_argument("--batch", default=None,
                        help="SEQ:BATCH pairs for every model (default per family: BERT "
                             f"{FAMILY_SHAPES['bert']} (NVIDIA's), ModernBERT {FAMILY_SHAPES['modernbert']})")
    parser.add_argument("--variants", default=None,
                        help=f"comma list of: {', '.join(VARIANTS)} (default per family: BERT "
                             f"{','.join(FAMILY_VARIANTS['bert'])}; ModernBERT {','.join(FAMILY_VARIANTS['modernbert'])})")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="profile one more step of each run (default on)")
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
