"""tests/side_by_side.py, which the slow tests use to run independent jobs at once: every job has ended
when it returns, at most `at_once` run together, and a failed job fails only the test that reads it."""
import threading
import time

import pytest

from side_by_side import side_by_side


def test_every_job_ends_before_it_returns_and_a_failure_reaches_its_reader_only():
    ended = []

    def slow(name, seconds):
        time.sleep(seconds)
        ended.append(name)
        return name.upper()

    def broken():
        raise ValueError("job b failed")

    outcomes = side_by_side({"a": lambda: slow("a", 0.2), "b": broken, "c": lambda: slow("c", 0.05)})
    assert sorted(ended) == ["a", "c"]  # the slow job had ended too
    assert outcomes["a"] == "A" and outcomes["c"] == "C"
    with pytest.raises(ValueError, match="job b failed"):
        outcomes["b"]
    assert "b" in outcomes and "d" not in outcomes


def test_at_most_at_once_jobs_run_together():
    running, most, lock = [0], [0], threading.Lock()

    def job():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    side_by_side({str(i): job for i in range(5)}, at_once=2)
    assert most[0] == 2
    side_by_side({str(i): job for i in range(3)})
    assert most[0] == 3  # all at once by default
