"""What a run shows of itself: progress and rank-prefixed lines (console.py), exclusive phase
timers (timers.py), torch.profiler over a step range (profiling.py) and the first steps' measured
device memory beside the planner's (device_memory.py). The library noise kept off the terminal is
pretrain/common/quiet.py (the launch path below this package uses it too)."""
