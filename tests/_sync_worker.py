"""Rank entry point: count host reads of device tensor values during training.

usage: python tests/_sync_worker.py OUT.json STEPS [OVERRIDES...]
Counts, over STEPS steps of the tests' tiny BERT, every .item(), .tolist(), .cpu(), .numpy(),
float(), int() and bool() of a tensor on the model's device (on a GPU each is a device-to-host
sync), with where they come from.
"""
import collections
import json
import os
import sys
import traceback

import torch

from _train_worker import TINY
from pretrain.config import load_config
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
from pretrain.training.trainer import Trainer

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def count_reads(device, counter: collections.Counter):
    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            if self.device == device:
                caller = traceback.extract_stack(limit=2)[0]
                counter[f"{name} at {caller.filename.rsplit('/', 2)[-1]}:{caller.lineno}"] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    for name in READS:
        wrap(name)


def main():
    out_path, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)
    cfg = load_config(None, TINY + [f"train.train_steps={steps}", "logging.interval=10"] + overrides)
    cfg.validate(world_size=parallel.world_size)
    trainer = Trainer(cfg, parallel)
    reads = collections.Counter()
    count_reads(parallel.device, reads)
    trainer.train()
    with open(out_path, "w") as f:
        json.dump({"device": str(parallel.device), "steps": steps, "reads": reads}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
