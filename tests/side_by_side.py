"""Independent jobs of a test module run side by side where each runs one process at a time (a
guide's commands, a pytest session, a one-process fine-tuning), which leaves one of the 2 cores
mostly idle: the three guides took 99 s together against 120 one after another. Not where the jobs
already fill both cores: the multi-node jobs (4 ranks each) two at a time took 125 s against 120,
two sweeps at once 72 s against 41 (docs/testing.md).

Every job has ended when side_by_side returns, so nothing of a module runs on behind the tests of
the next (whose timings, and timeouts, assume the cores are theirs)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable


class Outcomes:
    """name -> the job's result; reading a failed job's raises its error (in the test that reads it:
    one failed job fails its own tests only)."""

    def __init__(self, futures: dict[str, Future]):
        self._futures = futures

    def __getitem__(self, name: str) -> Any:
        return self._futures[name].result()

    def __contains__(self, name: str) -> bool:
        return name in self._futures


def side_by_side(jobs: dict[str, Callable[[], Any]], at_once: int | None = None) -> Outcomes:
    """Run `jobs` (name -> a callable), `at_once` at a time (all of them by default) in the order
    given, and wait for every one of them."""
    with ThreadPoolExecutor(max(1, at_once or len(jobs))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        wait(futures.values())
    return Outcomes(futures)
