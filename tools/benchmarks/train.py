"""Training-step benchmark: our engine against Hugging Face BertForPreTraining, single process.

usage: python tools/benchmarks/train.py [--configs base,mini] [--precisions fp32,bf16] [--batch B]
                                   [--seq 128] [--steps N] [--warmup W] [--optimizer adamw|lamb]
                                   [--threads 2] [--json out.json] [--retries 2]

Method
------
Every measurement runs in a fresh child process (this script re-invoked with ``--child``), one
after the other, never side by side, so peak RSS and allocator state do not leak from one side
into the other and the two sides never compete for the cores. Per invocation:

1. GEMM peak: the best of a few 2048^3 ``torch.mm`` calls (2 n^3 FLOPs each; for bf16 the faster
   of torch's bf16 kernel and our bf16 route, see ``gemm_peak``) with the benchmark's thread
   count, up front in each precision asked for, and again in each measuring child for its own precision
   right before and right after its steps (the better of the two): MFU of a side is against that
   side's own peak (the clock of a shared or virtual CPU drifts; peaks from 225 to 329 GFLOP/s
   fp32 were seen on one machine within an hour).
2. For each config (base: configs/bert-base.yaml, B8; mini: configs/bert-mini.yaml, B16) and
   precision, ours then Hugging Face's:
   - ours: a one-rank gloo world (127.0.0.1, a free port), ``init_parallel(launch, 1, 1)``, the config
     from ``load_config`` with batch/precision/optimizer overrides (global = micro batch, no
     gradient accumulation, constant LR; ZeRO-0 for fp32, ZeRO-1 for bf16, the stage bf16's
     default fp32 gradient accumulation needs), ``Trainer(cfg, parallel)``, timing
     ``trainer.train_step(batches)``: forward, loss, DeepSpeed backward and step (gradient
     clipping, optimizer), metric reduction. bf16 is DeepSpeed's: bf16 parameters and
     activations, fp32 master weights, gradients and optimizer state.
   - Hugging Face: ``BertForPreTraining`` with SDPA attention, the same sizes and dropout, fed
     the SAME batches (input_ids, token_type_ids, attention_mask = padding mask, labels = -100
     except at masked positions, next_sentence_label), the optimizer our Trainer builds
     (``pretrain.optim.build_optimizer``: the same AdamW or Lamb implementation) with the same lr,
     betas, eps and weight-decay exclusions (bias, LayerNorm), gradient-norm clipping to the
     same max norm (what HF's Trainer does by default). bf16 is HF's standard CPU path:
     fp32 parameters under ``torch.autocast("cpu", torch.bfloat16)``.
   Both sides draw their batches from our SyntheticDataset before timing starts (so data
   generation is not timed on either side), run --warmup untimed steps, then --steps timed
   steps; the reported step time is the median. Each row also reports "other load": the cores
   other processes used meanwhile (from /proc/stat); a side measured beside other load is measured
   again (--retries), and the table warns about any that never ran on a quiet machine.

FLOPs and MFU
-------------
FLOPs per sample are ``pretrain.model.flops.model_flops_per_sample``: matrix-product FLOPs the
model needs (2 per multiply-add), training = 3 x forward (backward = 2 x forward), the MLM
transform and vocabulary projection counted only at the masked positions (max_predictions_per_seq),
attention scores/context included, element-wise work and activation recomputation not counted.
Hugging Face's MFU uses the SAME count: it is the useful work of a step; HF's extra work (it
projects every position onto the vocabulary) is overhead, not credit.
MFU = flops_per_sample x batch / median step time / GEMM peak of that precision measured by the
same child process around its steps.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tools.benchmarks.harness
from tools.benchmarks.harness import one_rank_world, write_json  # noqa: E402
CONFIGS = {"base": (REPO / "configs" / "bert-base.yaml", 8), "mini": (REPO / "configs" / "bert-mini.yaml", 16)}
PRECISIONS = ("fp32", "bf16")
FLOPS_NOTE = ("FLOPs: pretrain.model.flops.model_flops_per_sample (matmul FLOPs the model needs, fwd+bwd = 3 x fwd, "
              "MLM decoder only at masked positions); the same count for both sides. MFU against the GEMM peak "
              "of the run's precision (best 2048^3 torch.mm, same threads, same process, before and after the steps).")


# ------------------------------------------------------------------------------------------- common


def bench_device():
    """Where both sides run: the GPU when there is one (cuda:0), fakegpu in the CPU test mode
    (BERT_FAKE_GPU=1), else the CPU; `pretrain.distributed.device` decides, as for training."""
    from pretrain.distributed.device import select_device

    return select_device(0)


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a step's time is its own."""
    import torch

    torch.get_device_module(device.type).synchronize()


