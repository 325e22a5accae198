"""Rank entry point for the non-finite guard tests: train with a NaN/Inf injected, report what happened.

usage: python tests/_guard_worker.py OUT.json RUN_JSON...
RUN_JSON: {"name": ..., "overrides": [...], "poison": "loss" | "gradients" | "parameter", "steps": [...], "rank": R}
"loss" makes rank R's MLM logits NaN at those steps (loss and gradients non-finite); "gradients"
leaves the loss finite and makes every gradient of rank R infinite in backward; "parameter" makes
the gradient of one parameter of rank R NaN (its Hugging Face name in "parameter"; default
PARAMETER), before anything else sees it; "spike" multiplies the loss by 50 (finite) for the batches
starting at the sample positions in "positions" (R may be "all"). Per run the
logging rank writes the per-step metrics, the parameter norm after every step, and the error a
too-long run of bad steps raised (its class and message), if any.
"""
import contextlib
import json
import os
import sys

import torch

from pretrain.common.quiet import hide_library_warnings

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


PARAMETER = "bert.encoder.layer.1.attention.output.dense.weight"  # on rank 1 of DP2, TP2 and PP2 alike


@contextlib.contextmanager
def parameter_poisoned(run, rank, current_step):
    """While a Trainer is built: at the run's steps on its rank, a NaN gradient for one parameter,
    from a hook registered before the guard's (hooks run in registration order), so that the guard
    and DeepSpeed see it as a faulty device's value. current_step() is the trainer's step."""
    from pretrain.optim.guard import NonFiniteGuard

    name, watch = run.get("parameter", PARAMETER), NonFiniteGuard.watch

    def poisoned_first(guard, named_parameters):
        pairs = list(named_parameters)
        for param_name, param in pairs:
            if param_name == name and rank == run["rank"]:
                param.register_hook(lambda grad: grad * float("nan") if current_step() + 1 in run["steps"] else grad)
        watch(guard, pairs)

    NonFiniteGuard.watch = poisoned_first
    try:
        yield
    finally:
        NonFiniteGuard.watch = watch


def poison(trainer, run, rank):
    """Wrap this trainer's loss function: at the run's steps (1-based) on its rank, poison it
    ("parameter": see parameter_poisoned, which the trainer must be built under)."""
    if run["poison"] == "parameter":
        return
    clean = trainer.loss_fn.__call__
    active = run["rank"] in (rank, "all")

    def poisoned(outputs, labels):
        if run["poison"] == "spike":  # by data position: a rolled-back run never meets it again
            if not (active and trainer.consumed_samples in run["positions"]):
                return clean(outputs, labels)
            before = trainer.loss_fn._sums
            loss = clean(outputs, labels)
            # the loss as the metrics see it x 50 too: its sums (lm_loss_sum, nsp_loss_sum) grow by 50 x this batch's
            added = trainer.loss_fn._sums - (0 if before is None else before)
            scale = torch.ones_like(added)
            scale[[0, 3]] = 50.0
            trainer.loss_fn._sums = (0 if before is None else before) + added * scale
            return loss * 50.0
        bad = active and trainer.step + 1 in run["steps"]
        if bad and run["poison"] == "loss":
            outputs = (outputs[0] * float("nan"), outputs[1])
        loss = clean(outputs, labels)
        return InfiniteGradient.apply(loss) if bad and run["poison"] == "gradients" else loss

    # an instance attribute is not what `loss_fn(...)` calls: swap the class for a subclass
    trainer.loss_fn.__class__ = type("Poisoned", (PretrainingLoss,), {"__call__": lambda self, o, l: poisoned(o, l)})


def build(cfg, parallel, poisons) -> Trainer:
    """A Trainer with the runs' poisons in place."""
    trainer = None
    with contextlib.ExitStack() as stack:
        for run in poisons:
            if run["poison"] == "parameter":
                stack.enter_context(parameter_poisoned(run, parallel.rank, lambda: trainer.step))
        trainer = Trainer(cfg, parallel)
    for run in poisons:
        poison(trainer, run, parallel.rank)
    return trainer


def main():
    out_path, runs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)
    results = {}
    for run in runs:
        cfg = load_config(None, TINY + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        trainer = build(cfg, parallel, [run])
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
