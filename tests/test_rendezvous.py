"""Start-up names what is missing: a rank that never starts makes the others end within
resilience.rendezvous_timeout_minutes, naming it (and rank 0's absence, which leaves no store to join,
is named by the ranks that wait for it). The watchdog's judgement of who is stuck, from heartbeats."""
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from distributed import REPO, free_port
from _train_worker import TINY
from pretrain.distributed.rendezvous import describe_missing
from pretrain.resilience.watchdog import stuck_ranks


def start_alone(rank: int, world: int = 2) -> tuple[int, str, float]:
    """Start only rank `rank` of a `world`-rank job: (exit status, output, seconds)."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="1")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY,
                           "resilience.rendezvous_timeout_minutes=0.1"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    return done.returncode, done.stderr, time.monotonic() - started


@pytest.mark.slow
def test_missing_ranks_are_named_within_the_rendezvous_timeout():
    with ThreadPoolExecutor(2) as pool:
        without_1, without_0 = pool.map(start_alone, (0, 1))
    code, err, seconds = without_1
    assert code == 1 and seconds < 60, err[-3000:]
    assert "rank(s) 1 (node 1: the launch with --node-rank 1) did not join; 1 joined from" in err, err[-3000:]
    assert "Traceback" not in err
    code, err, seconds = without_0
    assert code == 1 and seconds < 60, err[-3000:]
    assert "rank 1 on" in err and "(served by rank 0" in err and "rank 0 did not start" in err, err[-3000:]


def test_missing_rank_names_its_node_when_the_launcher_says_ranks_per_node():
    assert describe_missing([5], {0: "a pid 1"}, {"LOCAL_WORLD_SIZE": "4"}) == \
        "rank(s) 5 (node 1: the launch with --node-rank 1) did not join; 1 joined from a"
    assert describe_missing([1, 2], {0: "a pid 1"}, {}) == "rank(s) 1, 2 did not join; 1 joined from a"


def beat(count, step=3, phase="data", **groups):
    return {"beat": count, "step": step, "phase": phase, "pid": 10, "host": "h",
            "collectives": {pg: [n, n - 1] for pg, n in groups.items()}}


def test_stuck_rank_is_the_silent_one_else_the_one_behind():
    before = {0: beat(5, g0=9), 1: beat(7, g0=8)}
    # rank 1's heartbeat stopped: it is named, whatever the collectives say
    stuck, lines = stuck_ranks(before, {0: beat(8, g0=9), 1: beat(7, g0=8)}, 2)
    assert stuck == [1] and "heartbeat stopped" in lines[0]
    # both alive: rank 1 entered fewer collectives of group g0 than rank 0
    stuck, lines = stuck_ranks(before, {0: beat(8, g0=9), 1: beat(9, g0=8)}, 2)
    assert stuck == [1] and "entered collective #8, others #9" in lines[0]
    # a rank that never published, and a job where nobody is behind
    assert stuck_ranks({}, {0: beat(1, g0=3)}, 2)[0] == [1]
    stuck, lines = stuck_ranks(before, {0: beat(8, g0=9), 1: beat(9, g0=9)}, 2)
    assert stuck == [] and "every rank waits at the same place" in lines[0]
