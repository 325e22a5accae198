"""A torch.profiler trace of a range of training steps (Megatron's --profile-step-start/-end).

The trace is written when the range ends, by each rank named in logging.profile_ranks, as
<profile_dir>/rank<R>.<time>.pt.trace.json: TensorBoard's profiler plugin reads the directory,
and Perfetto (ui.perfetto.dev) or chrome://tracing open the file. Each step is one
"ProfilerStep#<n>" span, n counted from 0 at the first profiled step.
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


class StepProfiler:
    def __init__(self, directory: str, first: int, last: int, rank: int, device: torch.device):
        self.first, self.last = first, last
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=0, active=last - first + 1, repeat=1),
            on_trace_ready=tensorboard_trace_handler(directory, worker_name=f"rank{rank}"),
            record_shapes=True, profile_memory=True)
        self._running = False

    def before_step(self, step: int) -> None:
        """`step`: the 1-based number of the step about to run."""
        if step == self.first and not self._running:
            self._profiler.start()
            self._running = True

    def after_step(self, step: int) -> None:
        if self._running:
            self._profiler.step()
            if step >= self.last:
                self.close()

    def close(self) -> None:
        """Stop (and write what was recorded) if still running, e.g. when training stops early."""
        if self._running:
            self._running = False
            self._profiler.stop()


class NoProfiler:
    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def step_profiler(logging_cfg, rank: int, device: torch.device) -> StepProfiler | NoProfiler:
    if not logging_cfg.profile_steps or rank not in logging_cfg.profile_ranks:
        return NoProfiler()
    first, last = logging_cfg.profile_steps
    return StepProfiler(logging_cfg.profile_dir, first, last, rank, device)
