"""Context parallelism on this machine: step time per token and activation memory per rank of the
same long rows at CP1, CP2 and CP4 (tiny ModernBERT, fp32, synthetic full rows).

usage: python tools/benchmarks/context_parallel.py [--seq 8192] [--layouts cp1,cp2] [--steps 3]
                                                   [--warmup 1] [--json out.json]

Each layout trains configs/modernbert-tiny.yaml (4 layers, hidden 128; global attention on layers 0
and 2) on rows of one --seq-token document per micro-batch, one micro-batch per step, in fresh
processes on the machine's 2 cores: CP1 one process with 2 threads, CP2 two ranks with 1 thread
each, CP4 four ranks (oversubscribed 2:1: its time is not comparable, its memory is). The median
step time after --warmup is the measurement; per rank, the trainer's own measurement of its first
step's activation peak (saved tensors) beside the planner's prediction. --seq 32768 --layouts cp4
shows a 32k-token row training at CP4 within this machine's memory.
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

from tools.benchmarks.harness import launch_ranks, write_json  # noqa: E402

CORES = 2
LAYOUTS = {"cp1": 1, "cp2": 2, "cp4": 4}
MB = 2**20


def bench_config(args, cp: int):
    from pretrain.config import load_config

    return load_config(str(REPO / "configs" / "modernbert-tiny.yaml"), [
        "model.vocab_size=8000", f"data.seq_length={args.seq}", f"model.max_position_embeddings={args.seq}",
        "data.synthetic_min_fraction=1.0", "data.short_seq_prob=0", "data.max_predictions_per_seq=null",
        "train.global_batch_size=1",
        "train.micro_batch_size=1", f"train.train_steps={args.warmup + args.steps}", f"parallel.context_parallel={cp}",
        "train.precision=fp32", "scheduler.warmup_steps=0", "scheduler.decay=constant", "eval.interval=0",
        "checkpoint.save_interval=0", "checkpoint.save_dir=null", "logging.tensorboard_dir=null",
        "data.num_workers=0", "data.kind=synthetic", "logging.interval=1"])


def child(args) -> dict:
    from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
    from pretrain.training.trainer import Trainer

    cp = LAYOUTS[args.child]
    ranks = int(os.environ["WORLD_SIZE"])
    cfg = bench_config(args, cp)
    cfg.validate(world_size=ranks)
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1, context_parallel=cp)
    trainer = Trainer(cfg, parallel)
    history = trainer.train()
    memory = trainer.first_step_memory
    trainer.close_loaders()
    shutdown_parallel()
    times = [step["iteration_time"] for step in history[args.warmup:]]
    tokens = [step["real_tokens"] for step in history[args.warmup:]]
    return {"layout": args.child, "times": times, "tokens": tokens, "lm_loss": history[-1]["lm_loss"],
            "activations": [rank["measured"].get("activations_peak") for rank in memory or []],
            "planned": [rank["planned"].get("activations_peak") for rank in memory or []]}


def launch(name: str, args) -> dict:
    ranks = LAYOUTS[name]  # one rank per CP share, the machine's cores shared out
    return launch_ranks([str(Path(__file__).resolve()), "--child", name, "--seq", str(args.seq), "--steps",
                         str(args.steps), "--warmup", str(args.warmup)], ranks, max(1, CORES // ranks),
                        f"context-parallel benchmark: {name}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layouts", default="cp1,cp2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.names = args.layouts.split(",")
    unknown = [n for n in args.names if n not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        from pretrain.common.quiet import hide_library_warnings

        hide_library_warnings()
        import torch

        torch.set_num_threads(max(1, CORES // LAYOUTS[args.child]))
        result = child(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.child_out).write_text(json.dumps(result))
        return
    results = {name: launch(name, args) for name in args.names}
    print(f"tiny ModernBERT, rows of one {args.seq:,}-token document, fp32, {CORES} cores per layout")
    print(f"  {'layout':<7} {'ms/step':>9} {'us/token':>9} {'activations per rank (MB, measured/planned)':>46}")
    base = None
    for name, r in results.items():
        step = statistics.median(r["times"])
        per_token = step / statistics.median(r["tokens"]) * 1e3
        base = base or per_token
        memory = ", ".join(f"{a / MB:.0f}/{p / MB:.0f}" for a, p in zip(r["activations"], r["planned"]) if a)
        print(f"  {name:<7} {step * 1e3:>9.0f} {per_token * 1e3:>9.1f} {memory:>46}   "
              f"({per_token / base:.2f}x CP1's time per token; loss {r['lm_loss']:.3f})")
    if args.json:
        write_json(args.json, {"seq": args.seq, "results": results})


if __name__ == "__main__":
    main()