def bench_config(name: str, batch: int, seq: int, precision: str, optimizer: str, steps: int):
    """Our Config for a benchmark run: one step = one micro-batch of `batch`, constant LR, ZeRO-0
    (bf16: ZeRO-1, where DeepSpeed sums bf16 gradients in fp32, the trainer's default)."""
    from pretrain.config import load_config

    path, _ = CONFIGS[name]
    overrides = [
        f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.precision={precision}",
        f"train.train_steps={steps}", "eval.interval=0", "checkpoint.save_interval=0",
        "checkpoint.save_dir=null", "checkpoint.load_dir=null", "logging.tensorboard_dir=null",
        f"optimizer.name={optimizer}", "scheduler.warmup_steps=0", "scheduler.decay=constant",
        "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
        f"parallel.zero_stage={1 if precision == 'bf16' else 0}",
        f"data.seq_length={seq}",
    ]
    if seq != 128:  # Google BERT: 20 predictions at 128, 80 at 512 (~0.15 x seq, rounded up)
        overrides.append(f"data.max_predictions_per_seq={-(-seq * 15 // 100)}")
    cfg = load_config(str(path), overrides)
    cfg.validate(world_size=1)
    return cfg


def make_batches(cfg, count: int, device):
    """`count` micro-batches (inputs, labels) of our synthetic data on `device`, drawn before any timing."""
    from pretrain.data.samples.batches import MicroBatchIterator
    from pretrain.data.samples.synthetic import SyntheticDataset

    d = cfg.data
    dataset = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions(), d.num_samples,
                               d.seed, d.masked_lm_prob)
    batches = MicroBatchIterator(dataset, 0, cfg.train.micro_batch_size, 0, 1, device)
    return [next(batches) for _ in range(count)]


def real_token_share(batches) -> float:
    """Real (non-padding) tokens / batch x seq of the micro-batches `batches` (the padding mask is
    the third input)."""
    return sum(int(inputs[2].sum()) for inputs, _ in batches) / sum(inputs[2].numel() for inputs, _ in batches)


def time_steps(step, warmup: int, steps: int, device=None) -> list[float]:
    """Run `warmup` untimed then `steps` timed calls of step(); the timed durations in seconds
    (each ending when the device finished the step's work)."""
    wait = (lambda: synchronize(device)) if device is not None else (lambda: None)
    for _ in range(warmup):
        step()
    wait()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        wait()
        times.append(time.perf_counter() - started)
    return times


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- children


def gemm_peak(precision: str, device, n: int = 2048) -> float:
    """Best-of-6 n^3 GEMM throughput (GFLOP/s) on `device`, with this process's thread count.

    bf16: the faster of torch's bf16 ``torch.mm`` and our bf16 GEMM route
    (``pretrain.model.layers.linear``, which on CPUs where it is faster multiplies the exactly
    upcast operands in fp32 and rounds the result to bf16): the fastest bf16 GEMM this machine
    offers, casts included, so bf16 MFU never counts a slow emulated kernel as the ceiling. On a
    GPU both are cuBLAS's bf16 GEMM (and fp32 is its fp32 GEMM: TF32 as the run configures it).
    """
    import torch

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype, device=device)
    candidates = [lambda: torch.mm(a, b, out=out)]
    if precision == "bf16":
        from pretrain.model.layers import linear

        candidates.append(lambda: linear(a, b))
    return max(2 * n**3 / min(time_steps(fn, warmup=2, steps=6, device=device)) / 1e9 for fn in candidates)


def child_peak(args) -> dict:
    from pretrain.config import TrainConfig
    from pretrain.distributed.device import configure_math

    device = bench_device()
    configure_math(device, TrainConfig().tf32)  # the fp32 GEMMs our trainer runs (TF32 on a GPU)
    # only the precisions asked for: a CPU without bf16 kernels takes minutes over one bf16 peak
    return {"peak_gflops": {precision: gemm_peak(precision, device) for precision in args.precisions.split(",")},
            "device": str(device)}




