"""Rank entry point of tests/test_async_checkpoint.py (checkpoint.async_save).

usage: python tests/_async_save_worker.py OUT.json matrix CONFIG_JSON...
       python tests/_async_save_worker.py OUT.json train OVERRIDE...

Every checkpoint file torch.save writes is recorded with the thread that wrote it (the main thread,
or a background save's).

matrix: CONFIG_JSON is {"name", "tp", "pp", "overrides"} on top of the tests' tiny config; one job
runs every config in turn (the process group stays, the TP/PP/DP groups are built anew when the
layout changes). Per config, with Python's and NumPy's generators seeded alike before each run
(the trainer never seeds them, and the RNG files keep their states):
- "sync": 4 steps, synchronous saves after steps 2 and 4;
- "async": the same with checkpoint.async_save, the background writes of step 2's save held until
  step 4 has finished (two optimizer steps after the snapshot), so its files prove the snapshot
  was a copy;
- "resumed": the async run's step-2 checkpoint resumed (every rank points `latest` at it), steps 3-4.
The logging rank writes, per config and run, the per-step metrics, the parameter norm, each saved
checkpoint's meta.json fingerprints, the threads that wrote the files, every rank's snapshot size
(measured, and the planner's prediction) and what proves the configuration took effect.

train: one run of the tiny model with the overrides (checkpoint.* and resilience.* included), the
trainer's log lines on stdout; the logging rank writes {"history", "params_norm", "writes"}.
ASYNC_SAVE_HOLD=STEP:RANK:FILE (read here only): on rank RANK the background writes of STEP's save
wait until FILE exists; they say so on stdout first ("holding the background write of PATH").
"""
import gc
import json
import os
import random
import sys
import threading
import time

import numpy as np
import torch

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from _train_worker import TINY, finish  # noqa: E402
from pretrain.checkpoint.format import tag_for  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed import device  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.observability.console import configure_logging  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402

BASE = ["data.num_workers=0", "logging.interval=1", "scheduler.warmup_steps=2", "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1", "resilience.dist_timeout_minutes=1"]

WRITES: list[tuple[bool, str]] = []  # (written on the main thread, path) of every checkpoint file
HOLDS: dict[str, object] = {}  # tag -> a callable: may the background writes into that save go on
HELD: list[str] = []  # the files whose background write was held


def watch_saves() -> None:
    """Record every torch.save of a checkpoint file, and hold the background ones HOLDS names."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and os.path.basename(os.path.dirname(f)).startswith("iter_"):
            main = threading.current_thread() is threading.main_thread()
            WRITES.append((main, str(f)))
            ready = HOLDS.get(os.path.basename(os.path.dirname(f)).split(".")[0])
            if ready is not None and not main and not ready():
                print(f"async save worker: holding the background write of {f}", flush=True)
                HELD.append(str(f))
                while not ready():
                    time.sleep(0.02)
        return original(obj, f, *args, **kwargs)

    torch.save = save  # DeepSpeed's checkpoint engine and pretrain.checkpoint.exact call torch.save


def seeded() -> None:
    random.seed(1234)
    np.random.seed(1234)


def fingerprints(save_dir: str) -> dict:
    """tag -> meta.json's {file: CRC32} of every complete checkpoint in save_dir."""
    found = {}
    for name in sorted(os.listdir(save_dir)):
        meta = os.path.join(save_dir, name, "meta.json")
        if name.startswith("iter_") and os.path.exists(meta):
            with open(meta) as f:
                found[name] = json.load(f)["crc32"]
    return found


