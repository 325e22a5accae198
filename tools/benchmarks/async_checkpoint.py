"""What an asynchronous save (checkpoint.async_save) spares training: the stall of a save, and the
training step while the background thread writes, against a synchronous save, on BERT-base (one
rank, fp32, ZeRO-0, LAMB: weights and both moments).

usage: python tools/benchmarks/async_checkpoint.py [--config base] [--batch 4] [--steps 6] [--repeats 2]
                                                    [--dir DIR] [--threads 2]

Builds our Trainer in a one-rank world as tools/benchmarks/checkpoint.py does and takes two steps
(the optimizer holds its moments). Then, `--repeats` times: `--steps` training steps without a
save (the baseline step time), a synchronous save (`exact.save_checkpoint`: its whole time stalls
training), and an asynchronous one (`exact.save_checkpoint_async`: training stalls for the
snapshot only) followed by `--steps` steps, timing each step that started while the background
thread was still writing, fsyncing and fingerprinting. Medians; the training time an async save
costs is its stall plus what the steps beside the write took beyond the baseline (per save, summed).
Files go to a temporary directory in DIR (default: the system's; give one on the file system you
train on). The host memory of the snapshot, measured and as the planner predicts it, is printed too.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.benchmarks.harness import one_rank_world  # noqa: E402
from tools.benchmarks.train import CONFIGS, bench_config, make_batches, set_threads  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="base", choices=tuple(CONFIGS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed steps without a save, and after each async save")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    set_threads(args.threads)
    parallel = one_rank_world()
    from pretrain.checkpoint import exact
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.plan.memory import predict_rank_memory
    from pretrain.training.trainer import Trainer

    cfg = bench_config(args.config, args.batch, 128, "fp32", "lamb", 1000)
    cfg.checkpoint.async_save = True  # for the planner's prediction; the saves below are called directly
    trainer = Trainer(cfg, parallel)
    batches = iter(make_batches(cfg, 2 + args.repeats * 2 * args.steps, parallel.device))
    for _ in range(2):
        trainer.train_step(batches)

    def step() -> float:
        started = time.perf_counter()
        trainer.train_step(batches)
        return time.perf_counter() - started

    root = tempfile.mkdtemp(dir=args.dir, prefix="async-ckpt-bench-")
    plain, during, after, sync_stalls, async_stalls, writes, snapshot = [], [], [], [], [], [], 0
    try:
        for repeat in range(args.repeats):
            plain += [step() for _ in range(args.steps)]
            save_dir = os.path.join(root, f"sync{repeat}")
            started = time.perf_counter()
            exact.save_checkpoint(trainer.engine, save_dir, 1, 1, cfg, parallel, trainer.tracker, keep_last=0, series=None)
            sync_stalls.append(time.perf_counter() - started)
            size = sum(f.stat().st_size for f in Path(save_dir).rglob("*") if f.is_file())
            shutil.rmtree(save_dir)

            save_dir = os.path.join(root, f"async{repeat}")
            started = time.perf_counter()
            job = exact.save_checkpoint_async(trainer.engine, save_dir, 1, 1, cfg, parallel, trainer.tracker, 0, None,
                                              None, None, 0, lambda: 1)
            async_stalls.append(time.perf_counter() - started)
            snapshot = job.snapshot_bytes
            for _ in range(args.steps):
                (after if job.finished else during).append(step())
            job.join()
            if job.error is not None:
                raise job.error
            writes.append(job.seconds)
            shutil.rmtree(save_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutdown_parallel()
    planned = predict_rank_memory(cfg, 1, 0, parallel.device.type).checkpoint_snapshot
    med = statistics.median
    print(f"BERT-{args.config} (fp32, ZeRO-0, LAMB moments, batch {args.batch} x 128), one rank on {args.threads} "
          f"threads: checkpoint {size / 2**20:,.0f} MiB; snapshot {snapshot / 2**20:,.0f} MiB of host memory "
          f"(planned {planned / 2**20:,.0f} MiB)")
    print(f"training step   {med(plain):6.2f} s without a save; {med(during):6.2f} s while the background save "
          f"writes ({len(during)} steps), {med(after) if after else float('nan'):6.2f} s after it")
    print(f"stall per save  synchronous {med(sync_stalls):6.2f} s, asynchronous {med(async_stalls):6.2f} s "
          f"(the snapshot; the background write took {med(writes):.2f} s)")
    slowdown = sum(t - med(plain) for t in during) / args.repeats  # the write's share of the steps beside it
    print(f"training time a save costs  synchronous {med(sync_stalls):6.2f} s, asynchronous "
          f"{med(async_stalls) + slowdown:6.2f} s (the stall + the steps' slowdown while the thread writes)")


if __name__ == "__main__":
    main()
