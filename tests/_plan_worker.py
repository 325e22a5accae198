"""Rank entry point of the memory planner's tests (tests/test_memory_plan.py): one training step
per run (the CPU has no device peak, which needs a second step), every rank's measured memory
and the planner's prediction for it.

usage: python tests/_plan_worker.py OUT.json RUN_JSON...
RUN_JSON: {"name": ..., "tp": TP, "pp": PP, "overrides": [...]} on top of the tests' tiny config.
One job runs every layout of its world size in turn (the process group stays, the TP/PP/DP
groups are built anew), so its processes start once. The logging rank writes, per run, what the
trainer logged after its first step (`Trainer.first_step_memory`: every rank's measured and
planned bytes; the device's allocated bytes before the run, which must be none) and what proves the layout took effect on every rank (megatron's TP size,
DeepSpeed's DP size and stage, its optimizer wrapper, the parameters' dtype and device).
"""
import gc
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from _train_worker import TINY, finish  # noqa: E402
from pretrain.distributed import device  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


def took_effect(trainer, parallel) -> dict:
    from megatron.core import parallel_state as ps

    engine = trainer.engine
    return {"tp": ps.get_tensor_model_parallel_world_size(), "dp": engine.dp_world_size,
            "pp": engine.num_stages if trainer.pipelined else 1,
            "stage": engine.stage_id if trainer.pipelined else 0,
            "wrapper": type(engine.optimizer).__name__,
            "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "devices": sorted({str(p.device) for p in trainer.model.parameters()})}


def main():
    out_path, runs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    results, parallel, layout = {}, None, None
    for run in runs:
        if (run["tp"], run["pp"]) != layout:
            layout = run["tp"], run["pp"]
            parallel = init_parallel(launch, run["tp"], run["pp"], timeout_minutes=3)
        overrides = TINY + [f"parallel.tensor_parallel={run['tp']}", f"parallel.pipeline_parallel={run['pp']}",
                            "train.train_steps=1", "scheduler.warmup_steps=0"] + run["overrides"]
        cfg = load_config(None, overrides)
        cfg.validate(world_size=parallel.world_size)
        gc.collect()  # the previous run's engine: its buffers must not count in this run's device peak
        before = device.device_memory_allocated(parallel.device)
        trainer = Trainer(cfg, parallel)
        trainer.train()
        results[run["name"]] = {"memory": trainer.first_step_memory, "allocated_before": before,
                                "took_effect": device.all_gather_object(took_effect(trainer, parallel))}
        del trainer
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
