"""Activation recomputation benchmark: peak memory and step time of model.recompute none,
selective and full, one rank, the same batches.

usage: python tools/benchmarks/recompute.py [--config base] [--seq 512] [--batch 4] [--steps 2]
                                           [--warmup 1] [--threads 2] [--json out.json]

Each mode runs in a fresh child process (this script with ``--child``), one after the other, so
that one mode's peak resident memory cannot carry into another's. A child builds our Trainer in
a one-rank world exactly as tools/benchmarks/train.py does (its ``bench_config``: global = micro
batch, ZeRO-0 fp32, AdamW, constant LR, seq 512 with 80 predictions per sequence), sets
model.recompute, runs --warmup then --steps steps on the same synthetic batches, and reports its
peak RSS (``ru_maxrss``; on a GPU also the device's peak allocation) and the median step time.
The parameters, gradients and optimizer state are the same in every mode, so the differences in
peak memory are the activations the mode keeps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.benchmarks.harness import one_rank_world  # noqa: E402
from tools.benchmarks.train import (CONFIGS, bench_config, device_memory, make_batches,  # noqa: E402
                                    peak_rss_mb, set_threads, time_steps)

MODES = ("none", "selective", "full")


def child(args) -> dict:
    set_threads(args.threads)
    parallel = one_rank_world()
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.training.trainer import Trainer

    cfg = bench_config(args.config, args.batch, args.seq, "fp32", "adamw", args.warmup + args.steps)
    cfg.model.recompute = args.child
    cfg.validate(world_size=1)
    trainer = Trainer(cfg, parallel)
    before_steps = peak_rss_mb()
    batches = iter(make_batches(cfg, args.warmup + args.steps, parallel.device))
    losses = []
    times = time_steps(lambda: losses.append(trainer.train_step(batches)["loss"]), args.warmup, args.steps,
                       parallel.device)
    shutdown_parallel()
    return {"mode": args.child, "times": times, "losses": losses, "peak_rss_mb": peak_rss_mb(),
            "peak_rss_before_steps_mb": before_steps, **device_memory(parallel.device)}


def run_child(mode: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--child-out", str(out),
               "--config", args.config, "--seq", str(args.seq), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-5000:])
            raise SystemExit(f"recompute benchmark: the {mode} child failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="base", choices=tuple(CONFIGS))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="micro = global batch")
    p.add_argument("--steps", type=int, default=2, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(child(args)))
        return
    results = [run_child(mode, args) for mode in MODES]
    none = results[0]
    print(f"BERT-{args.config}, seq {args.seq}, batch {args.batch}, fp32, one rank, {args.threads} threads")
    print(f"{'recompute':<11}{'peak RSS MB':>12}{'saved MB':>10}{'step s':>8}{'time x':>8}{'loss':>9}")
    for r in results:
        step = statistics.median(r["times"])
        print(f"{r['mode']:<11}{r['peak_rss_mb']:>12.0f}{none['peak_rss_mb'] - r['peak_rss_mb']:>10.0f}"
              f"{step:>8.2f}{step / statistics.median(none['times']):>8.2f}{r['losses'][-1]:>9.4f}")
        if r.get("peak_device_mb") is not None:
            print(f"  peak device memory: {r['peak_device_mb']:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
