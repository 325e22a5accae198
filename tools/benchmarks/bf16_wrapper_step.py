"""bf16 at ZeRO-0 against ZeRO-1: DeepSpeed's optimizer-wrapper step alone, on a model's parameter shapes.

usage: python tools/benchmarks/bf16_wrapper_step.py [--config base|large|mini] [--steps 5] [--warmup 3]
                                                   [--threads 2] [--keep-freed] [--json out.json]

Three variants, each in a fresh one-rank process (gloo): bf16 ZeRO-0 with DeepSpeed's own
FP16_UnfusedOptimizer step (a non-finite check with a host sync, an fp32 copy, a norm, a scaling
and a copy back per tensor), bf16 ZeRO-0 with the trainer's replacement
(pretrain/distributed/internals.py multi_tensor_bf16_step: multi-tensor kernels, one host sync),
and bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer: flat fp32 partitions). Each steps LAMB (eager) over the
model's parameters (configs/bert-<config>.yaml's Hugging Face shapes, one decay group) with the
gradients of a trivial loss, and times `engine.step()` alone: the median of --steps steps after
--warmup. --keep-freed keeps freed memory in the process (as a GPU's caching allocator does):
without it every step's fresh fp32 gradient copies cost page faults on the CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.benchmarks.harness import KEEP_FREED_ENV, one_rank_world, run_json_child, write_json  # noqa: E402
from tools.benchmarks.train import set_threads  # noqa: E402

VARIANTS = ("zero0-deepspeed", "zero0-multi-tensor", "zero1")


def child(args) -> dict:
    import time

    import deepspeed
    import torch

    from pretrain.checkpoint.format import hf_parameter_info
    from pretrain.config import load_config
    from pretrain.distributed import internals
    from pretrain.optim import build_optimizer

    set_threads(args.threads)
    one_rank_world()
    cfg = load_config(str(REPO / "configs" / f"bert-{args.config}.yaml"))
    shapes = [info.shape for info in hf_parameter_info(cfg.model).values()]

    class Parameters(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes])

        def forward(self):
            return sum((p.float() * 1e-3).sum() for p in self.weights)

    zero = 0 if args.child.startswith("zero0") else 1
    model = Parameters()
    optimizer = build_optimizer("lamb", [{"params": list(model.parameters()), "weight_decay": 0.01,
                                          "layer_adaptation": True}], lr=1e-3, max_trust_ratio=None)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero}, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "bf16" if zero == 0 else "fp32"}}
    with internals.no_optimizer_steps(optimizer):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if args.child == "zero0-multi-tensor":
        internals.disable_wrapper_clipping(engine)
        assert internals.multi_tensor_bf16_step(engine)
    times = []
    for _ in range(args.warmup + args.steps):
        engine.backward(engine())
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return {"variant": args.child, "wrapper": type(engine.optimizer).__name__, "tensors": len(shapes),
            "elements": sum(p.numel() for p in model.parameters()), "times": times[args.warmup:]}


def run_child(args, variant: str) -> dict:
    argv = ["--child", variant, "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads", str(args.threads)]
    return run_json_child(__file__, argv, variant, KEEP_FREED_ENV if args.keep_freed else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=("mini", "base", "large"), default="base")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-freed", action="store_true", help="keep freed memory in the process")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = {variant: run_child(args, variant) for variant in VARIANTS}
    first = results[VARIANTS[0]]
    kept = ", freed memory kept" if args.keep_freed else ""
    print(f"BERT-{args.config} shapes: {first['tensors']} tensors, {first['elements'] / 1e6:.1f} M elements, bf16, "
          f"LAMB, {args.threads} threads, median of {args.steps} steps{kept}")
    print("| variant | wrapper | engine.step() |")
    print("|---|---|---|")
    median = {v: statistics.median(r["times"]) for v, r in results.items()}
    for variant, r in results.items():
        print(f"| {variant} | {r['wrapper']} | {1e3 * median[variant]:,.0f} ms |")
    print(f"ZeRO-0 / ZeRO-1 step time: DeepSpeed's step {median['zero0-deepspeed'] / median['zero1']:.2f}, "
          f"multi-tensor step {median['zero0-multi-tensor'] / median['zero1']:.2f}")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