def child_ours(args) -> dict:
    """Our Trainer's real step under a one-process gloo world."""
    import logging

    parallel = one_rank_world()
    from deepspeed.utils import logger as ds_logger

    from pretrain.distributed.device import configure_math
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.model.flops import model_flops_per_sample
    from pretrain.training.trainer import Trainer

    ds_logger.setLevel(logging.WARNING)
    cfg = bench_config(args.config, args.batch, args.seq, args.precision, args.optimizer, args.warmup + args.steps)
    device = parallel.device
    configure_math(device, cfg.train.tf32)  # as the Trainer below does, before the peak is measured
    peak = gemm_peak(args.precision, device)
    trainer = Trainer(cfg, parallel)
    drawn = make_batches(cfg, args.warmup + args.steps, device)
    batches = iter(drawn)
    losses = []
    times = time_steps(lambda: losses.append(trainer.train_step(batches)["loss"]), args.warmup, args.steps, device)
    param_device = str(next(trainer.model.parameters()).device)
    shutdown_parallel()
    peak = max(peak, gemm_peak(args.precision, device))  # a peak: the better of before and after the steps
    return {"times": times, "losses": losses, "flops_per_sample": model_flops_per_sample(cfg), "peak_gflops": peak,
            "real_token_share": real_token_share(drawn),
            "device": param_device, **device_memory(device)}


def hf_model(cfg):
    """BertForPreTraining (SDPA) with the sizes and dropout of our config."""
    from transformers import BertConfig, BertForPreTraining

    m = cfg.model
    hf_cfg = BertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size, hidden_act="gelu",
        hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
        layer_norm_eps=m.layernorm_epsilon, initializer_range=m.init_std,
    )
    return BertForPreTraining._from_config(hf_cfg, attn_implementation="sdpa")


def hf_optimizer(model, cfg):
    """The optimizer our Trainer builds, over HF's parameters with the same exclusions by kind."""
    from pretrain.optim import build_optimizer

    o = cfg.optimizer
    excluded = {"bias": lambda n: n.endswith("bias"), "layernorm": lambda n: "LayerNorm" in n}
    groups: dict[tuple[bool, bool], list] = {}
    for name, param in model.named_parameters():
        kinds = {kind for kind, match in excluded.items() if match(name)}
        key = (not kinds & set(o.no_weight_decay), not kinds & set(o.no_layer_adaptation))
        groups.setdefault(key, []).append(param)
    param_groups = [{"params": p, "weight_decay": o.weight_decay if decay else 0.0, "layer_adaptation": adapt}
                    for (decay, adapt), p in groups.items()]
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "lamb":
        hyper["max_trust_ratio"] = o.max_trust_ratio
    return build_optimizer(o.name, param_groups, **hyper)


def hf_batch(inputs, labels) -> dict:
    """Our (inputs, labels) micro-batch as BertForPreTraining's keyword arguments."""
    import torch

    input_ids, token_type_ids, padding_mask, masked_positions = inputs
    masked_labels, masked_weights, nsp_label = labels
    mlm_labels = torch.full_like(input_ids, -100)
    rows, slots = torch.nonzero(masked_weights > 0, as_tuple=True)  # unused slots point at position 0
    mlm_labels[rows, masked_positions[rows, slots]] = masked_labels[rows, slots]
    return dict(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=padding_mask,
                labels=mlm_labels, next_sentence_label=nsp_label)


def child_hf(args) -> dict:
    """Hugging Face BertForPreTraining train step: forward+loss, backward, clip, optimizer step."""
    import torch

    from pretrain.distributed.device import configure_math
    from pretrain.model.flops import model_flops_per_sample

    device = bench_device()
    cfg = bench_config(args.config, args.batch, args.seq, args.precision, args.optimizer, args.warmup + args.steps)
    configure_math(device, cfg.train.tf32)  # the same fp32 matmul precision as our side (TF32 on a GPU)
    peak = gemm_peak(args.precision, device)
    torch.manual_seed(cfg.train.seed)
    model = hf_model(cfg).to(device).train()
    optimizer = hf_optimizer(model, cfg)
    drawn = make_batches(cfg, args.warmup + args.steps, device)
    batches = iter([hf_batch(*b) for b in drawn])
    losses = []
    step = hf_step(model, optimizer, batches, device, args.precision, cfg.optimizer.clip(), losses)
    times = time_steps(step, args.warmup, args.steps, device)
    peak = max(peak, gemm_peak(args.precision, device))  # a peak: the better of before and after the steps
    return {"times": times, "losses": [float(loss) for loss in losses], "flops_per_sample": model_flops_per_sample(cfg),
            "peak_gflops": peak, "real_token_share": real_token_share(drawn),
            "device": str(next(model.parameters()).device), **device_memory(device)}


