"""What the checkpoint fingerprints cost: the CRC32s (per 256 MiB block) of every file, recorded at
a save and checked at a resume, on a BERT-base checkpoint (one rank, fp32, ZeRO-0, LAMB: weights
and both moments).

usage: python tools/benchmarks/checkpoint.py [--config base] [--dir DIR] [--threads 2] [--repeats 3]

Builds our Trainer in a one-rank world as tools/benchmarks/train.py does, takes one step (so the
optimizer holds its moments), then saves and resumes `--repeats` times, timing the whole save
(`exact.save_checkpoint`, fingerprints included), the fingerprints alone (`format.fingerprints`
over the same files, as the save computes them), the whole exact resume (`exact.load_checkpoint`,
its check included) and the check alone (`format.content_problems`). Medians; the files are in
the page cache as they are right after a save. DIR defaults to a temporary directory (give one on
the file system you train on: there the read-back costs what that file system costs).
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


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="base", choices=tuple(CONFIGS))
    p.add_argument("--dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    set_threads(args.threads)
    parallel = one_rank_world()
    from pretrain.checkpoint import exact
    from pretrain.checkpoint.format import checkpoint_files, content_problems, fingerprints, read_meta
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.training.trainer import Trainer

    cfg = bench_config(args.config, 1, 128, "fp32", "lamb", 1)
    cfg.validate(world_size=1)
    trainer = Trainer(cfg, parallel)
    trainer.train_step(iter(make_batches(cfg, 1, parallel.device)))
    root = tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-")
    saves, sums, loads, checks = [], [], [], []
    try:
        for _ in range(args.repeats):
            save_dir = os.path.join(root, "run")
            shutil.rmtree(save_dir, ignore_errors=True)
            seconds, tag = timed(lambda: exact.save_checkpoint(trainer.engine, save_dir, 1, 1, cfg, parallel,
                                                               trainer.tracker, keep_last=0, series=None))
            saves.append(seconds)
            tag_dir = os.path.join(save_dir, tag)
            names = checkpoint_files(tag_dir)
            sums.append(timed(lambda: fingerprints(tag_dir, names))[0])
            loads.append(timed(lambda: exact.load_checkpoint(trainer.engine, save_dir, cfg, parallel, trainer.tracker))[0])
            meta = read_meta(tag_dir)
            seconds, problems = timed(lambda: content_problems(tag_dir, meta))
            assert not problems, problems
            checks.append(seconds)
        size = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in names)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutdown_parallel()
    save, crc, load, check = (statistics.median(x) for x in (saves, sums, loads, checks))
    print(f"checkpoint of BERT-{args.config} (fp32, ZeRO-0, LAMB moments): {len(names)} files, {size / 2**20:.0f} MiB")
    print(f"save    {save:6.2f} s, of which CRC32 fingerprints {crc:5.2f} s ({crc / save:.0%}; {size / 2**20 / crc:.0f} MiB/s)")
    print(f"resume  {load:6.2f} s, of which the CRC32 check   {check:5.2f} s ({check / load:.0%})")


if __name__ == "__main__":
    main()
