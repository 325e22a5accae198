"""Rank entry point for the non-finite guard tests: train with a NaN/Inf injected, report what happened.

usage: python tests/_guard_worker.py OUT.json RUN_JSON...
RUN_JSON: {"name": ..., "overrides": [...], "poison": "loss" | "gradients", "steps": [...], "rank": R}
"loss" makes rank R's MLM logits NaN at those steps (loss and gradients non-finite); "gradients"
leaves the loss finite and makes every gradient of rank R infinite in backward. Per run the
logging rank writes the per-step metrics, the parameter norm after every step, and the error a
too-long run of bad steps raised (its class and message), if any.
"""
import json
import os
import sys

import torch

from pretrain.observability.quiet import hide_library_warnings

hide_library_warnings()

from _train_worker import TINY, finish  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.model.bert import PretrainingLoss  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


class InfiniteGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by infinity."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def poison(trainer, run, rank):
    """Wrap this trainer's loss function: at the run's steps (1-based) on its rank, poison it."""
    clean = trainer.loss_fn.__call__
    active = rank == run["rank"]

    def poisoned(outputs, labels):
        bad = active and trainer.step + 1 in run["steps"]
        if bad and run["poison"] == "loss":
            outputs = (outputs[0] * float("nan"), outputs[1])
        loss = clean(outputs, labels)
        return InfiniteGradient.apply(loss) if bad and run["poison"] == "gradients" else loss

    # an instance attribute is not what `loss_fn(...)` calls: swap the class for a subclass
    trainer.loss_fn.__class__ = type("Poisoned", (PretrainingLoss,), {"__call__": lambda self, o, l: poisoned(o, l)})


def main():
    out_path, runs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)
    results = {}
    for run in runs:
        cfg = load_config(None, TINY + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        trainer = Trainer(cfg, parallel)
        poison(trainer, run, parallel.rank)
        norms = []
        result = {"norms": norms}
        try:
            result["history"] = trainer.train(after_step=lambda step: norms.append(trainer.params_norm()))
        except Exception as error:  # the guard's own error is what the test looks at
            result["error"] = [type(error).__name__, str(error)]
        result["skipped_steps"] = trainer.steps_skipped
        results[run["name"]] = result
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
