"""What a run shows of itself: progress and rank-prefixed lines (console.py), exclusive phase
timers (timers.py), torch.profiler over a step range (profiling.py), the first steps' measured
device memory beside the planner's (device_memory.py), and the library noise kept off the
terminal (quiet.py)."""
