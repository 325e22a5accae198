"""Rank entry point: does the fine-tuning optimizer hold any state right after its engine is built?

usage: python tests/_finetune_engine_worker.py OUT.json TASK OVERRIDES...
"""
import json
import os
import sys

from finetune.config import load_finetune_config
from finetune.finetuner import Finetuner
from finetune.tasks import TASKS
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel


def main():
    out_path, task, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_finetune_config(None, [f"task.name={task}", *overrides])
    cfg.validate(1, TASKS)
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)
    runner = Finetuner(cfg, parallel)
    with open(out_path, "w") as f:
        json.dump({"wrapper": type(runner.engine.optimizer).__name__,
                   "optimizer_states": len(runner.engine.basic_optimizer.state)}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
