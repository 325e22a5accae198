"""The resilience section: timeouts, hang detection, run controls, non-finite steps and loss spikes,
with the rules about its own fields and the keys that moved here from `train`."""
from __future__ import annotations

from dataclasses import dataclass

from .checks import non_negative, one_of, positive
from .choices import SPIKE_POLICIES


@dataclass
class ResilienceConfig:
    """What a long job does when something goes wrong: timeouts, stops, non-finite steps."""

    dist_timeout_minutes: float = 10.0  # collective timeout: a dead/hung rank makes the others exit
    # no training step or evaluation step finished for this long: every rank writes what it was
    # doing, which rank is stuck and every thread's stack, and ends (exit 124). 0 = no limit on steps
    hang_timeout_minutes: float = 15.0
    # the same watch over the start-up (resuming or initialising, up to the end of the first step,
    # which builds the communicators) and over a checkpoint save, which may rightly take longer than
    # a step (a loaded parallel file system); 0 = no limit there. All three 0: no watchdog
    startup_timeout_minutes: float = 30.0
    save_timeout_minutes: float = 30.0
    # every rank must have joined the job's rendezvous within this long; else the ones that did
    # end, naming the ranks that did not
    rendezvous_timeout_minutes: float = 10.0
    exit_after_steps: int = 0  # stop (saving a checkpoint) after this many steps of this run; 0 = run to train_steps
    # save and exit 0 once this many minutes have passed since the trainer started (checked every
    # stop_check_interval steps), ahead of a scheduler's time limit; the relaunch resumes. 0 = no limit
    exit_duration_minutes: float = 0.0
    # steps between the ranks' agreement on a SIGTERM (one collective and host sync each time);
    # keep interval x step time well inside the scheduler's grace period (SLURM: KillWait, 30 s)
    stop_check_interval: int = 5
    # skip a step whose loss or gradients are NaN/Inf on any rank (weights and LR schedule left as
    # they were), by our own check: one collective and host sync per step. DeepSpeed's wrappers
    # (ZeRO-1/2/3, bf16, fp16) skip such steps themselves whatever this says; only ZeRO-0 fp32
    # then lets a NaN into the weights
    skip_nonfinite_steps: bool = True
    # this many non-finite steps in a row stop the job with an error (fp16 loss-scale overflows
    # count only once the dynamic scale has reached fp16.min_loss_scale)
    max_consecutive_skips: int = 10
    # a loss spike: a finite loss above spike_factor x the median of the last spike_window steps
    # losses (judged once that many steps were seen), or a gradient norm above spike_grad_norm
    # (0 = not judged). off | log (a warning and a TensorBoard event) | skip (no rank applies the
    # step: loss spikes only, judged before the update) | rollback (every rank reloads the run's
    # latest checkpoint and steps over the samples from it to spike_skip_batches global batches
    # past the spike; at most spike_max_rollbacks times, then the job stops)
    spike_policy: str = "off"
    spike_factor: float = 3.0
    spike_window: int = 100
    spike_grad_norm: float = 0.0
    spike_skip_batches: int = 0
    spike_max_rollbacks: int = 5

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("dist_timeout_minutes", "stop_check_interval", "max_consecutive_skips",
                     "rendezvous_timeout_minutes"):
            positive(p, f"resilience.{name}", getattr(self, name))
        one_of(p, "resilience.spike_policy", self.spike_policy, SPIKE_POLICIES)
        for name in ("spike_window", "spike_max_rollbacks"):
            positive(p, f"resilience.{name}", getattr(self, name))
        if self.spike_factor <= 1.0:
            p.append(f"resilience.spike_factor ({self.spike_factor}) must be > 1 (a multiple of the running median loss)")
        for name in ("spike_grad_norm", "spike_skip_batches"):
            non_negative(p, f"resilience.{name}", getattr(self, name))
        if self.spike_policy == "skip" and self.spike_grad_norm:
            p.append("resilience.spike_policy=skip judges the loss before the update; the gradient norm is known only "
                     "after it: use spike_policy log or rollback with resilience.spike_grad_norm")
        for name in ("exit_after_steps", "exit_duration_minutes", "hang_timeout_minutes", "startup_timeout_minutes",
                     "save_timeout_minutes"):
            non_negative(p, f"resilience.{name}", getattr(self, name))
        return p

    def watchdog_limits(self) -> dict[str, tuple[float, str]]:
        """The watchdog's limit per kind of phase (pretrain/resilience/watchdog.py), with its key."""
        return {kind: (getattr(self, name), f"resilience.{name}") for kind, name in (
            ("start-up", "startup_timeout_minutes"), ("step", "hang_timeout_minutes"), ("save", "save_timeout_minutes"))}


# Keys that lived in `train` before this section existed (see checkpoint.py's MOVED_KEYS)
MOVED_KEYS: dict[str, str] = {f"train.{key}": f"resilience.{key}" for key in (
    "dist_timeout_minutes", "hang_timeout_minutes", "rendezvous_timeout_minutes", "exit_after_steps",
    "exit_duration_minutes", "stop_check_interval", "skip_nonfinite_steps", "max_consecutive_skips")}
