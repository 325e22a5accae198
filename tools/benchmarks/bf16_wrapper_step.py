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
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VARIANTS = ("zero0-deepspeed", "zero0-multi-tensor", "zero1")


def child(args) -> dict:
    import time

    import torch

    torch.set_num_threads(args.threads)
    import deepspeed

    from pretrain.checkpoint.format import hf_parameter_info
    from pretrain.config import load_config
    from pretrain.distributed import internals
    from pretrain.distributed.ports import free_port
    from pretrain.optim import build_optimizer

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with internals.without_shared_memory_comm():
        deepspeed.init_distributed(dist_backend="gloo")
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
    cmd = [sys.executable, __file__, "--child", variant, "--config", args.config, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = dict(os.environ)
    if args.keep_freed:  # freed blocks stay with the process, as in a caching allocator
        env.update(MALLOC_MMAP_THRESHOLD_=str(2**32), MALLOC_TRIM_THRESHOLD_=str(2**32))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{variant} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