def hf_step(model, optimizer, batches, device, precision: str, grad_clip: float, losses: list):
    """A function that runs one Hugging Face training step per call on the next of `batches`:
    forward and loss under HF's standard mixed precision on the device it runs on (fp32 weights,
    bf16 autocast), backward, gradient-norm clipping, the optimizer step; each loss is appended
    to `losses` as a device tensor (read after the timing)."""
    import contextlib

    import torch

    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16" \
        else contextlib.nullcontext

    def step():
        with autocast():
            loss = model(**next(batches)).loss
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return step


def device_memory(device) -> dict:
    """Peak device memory of the process (GPU only; on the CPU the RSS column says it)."""
    import torch

    return {"peak_device_mb": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else {}


CHILDREN = {"peak": child_peak, "ours": child_ours, "hf": child_hf}


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(kind: str, args, **extra) -> dict:
    """Run one measurement in a fresh interpreter; its result comes back through a JSON file.

    Also records `other_load`: the cores other processes kept busy meanwhile (machine CPU time
    minus the child's own, over the wall time). Anything well above 0 means the figures are off.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-out", str(out),
               "--threads", str(args.threads), "--seq", str(args.seq), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--optimizer", args.optimizer]
        for key, value in extra.items():
            cmd += [f"--{key}", str(value)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        busy, own, started = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - started
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-5000:])
            raise SystemExit(f"bench_train: child {kind} {extra} failed (exit {proc.returncode})")
        result = json.loads(out.read_text())
        if busy is not None:
            foreign = (_busy_cpu_seconds() - busy) - (_children_cpu_seconds() - own)
            result["other_load"] = max(0.0, foreign / wall)
        return result


def child_main(args) -> None:
    set_threads(args.threads)
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    result = CHILDREN[args.child](args)
    result["peak_rss_mb"] = peak_rss_mb()
    Path(args.child_out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------- parent


def summarize(side: dict, batch: int, seq: int) -> dict:
    step = statistics.median(side["times"])
    achieved = side["flops_per_sample"] * batch / step / 1e9
    return {"step_s": step, "tokens_per_s": batch * seq / step, "model_gflops": achieved,
            "real_tokens_per_s": batch * seq * side["real_token_share"] / step,
            "peak_gflops": side["peak_gflops"], "mfu": achieved / side["peak_gflops"], "peak_rss_mb": side["peak_rss_mb"], "times": side["times"],
            "losses": side["losses"], "other_load": side.get("other_load"), "device": side["device"],
            "peak_device_mb": side.get("peak_device_mb")}


def _load(side: dict) -> str:
    return "n/a" if side.get("other_load") is None else f"{side['other_load']:.2f} cores"


# Other processes using more than this many cores during a measurement make it unreliable.
LOAD_WARNING = 0.1


def print_table(rows: list[dict], peak: dict, peak_load: float | None) -> None:
    header = (f"{'config':<7}{'prec':<6}{'B':>4}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>7}{'real tok/s ours/HF':>20}"
              f"{'ours MFU%':>10}{'HF MFU%':>9}{'peak GF/s ours/HF':>18}{'ours RSS MB':>12}{'HF RSS MB':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        o, h = r["ours"], r["hf"]
        print(f"{r['config']:<7}{r['precision']:<6}{r['batch']:>4}{o['tokens_per_s']:>12.0f}{h['tokens_per_s']:>10.0f}"
              f"{o['tokens_per_s'] / h['tokens_per_s']:>7.2f}{o['real_tokens_per_s']:>12.0f}/{h['real_tokens_per_s']:<7.0f}"
              f"{100 * o['mfu']:>10.1f}{100 * h['mfu']:>9.1f}"
              f"{o['peak_gflops']:>12.0f}/{h['peak_gflops']:<5.0f}{o['peak_rss_mb']:>12.0f}{h['peak_rss_mb']:>10.0f}")
    devices = sorted({r[side]["device"] for r in rows for side in ("ours", "hf")})
    print(f"both sides ran on: {', '.join(devices)}")
    for r in rows:
        if r["ours"].get("peak_device_mb") is not None:
            print(f"  {r['config']} {r['precision']}: peak device memory ours {r['ours']['peak_device_mb']:.0f} MB, "
                  f"HF {r['hf']['peak_device_mb']:.0f} MB")
    print(f"GEMM peak (2048^3, best of 6) up front: {peaks_text(peak)}; "
          "each side's MFU is against the peak its own process measured around its steps (column above)")
    print(FLOPS_NOTE)
    if "bf16" in peak:
        print_bf16_route()
    busy = [f"{r['config']} {r['precision']} {side}" for r in rows for side in ("ours", "hf")
            if (r[side].get("other_load") or 0.0) > LOAD_WARNING]
    if (peak_load or 0.0) > LOAD_WARNING:
        busy.insert(0, "GEMM peak")
    if busy:
        print(f"WARNING: other processes used > {LOAD_WARNING} cores during: {', '.join(busy)}; "
              "these figures are not from a quiet machine.")


def peaks_text(peak: dict) -> str:
    return ", ".join(f"{precision} {gflops:.0f} GFLOP/s" for precision, gflops in peak.items())


def print_bf16_route() -> None:
    from pretrain.model.cpu_bf16 import OVERRIDE_ENV, bf16_route, calibrated_route

    _, record = calibrated_route()
    rates = ", ".join(f"{name} {gflops:.0f}" for name, gflops in record["gflops"].items())
    forced = f", forced by {OVERRIDE_ENV}" if os.environ.get(OVERRIDE_ENV) else ""
    print(f"bf16 GEMM route on this CPU: {bf16_route()}{forced} (calibrated GFLOP/s: {rates}). With 'fp32', our bf16 GEMMs multiply "
          "the exactly upcast bf16 operands in fp32 and round to bf16 (the arithmetic of a bf16 GEMM); HF's "
          "autocast uses the native kernel. The bf16 peak is the faster of the two routes.")


def measure_side(side: str, args, config: str, precision: str, batch: int) -> dict:
    """One side in a fresh child; measured again (up to --retries times) while other processes
    kept the CPU busy, keeping the quietest attempt."""
    best = None
    for attempt in range(1 + args.retries):
        result = summarize(run_child(side, args, config=config, precision=precision, batch=batch), batch, args.seq)
        print(f"  {config} {precision} {side}: median step {result['step_s']:.3f} s, "
              f"{result['tokens_per_s']:.0f} tokens/s, GEMM peak {result['peak_gflops']:.0f} GFLOP/s, "
              f"other load {_load(result)}", flush=True)
        if best is None or (result.get("other_load") or 0.0) < (best.get("other_load") or 0.0):
            best = result
        if (best.get("other_load") or 0.0) <= LOAD_WARNING:
            break
    return best


def parent_main(args) -> None:
    configs = [c for c in args.configs.split(",") if c]
    precisions = [p for p in args.precisions.split(",") if p]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"bench_train: unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    for p in precisions:
        if p not in PRECISIONS:
            raise SystemExit(f"bench_train: unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    measured = run_child("peak", args, precisions=",".join(precisions))
    peak = measured["peak_gflops"]
    print(f"GEMM peak on {measured['device']}: {peaks_text(peak)} "
          f"({args.threads} threads), other load {_load(measured)}", flush=True)
    rows = []
    for config in configs:
        batch = args.batch or CONFIGS[config][1]
        for precision in precisions:
            row = {"config": config, "precision": precision, "batch": batch, "seq": args.seq}
            for side in ("ours", "hf"):  # one after the other, never side by side
                row[side] = measure_side(side, args, config, precision, batch)
            if row["ours"]["device"] != row["hf"]["device"]:
                raise SystemExit(f"bench_train: the sides ran on different devices ({row['ours']['device']} vs "
                                 f"{row['hf']['device']}): no comparison")
            rows.append(row)
    print()
    print_table(rows, peak, measured.get("other_load"))
    write_json(args.json, {"threads": args.threads, "optimizer": args.optimizer, "steps": args.steps,
                           "warmup": args.warmup, "peak_gflops": peak, "peak_other_load": measured.get("other_load"),
                           "flops_note": FLOPS_NOTE, "rows": rows})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="base,mini", help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--precisions", default="fp32,bf16", help="comma list of: fp32, bf16")
    p.add_argument("--batch", type=int, default=None, help="micro = global batch (default: base 8, mini 16)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--retries", type=int, default=2,
                   help=f"measure a side again, up to this many times, when other processes used > {LOAD_WARNING} "
                        "cores meanwhile (the quietest attempt is kept)")
    # internal: one measurement in a child process
    p.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
