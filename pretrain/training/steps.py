"""One optimizer step: draw the micro-batches, forward and backward (or the pipeline schedule),
the optimizer step with the non-finite guard, and the step's loss sums and token counts left on
the device: no host sync and no metric collective here (metrics.reduce_metrics takes one per
log window)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import Config
from ..config.deepspeed import deepspeed_batch
from ..distributed import device, internals
from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss
from ..optim.guard import NonFiniteGuard, StepOutcome, classify, describe_nonfinite
from ..resilience.watchdog import Watchdog
from .metrics import token_counts

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sums: torch.Tensor  # PretrainingLoss.METRICS then TOKEN_COUNTS of this rank, unreduced, on the device
    # as DeepSpeed's wrapper reports it: a device tensor, or a float or None, left as it is (a
    # host number copied to a GPU would wait for the GPU)
    grad_norm: torch.Tensor | float | None
    outcome: StepOutcome


class StepRunner:
    def __init__(self, cfg: Config, parallel: Parallel, engine, loss_fn: PretrainingLoss, guard: NonFiniteGuard,
                 timers, watchdog: Watchdog):
        self.cfg, self.parallel, self.engine = cfg, parallel, engine
        self.loss_fn, self.guard, self.timers, self.watchdog = loss_fn, guard, timers, watchdog
        self.pipelined = parallel.pp_size > 1
        self.grad_accum = cfg.grad_accum_steps(parallel.world_size)
        self.global_batch = cfg.train.global_batch_size
        # train.batch_warmup_tokens: the accumulation changes between steps, and DeepSpeed's own
        # boundary (micro-steps so far modulo the accumulation steps) would fall mid-step: we set it
        self.own_boundaries = bool(cfg.train.batch_warmup_tokens)

    def set_batch(self, samples: int) -> None:
        """The global batch of the steps from now on (the batch warmup's): more or fewer
        micro-batches per rank, the same micro-batch shape."""
        if samples != self.global_batch:
            # the accumulation steps (the pipeline's micro-batches)
            self.engine.set_train_batch_size(deepspeed_batch(self.cfg, samples))
            self.grad_accum = samples // (self.cfg.train.micro_batch_size * self.parallel.dp_size)
            self.global_batch = samples

    def run(self, data_iter, step: int) -> StepResult:
        """Take optimizer step number `step` (1-based) on the micro-batches drawn from `data_iter`."""
        p, timers = self.parallel, self.timers
        self.guard.begin_step()
        overflows = internals.overflow_skips(self.engine)
        scale = internals.loss_scale(self.engine) if self.cfg.train.precision == "fp16" else None
        draws = not self.pipelined or p.is_first_stage or p.is_last_stage
        if draws:
            position = getattr(data_iter, "consumed_samples", None)
            self.watchdog.doing("data: waiting for the loader" + (f" (micro-batches from sample {position})"
                                                                  if position is not None else ""), step - 1)
        with timers.phase("data"):
            micro_batches = [next(data_iter) for _ in range(self.grad_accum)] if draws else []
        self.watchdog.doing(f"step {step}: forward, backward, gradient reduction, optimizer", step - 1)
        if not self.pipelined or p.is_last_stage:
            self._scale_loss_to_global_batch([labels for _, labels in micro_batches])
        if self.pipelined:
            with timers.phase("forward_backward"):
                self.engine.train_batch(data_iter=iter(micro_batches))
            if not draws:
                # DeepSpeed never draws from a middle stage's iterator (PipelineEngine.
                # set_dataiterator); move its position on as the end stages' moved.
                data_iter.skip(self.grad_accum)
        else:
            for index, (inputs, labels) in enumerate(micro_batches):
                if self.own_boundaries:
                    self.engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
                with timers.phase("forward"):
                    loss = self.loss_fn(self.engine(inputs), labels)
                with timers.phase("backward"):
                    self.engine.backward(loss)
                with timers.phase("optimizer"):  # real work at the last micro-batch only
                    self.engine.step()
        deepspeed_skipped = internals.overflow_skips(self.engine) > overflows
        outcome = classify(self.guard.outcome(deepspeed_skipped), deepspeed_skipped,
                           None if scale is None else self._scaler_can_lower(scale))
        if outcome.counts:  # a non-finite step (every rank knows): where it came from, one more collective
            outcome = outcome._replace(sources=tuple(self.guard.traced()))
            if p.rank == p.logging_rank:
                logger.warning(describe_nonfinite(step, outcome))
        # a skipped step's gradients had no finite norm (whatever the engine kept from before)
        grad_norm = float("inf") if outcome.skipped else self.engine.get_global_grad_norm()
        sums = self.loss_fn.drain(p.device)
        return StepResult(torch.cat([sums, token_counts([inputs for inputs, _ in micro_batches], sums,
                                                              unpadded=self.cfg.real_tokens_only)]),
                          grad_norm, outcome)

    def _scaler_can_lower(self, scale: float) -> bool:
        """fp16: whether a gradient overflow at this loss scale lowers the scale (dynamic scaling
        above fp16.min_loss_scale), so that a later step may pass."""
        f = self.cfg.fp16
        return f.loss_scale == 0 and scale > f.min_loss_scale

    def _scale_loss_to_global_batch(self, labels: list) -> None:
        """The step's MLM loss is a mean over every masked token of the global batch (see
        PretrainingLoss): count them over this rank's micro-batches and the data-parallel ranks,
        on the device (one small collective, no host sync)."""
        masked = torch.stack([PretrainingLoss.masked_tokens(micro) for micro in labels]).sum()
        if self.parallel.dp_size > 1:
            masked = device.all_reduce(masked, group=self.parallel.dp_group)
        self.loss_fn.scale_to_global_batch(masked, self.grad_accum * self.parallel.dp_size, self.global_batch)
