"""Rank entry point of tests/test_stragglers.py: train tiny configs with one rank slowed on purpose.

usage: python tests/_straggler_worker.py OUT.json RUN_JSON...
Each RUN_JSON is {"name", "overrides", "tp", "pp", "slow_rank", "sleep"}: on rank `slow_rank` the
model's forward sleeps `sleep` seconds per micro-batch (this worker wraps it; the product knows
nothing of it). One job runs every run in turn (the layouts' groups built anew between them).
The logging rank writes per run the lines the trainer logged and the other ranks' (warnings and
errors only: a straggler warning must come from the logging rank alone).
"""
import json
import os
import sys
import time

from _train_worker import TINY, finish, log_lines


def slow_down(model, seconds: float) -> None:
    """This rank's model sleeps before every forward (every micro-batch; each pipeline stage's)."""
    forward = model.forward

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    model.forward = slowed


def main():
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    from pretrain.config import load_config
    from pretrain.distributed import device
    from pretrain.distributed.parallel import discover_launch_env, init_parallel
    from pretrain.training.trainer import Trainer

    out_path = sys.argv[1]
    runs = [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    results, parallel, layout = {}, None, None
    for run in runs:
        tp, pp = run.get("tp", 1), run.get("pp", 1)
        if (tp, pp) != layout:
            parallel, layout = init_parallel(launch, tp, pp, timeout_minutes=3), (tp, pp)
        cfg = load_config(None, TINY + [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
                          + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        lines = log_lines(parallel)
        trainer = Trainer(cfg, parallel)
        if parallel.rank == run["slow_rank"]:
            slow_down(trainer.model, run["sleep"])
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
        logs = device.all_gather_object(lines)  # the job's last layout may log on another rank
        results[run["name"]] = {"log": logs[parallel.logging_rank], "seconds": seconds,
                                "logging_rank": parallel.logging_rank, "micro_batches": trainer.grad_accum,
                                "other_ranks_lines": [line for rank, log in enumerate(logs) for line in log
                                                      if rank != parallel.logging_rank]}
        trainer.close_loaders()
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
