"""Optimizer step benchmark: our LAMB against torch's fused AdamW, and our StableAdamW against
torch-optimi's (the reference, a test-only dependency: skipped when absent), on BERT-base's parameters.

usage: python tools/benchmarks/lamb.py [--config base] [--steps 5] [--warmup 2] [--threads 2] [--keep-freed]
                                      [--json out.json]

Each optimizer runs in a fresh child process (this script with ``--child``), one after the other:
the model's whole parameter list (configs/bert-<config>.yaml, Hugging Face shapes, fp32, as one
rank steps it at ZeRO-0) with random gradients, split into the decay / no-decay groups the trainer
uses (LAMB's trust ratio off for biases and LayerNorm). A child takes --warmup untimed steps (the
moments are allocated there), then times --steps steps, and reports the median step time and the
transient memory of a step: the peak resident memory over the timed steps minus the resident memory
before them, when the parameters, gradients and moments already exist (what the temporaries of a
step add). The child's malloc returns every block above 64 KiB to the system when it is freed
(MALLOC_MMAP_THRESHOLD_), so that resident memory follows the live tensors; each step's fresh
temporaries then cost page faults. --keep-freed times the steps as a GPU's caching allocator runs
them instead: freed blocks stay with the process (no transient memory is measured then).
lamb-fused is LAMB with optimizer.fused (its Adam direction one compiled kernel per tensor; the
warmup steps compile it). torch's AdamW (fused, one kernel over all tensors) is the peer: the ratio says what LAMB's
whole-parameter norms and trust ratios cost on top of the same Adam moments. optimi's StableAdamW
(foreach, its fastest path without Triton) is ours' peer: the same update, with per-tensor RMS
terms read on the host (.item()) where ours keeps them on the device for its layout reductions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.benchmarks.harness import KEEP_FREED_ENV, run_json_child, write_json  # noqa: E402
from tools.benchmarks.train import peak_rss_mb, set_threads, time_steps  # noqa: E402

OPTIMIZERS = ("lamb", "lamb-fused", "adamw", "stable_adamw", "optimi")
CONFIGS = {"base": REPO / "configs" / "bert-base.yaml", "large": REPO / "configs" / "bert-large.yaml",
           "mini": REPO / "configs" / "bert-mini.yaml"}


def child(args) -> dict:
    set_threads(args.threads)
    import torch

    from pretrain.checkpoint.format import hf_parameter_info
    from pretrain.config import load_config
    from pretrain.optim import build_optimizer

    cfg = load_config(str(CONFIGS[args.config]))
    generator = torch.Generator().manual_seed(0)
    groups = {True: [], False: []}  # decayed and layer-adapted, or neither (bias, LayerNorm)
    for info in hf_parameter_info(cfg.model).values():
        param = torch.nn.Parameter(torch.randn(info.shape, generator=generator) * 0.02)
        param.grad = torch.randn(info.shape, generator=generator) * 1e-3
        groups[info.kind not in ("bias", "layernorm")].append(param)
    params = groups[True] + groups[False]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    if args.child.startswith("lamb"):
        hyper["max_trust_ratio"] = None
    if args.child == "lamb-fused":  # optimizer.fused: the Adam direction compiled (the warmup compiles)
        hyper["fused"] = True
    param_groups = [{"params": groups[True], "weight_decay": 0.01, "layer_adaptation": True},
                    {"params": groups[False], "weight_decay": 0.0, "layer_adaptation": False}]
    if args.child in ("stable_adamw", "optimi"):  # ModernBERT's settings
        hyper.update(betas=(0.9, 0.98), weight_decay=1e-5, decouple_lr=True)
        param_groups[0]["weight_decay"] = 1e-5
    if args.child == "optimi":
        from optimi import StableAdamW

        optimizer = StableAdamW([{k: v for k, v in g.items() if k != "layer_adaptation"} for g in param_groups],
                                foreach=True, triton=False, **hyper)
    else:
        optimizer = build_optimizer(args.child.removesuffix("-fused"), param_groups, **hyper)
    for _ in range(args.warmup):
        optimizer.step()
    before = current_rss_mb()
    times = time_steps(optimizer.step, 0, args.steps)
    return {"optimizer": args.child, "times": times, "transient_mb": peak_rss_mb() - before,
            "parameters_mb": sum(p.numel() for p in params) * 4 / 2**20, "elements": sum(p.numel() for p in params)}


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_child(args, optimizer: str) -> dict:
    argv = ["--child", optimizer, "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads", str(args.threads)]
    env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the resident set
    return run_json_child(__file__, argv, optimizer, {**env, **(KEEP_FREED_ENV if args.keep_freed else {})})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="base")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-freed", action="store_true",
                        help="keep freed memory in the process (a caching allocator's timing; no transient memory)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first step allocates the moments)")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    try:
        import optimi  # noqa: F401
        names = OPTIMIZERS
    except ImportError:
        print("torch-optimi is not installed (pip install torch-optimi): StableAdamW's peer left out")
        names = OPTIMIZERS[:4]
    results = {name: run_child(args, name) for name in names}
    lamb, adamw = results["lamb"], results["adamw"]
    print(f"BERT-{args.config} parameters: {lamb['elements'] / 1e6:.1f} M ({lamb['parameters_mb']:,.0f} MB fp32), "
          f"{args.threads} threads, median of {args.steps} steps")
    print("| optimizer | step time | transient memory of a step |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {1e3 * statistics.median(r['times']):,.0f} ms | {r['transient_mb']:,.0f} MB "
              f"({r['transient_mb'] / r['parameters_mb']:.2f} x parameters) |")
    ratio = statistics.median(lamb["times"]) / statistics.median(adamw["times"])
    print(f"LAMB / fused AdamW step time: {ratio:.2f}")
    ratio = statistics.median(results["lamb-fused"]["times"]) / statistics.median(adamw["times"])
    extra = 1e3 * (statistics.median(results["lamb-fused"]["times"]) - statistics.median(adamw["times"]))
    print(f"LAMB with optimizer.fused / fused AdamW step time: {ratio:.2f} ({extra:+,.0f} ms)")
    if "optimi" in results:
        ratio = statistics.median(results["stable_adamw"]["times"]) / statistics.median(results["optimi"]["times"])
        print(f"our StableAdamW / torch-optimi's StableAdamW step time: {ratio:.2f}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
