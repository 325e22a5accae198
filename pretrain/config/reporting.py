"""What a run reports: the eval section (held-out evaluation) and the logging section (intervals,
TensorBoard and trackers, timers, the profiler), with the rules about their own fields and the keys that
moved here from `train`."""
from __future__ import annotations

from dataclasses import dataclass, field

from .checks import non_negative, positive


@dataclass
class EvalConfig:
    """Evaluation on the validation set during training (and the test set once at the end)."""

    interval: int = 0  # steps between evaluations; 0 = never
    steps: int = 10  # global batches per evaluation
    # a JSON file with every evaluation's metrics (validation at each interval, the test set once
    # at the end of training), rewritten after each; kept across resumes
    results: str | None = None

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "eval.steps", self.steps)
        non_negative(p, "eval.interval", self.interval)
        return p


@dataclass
class LoggingConfig:
    """What the run reports: the log line, TensorBoard, phase timers, profiler traces."""

    interval: int = 10  # steps between log lines
    tensorboard_dir: str | None = None
    # Weights & Biases and MLflow beside TensorBoard (pretrain/observability/trackers.py; the extras
    # of the same names): the same scalars by step, the config, the checkpoints saved. Set the
    # project / experiment to turn one on. wandb_mode offline writes under wandb_dir (default: the
    # save_dir, else the working directory) for a later `wandb sync`; the MLflow store is
    # mlflow_tracking_uri (default: MLflow's own, MLFLOW_TRACKING_URI or ./mlruns)
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: str = "online"
    wandb_dir: str | None = None
    mlflow_experiment: str | None = None
    mlflow_run_name: str | None = None
    mlflow_tracking_uri: str | None = None
    # time each phase of a step (data, forward, backward, gradient reduction, optimizer; ms per step
    # on the log line and time/* in TensorBoard); on a GPU it synchronises at every phase boundary
    timers: bool = False
    # a torch.profiler trace of the steps [first, last] (1-based, inclusive) into profile_dir, on
    # the ranks in profile_ranks: <rank>.*.pt.trace.json for TensorBoard's profiler plugin or Perfetto
    profile_steps: list[int] = field(default_factory=list)
    profile_dir: str | None = None
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    # once per log window, every rank's own step time (not counting the time it waited for the
    # others) gathered in the window's one metric collective: the line shows min/median/max and the
    # slowest rank, TensorBoard each rank's figure
    stragglers: bool = True
    # a rank whose own step time is above the median by more than this share (0.2 = 20%) in
    # straggler_windows log windows in a row is named in a warning line
    straggler_share: float = 0.2
    straggler_windows: int = 2

    def problems(self) -> list[str]:
        p: list[str] = []
        positive(p, "logging.interval", self.interval)
        if self.wandb_mode not in ("online", "offline"):
            p.append(f"logging.wandb_mode ({self.wandb_mode!r}) must be online or offline")
        positive(p, "logging.straggler_windows", self.straggler_windows)
        non_negative(p, "logging.straggler_share", self.straggler_share)
        if self.profile_steps:
            first_last = self.profile_steps
            if len(first_last) != 2 or not 1 <= first_last[0] <= first_last[1]:
                p.append(f"logging.profile_steps ({first_last}) must be [first, last] with 1 <= first <= last")
            if not self.profile_dir:
                p.append("logging.profile_steps needs logging.profile_dir (where the trace is written)")
        if any(rank < 0 for rank in self.profile_ranks):
            p.append(f"logging.profile_ranks ({self.profile_ranks}) must be ranks >= 0")
        return p


# Keys that lived in `train` before these sections existed (see checkpoint.py's MOVED_KEYS)
MOVED_KEYS: dict[str, str] = {
    "train.eval_interval": "eval.interval", "train.eval_steps": "eval.steps", "train.eval_results": "eval.results",
    "train.log_interval": "logging.interval",
    **{f"train.{key}": f"logging.{key}" for key in ("tensorboard_dir", "timers", "profile_steps", "profile_dir",
                                                     "profile_ranks")},
}
