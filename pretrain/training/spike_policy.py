"""What the trainer does about a loss spike (resilience.spike_policy): log it, skip the step, or roll
back to the run's latest checkpoint and step over the samples around it.

- The detector (pretrain/optim/spikes.py) judges each step's loss over the job, which the guard's
  agreement computes from every rank's loss sums in its one collective per step; with `skip` or
  `rollback` a spike is vetoed there like a non-finite step (no rank applies it, the LR schedule
  holds), so the update never happens. A gradient-norm spike (resilience.spike_grad_norm) is known
  only after the update: `log` and `rollback` judge it then, from the norm agreed over the ranks.
- A rollback, as PaLM's: every rank reloads the run's latest checkpoint (the same decision on every
  rank, from the same numbers) and the sample sequence steps over everything from the checkpoint's
  position to spike_skip_batches global batches past the spike (data/samples/skipped.py). The
  ranges stepped over and the detector's window are the run's trainer state, kept in every
  checkpoint: a rolled-back run is reproducible, and resumes exactly.
"""
from __future__ import annotations

import logging
import math

import torch

from ..common.errors import UserError
from ..config import Config
from ..config.token_clock import TokenClock
from ..data.samples.skipped import Ranges, as_pairs, merged
from ..distributed import device
from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss
from ..optim.guard import SPIKE, NonFiniteGuard
from ..optim.spikes import SpikeDetector
from .steps import StepResult

logger = logging.getLogger(__name__)


class LossSpikes(UserError, RuntimeError):
    """Rolled back resilience.spike_max_rollbacks times and the loss spiked again."""


class SpikePolicy:
    def __init__(self, cfg: Config, parallel: Parallel, guard: NonFiniteGuard, loss_fn: PretrainingLoss):
        r = cfg.resilience
        self.policy, self.parallel, self.guard = r.spike_policy, parallel, guard
        self.skip_batches, self.max_rollbacks = r.spike_skip_batches, r.spike_max_rollbacks
        self.clock = TokenClock.of(cfg)  # each step's global batch (it grows during a batch warmup)
        self.detector = SpikeDetector(r.spike_factor, r.spike_window, r.spike_grad_norm)
        self.rollbacks = 0
        self.spikes = 0
        # the ranges of the sample sequence stepped over: the config's, the resumed checkpoint's, rollbacks'
        self.skipped: Ranges = merged(cfg.data.skip_samples)
        if self.policy != "off":
            contributes = parallel.is_last_stage and parallel.tp_rank == 0  # its TP peers hold the same sums
            guard.judge_spikes(
                lambda on: loss_fn.current(on) if contributes else torch.zeros(len(PretrainingLoss.METRICS),
                                                                               dtype=torch.float64, device=on),
                lambda sums: PretrainingLoss.averages(sums)["loss"], self.detector.loss_spike,
                veto=self.policy in ("skip", "rollback"))

    # ----------------------------------------------------------------------------- trainer state
    def state(self) -> dict:
        """What a checkpoint keeps of it (meta.json "trainer_state")."""
        return {"skipped_samples": as_pairs(self.skipped), "spike_window": self.detector.state(),
                "rollbacks": self.rollbacks}

    def load(self, state: dict) -> None:
        """A resumed checkpoint's state: its ranges join the config's, its window replaces ours."""
        self.skipped = merged(as_pairs(self.skipped) + list(state.get("skipped_samples", [])))
        self.detector.load(state.get("spike_window", []))
        self.rollbacks = max(self.rollbacks, int(state.get("rollbacks", 0)))  # a rollback never resets the count

    # ----------------------------------------------------------------------------- each step
    def judge(self, step: int, result: StepResult) -> str | None:
        """After step `step`: why it was a spike (None: it was not, or the policy is off), logged
        with what the policy did. Every rank calls it and gets the same answer."""
        if self.policy == "off":
            return None
        reason = self.guard.spike if (result.outcome.what == (SPIKE,) or not result.outcome.skipped) else None
        if reason is None and not result.outcome.skipped and self.detector.grad_norm_limit:
            reason = self.detector.grad_norm_spike(self._agreed_grad_norm(result.grad_norm))
        if reason is None:
            if not result.outcome.skipped and self.guard.global_loss is not None:
                self.detector.accept(self.guard.global_loss)
            return None
        self.spikes += 1
        done = {"log": "logged only (resilience.spike_policy=log): the step was applied",
                "skip": "the step was skipped on every rank",
                "rollback": "rolling back to the latest checkpoint"}[self.policy]
        if self.parallel.rank == self.parallel.logging_rank:
            logger.warning(f"step {step}: loss spike: {reason}; {done}")
        return reason

    @property
    def rolls_back(self) -> bool:
        return self.policy == "rollback"

    def _agreed_grad_norm(self, grad_norm) -> float:
        """The step's gradient norm as the ranks agree (the largest any reports; one collective)."""
        value = float(grad_norm) if grad_norm is not None else float("nan")
        value = value if math.isfinite(value) else -1.0
        return device.reduce_floats([value], self.parallel.device, op="max")[0]

    def roll_back_range(self, checkpoint_position: int, spike_position: int, spike_step: int) -> tuple[int, int]:
        """The samples a rollback to a checkpoint at `checkpoint_position` steps over, for a spike
        at step `spike_step` whose batch began at `spike_position`: from the checkpoint to
        spike_skip_batches global batches past the spike's batch, each of the size its step would
        have had (train.batch_warmup_tokens); added to the ranges stepped over. Raises LossSpikes
        past resilience.spike_max_rollbacks."""
        if self.rollbacks >= self.max_rollbacks:
            raise LossSpikes(f"the loss spiked again after {self.rollbacks} rollbacks "
                             f"(resilience.spike_max_rollbacks={self.max_rollbacks}): the run diverges; lower "
                             f"optimizer.lr, or raise resilience.spike_factor if these are not spikes")
        self.rollbacks += 1
        end = spike_position + sum(self.clock.batch(k) for k in range(spike_step - 1, spike_step + self.skip_batches))
        self.skipped = merged(as_pairs(self.skipped) + [[checkpoint_position, end - checkpoint_position]])
        return checkpoint_position, end

    def roll_back(self, checkpointer, reporter, spike_step: int, spike_position: int) -> tuple[int, int] | None:
        """Reload the run's latest checkpoint (`checkpointer.roll_back`) and add the samples from it to
        past the spike's batch to those stepped over (roll_back_range), saying so; the checkpoint's
        (step, consumed samples), or None when the run has no checkpoint to go back to yet."""
        loaded = checkpointer.roll_back()
        if loaded is None:
            if self.parallel.rank == self.parallel.logging_rank:
                logger.warning(f"step {spike_step}: no checkpoint of this run to roll back to yet; training goes on")
            return None
        tag_dir, step, consumed_samples = loaded
        self.load(checkpointer.loaded_state)
        first, end = self.roll_back_range(consumed_samples, spike_position, spike_step)
        logger.info(f"step {spike_step}: rolled back to {tag_dir} (step {step}); the sample sequence steps over samples "
                    f"{first}-{end - 1} ({spike_step - step + self.skip_batches} global batches: from the checkpoint "
                    f"to {self.skip_batches} past the spike's), rollback {self.rollbacks} of at most "
                    f"{self.max_rollbacks}")
        reporter.scalars("resilience", {"rollback_from_step": spike_step, "rollback_to_step": step,
                                        "skipped_samples": end - first}, spike_step, end)
        return step, consumed_samples
