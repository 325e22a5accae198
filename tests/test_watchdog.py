"""The watchdog in one process (pretrain/resilience/watchdog.py): no progress for the timeout gives the rank's
account (step, phase, what last finished), every thread's stack and exit status 124; progress keeps
it quiet; a timeout of 0 starts no thread. The trainers' use of it, end to end: test_hangs.py."""
import io
import json
import threading
import time

import pytest

from pretrain.resilience.watchdog import HUNG_EXIT_STATUS, Watchdog

TIMEOUT_MINUTES = 0.01  # 0.6 s


def watchdog(stream, ended):
    return Watchdog(TIMEOUT_MINUTES, rank=3, world_size=1, heartbeats=None, stream=stream, end=ended.append,
                    interval=0.05, local_report=lambda: ["loader process 42: S (sleeping)"])


def wait_until(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_no_progress_ends_the_process_with_the_ranks_account_and_stacks(tmp_path):
    # a real file: faulthandler writes to a file descriptor, as the rank's stderr is
    stream, ended = open(tmp_path / "rank3.log", "w+"), []
    dog = watchdog(stream, ended).start()
    dog.progress("step 2", 2)
    dog.doing("step 3: forward, backward, gradient reduction, optimizer", 2)
    wait_until(lambda: ended)
    dog.stop()
    stream.seek(0)
    out = stream.read()
    assert ended == [HUNG_EXIT_STATUS]
    assert "watchdog: rank 3" in out and "made no progress" in out, out
    assert "at step 2, step 3: forward, backward, gradient reduction, optimizer; last finished: step 2" in out, out
    assert "watchdog: rank 3: loader process 42: S (sleeping)" in out, out
    assert "most recent call first" in out and "test_no_progress_ends_the_process" in out, out  # this thread's stack
    assert out.rstrip().endswith(f"ending the process (exit {HUNG_EXIT_STATUS})"), out


def test_progress_keeps_it_quiet():
    stream, ended = io.StringIO(), []
    dog = watchdog(stream, ended).start()
    for step in range(30):  # 1.5 s, 2.5 timeouts, progress every 0.05 s
        dog.progress(f"step {step}", step)
        time.sleep(0.05)
    dog.stop()
    assert ended == [] and stream.getvalue() == ""


def test_a_timeout_of_0_starts_no_thread():
    dog = Watchdog(0, rank=0, world_size=1, heartbeats=None, end=lambda status: pytest.fail("ended")).start()
    dog.doing("anything", 1)
    dog.progress("anything", 1)
    assert not [t for t in threading.enumerate() if t.name == "bert-watchdog"]
    dog.stop()


@pytest.mark.slow
def test_start_up_steps_and_saves_each_have_their_own_limit(tmp_path):
    """A save may rightly take longer than a step, a start-up longer still: the limit of the kind of
    phase the rank is in applies, and the dump names the setting that fired."""
    limits = {"start-up": (0.0, "resilience.startup_timeout_minutes"),  # no limit
              "step": (0.01, "resilience.hang_timeout_minutes"),  # 0.6 s
              "save": (0.04, "resilience.save_timeout_minutes")}  # 2.4 s
    stream, ended = open(tmp_path / "rank0.log", "w+"), []
    dog = Watchdog(limits, rank=0, world_size=1, heartbeats=None, stream=stream, end=ended.append, interval=0.05).start()
    time.sleep(1.2)  # a start-up longer than a step's limit
    assert ended == []
    dog.progress("step 1", 1)
    dog.limit("step")
    with dog.limited("save"):
        dog.doing("saving the checkpoint of step 1", 1)
        time.sleep(1.2)  # a save longer than a step's limit, within its own
        assert ended == []
        dog.progress("the save of step 1", 1)
    dog.doing("step 2: forward, backward, gradient reduction, optimizer", 1)
    wait_until(lambda: ended)  # back under the step's limit
    dog.stop()
    stream.seek(0)
    out = stream.read()
    assert "(step: resilience.hang_timeout_minutes=0.01): at step 1, step 2:" in out, out

    stream, ended = open(tmp_path / "rank0-save.log", "w+"), []
    dog = Watchdog(limits, rank=0, world_size=1, heartbeats=None, stream=stream, end=ended.append, interval=0.05).start()
    dog.limit("step")
    with dog.limited("save"):
        dog.doing("saving the checkpoint of step 4", 4)
        wait_until(lambda: ended)
    dog.stop()
    stream.seek(0)
    out = stream.read()
    assert "(save: resilience.save_timeout_minutes=0.04): at step 4, saving the checkpoint of step 4" in out, out
    with pytest.raises(ValueError, match="unknown kind"):
        dog.limit("evaluation")


FLIGHT_RECORDER = """
import json, sys, torch, torch.distributed as dist
from pretrain.resilience.watchdog import flight_recorder_status
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(50):
    dist.all_reduce(torch.ones(4))
print(json.dumps([flight_recorder_status(with_last=False), flight_recorder_status()]))
"""


def test_heartbeats_read_the_flight_recorders_counters_and_its_last_entry_only_when_asked():
    """A heartbeat reads the counters alone (the whole recorder is ~1 MB of JSON to parse at its 2,000
    entries); the rank's own account at the end reads the last collective too."""
    from distributed import REPO, child_env, run_python

    done = run_python(["-c", FLIGHT_RECORDER], child_env(dict(TORCH_FR_BUFFER_SIZE="2000", PYTHONPATH=str(REPO))),
                      timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    counters_only, with_last = json.loads(done.stdout.splitlines()[-1])
    assert counters_only == [{"0": [50, 50]}, ""]
    assert with_last == [{"0": [50, 50]}, "gloo:all_reduce (collective #50 of process group 0, sizes [[4]], completed)"]