def train(cfg, parallel, hold_until_step: int | None = None) -> dict:
    """One run; with `hold_until_step`, the background writes of step 2's save wait until the trainer
    finished that step."""
    from pretrain.plan.memory import predict_rank_memory

    cfg.validate(world_size=parallel.world_size)
    gc.collect()
    seeded()
    trainer = Trainer(cfg, parallel)
    finished = threading.Event()
    HOLDS.clear()
    if hold_until_step is not None:
        HOLDS[tag_for(2)] = finished.is_set

    def after_step(result):
        if hold_until_step is not None and trainer.step >= hold_until_step:
            finished.set()

    del WRITES[:], HELD[:]
    trainer.train(after_step=after_step)
    result = {"history": trainer.history, "params_norm": trainer.params_norm(),
              "writes": device.all_gather_object([(main, os.path.basename(path)) for main, path in WRITES]),
              "held": device.all_gather_object([os.path.basename(path) for path in HELD]),
              "wrapper": type(trainer.engine.optimizer).__name__,
              "stages": trainer.engine.num_stages if trainer.pipelined else 1}
    if cfg.checkpoint.save_dir:
        result["fingerprints"] = fingerprints(cfg.checkpoint.save_dir)
    if cfg.checkpoint.async_save:
        result["snapshot_bytes"] = trainer.checkpointer.snapshot_bytes
        planned = predict_rank_memory(cfg, parallel.world_size, parallel.pp_rank, parallel.device.type,
                                      parallel.dp_rank).checkpoint_snapshot
        result["planned_snapshot_bytes"] = device.all_gather_object(planned)
    trainer.close_loaders()
    return result


def matrix(out_path: str, configs: list[dict]) -> None:
    launch = discover_launch_env()
    launch.export_to(os.environ)
    scratch = os.path.dirname(os.path.abspath(out_path))
    results, parallel, layout = {}, None, None
    for config in configs:
        if (config["tp"], config["pp"]) != layout:
            layout = config["tp"], config["pp"]
            parallel = init_parallel(launch, config["tp"], config["pp"], timeout_minutes=3)
        name = config["name"]
        overrides = TINY + BASE + [f"parallel.tensor_parallel={config['tp']}",
                                   f"parallel.pipeline_parallel={config['pp']}"] + config["overrides"]
        saving = overrides + ["train.train_steps=4", "checkpoint.save_interval=2", "checkpoint.keep_last=0"]
        sync_dir, async_dir = (os.path.join(scratch, f"ckpt-{name}-{kind}") for kind in ("sync", "async"))
        done = {"sync": train(load_config(None, saving + [f"checkpoint.save_dir={sync_dir}"]), parallel)}
        done["async"] = train(load_config(None, saving + [f"checkpoint.save_dir={async_dir}", "checkpoint.async_save=true"]),
                              parallel, hold_until_step=4)
        # resume the step-2 checkpoint: every rank points `latest` at it (atomic replace, the same content)
        temp = os.path.join(async_dir, f"latest.tmp{parallel.rank}")
        with open(temp, "w") as f:
            f.write(tag_for(2))
        os.replace(temp, os.path.join(async_dir, "latest"))
        device.barrier()
        done["resumed"] = train(load_config(None, overrides + ["train.train_steps=4", f"checkpoint.load_dir={async_dir}"]),
                                parallel)
        done["dirs"] = {"sync": sync_dir, "async": async_dir}
        results[name] = device.all_gather_object(done)[parallel.logging_rank]
    finish(parallel, out_path, results)


def single_run(out_path: str, overrides: list[str]) -> None:
    cfg = load_config(None, TINY + overrides)
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel,
                             timeout_minutes=cfg.resilience.dist_timeout_minutes)
    cfg.validate(world_size=parallel.world_size)
    hold = os.environ.get("ASYNC_SAVE_HOLD")
    if hold:
        step, rank, release = hold.split(":", 2)
        if int(rank) == parallel.rank:
            HOLDS[tag_for(int(step))] = lambda: os.path.exists(release)
    configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)  # as the program shows it
    trainer = Trainer(cfg, parallel)
    history = trainer.train()
    result = {"history": history, "params_norm": trainer.params_norm(),
              "writes": device.all_gather_object([(main, os.path.basename(path)) for main, path in WRITES])}
    finish(parallel, out_path, result)


def main():
    out_path, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    watch_saves()
    if mode == "matrix":
        matrix(out_path, [json.loads(arg) for arg in args])
    elif mode == "train":
        single_run(out_path, args)
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
