"""Evaluation: the loss and accuracies over `eval.steps` global batches of a dataset,
always its first ones, so that every evaluation sees the same samples."""
from __future__ import annotations

import torch

from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss
from ..resilience.watchdog import Watchdog
from .loaders import Loaders
from .metrics import reduce_metrics


class Evaluator:
    def __init__(self, engine, loss_fn: PretrainingLoss, loaders: Loaders, parallel: Parallel, eval_steps: int,
                 watchdog: Watchdog):
        self.engine, self.loss_fn, self.loaders, self.parallel = engine, loss_fn, loaders, parallel
        self.eval_steps, self.watchdog = eval_steps, watchdog

    @torch.no_grad()
    def evaluate(self, dataset, step: int) -> dict:
        """The metrics of `dataset` with the weights after step `step` (one metric collective)."""
        pipelined, grad_accum = self.parallel.pp_size > 1, self.loaders.grad_accum
        self.engine.eval()
        data_iter = self.loaders.evaluation(dataset).one_pass()
        self.loss_fn.drain(self.parallel.device)
        for eval_step in range(self.eval_steps):
            self.watchdog.doing(f"evaluation step {eval_step + 1}/{self.eval_steps}", step)
            if pipelined:
                # the full batch's micro-batches, also while a batch warmup has the engine at fewer
                self.engine.eval_batch(data_iter, compute_loss=True, bcast_loss=False, num_micro_batches=grad_accum)
            else:
                for _ in range(grad_accum):
                    inputs, labels = next(data_iter)
                    self.loss_fn(self.engine(inputs), labels)
            self.watchdog.progress(f"evaluation step {eval_step + 1}", step)
        self.engine.train()
        return reduce_metrics(self.parallel, [self.loss_fn.drain(self.parallel.device)])[0]
