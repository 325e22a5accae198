"""A rank that dies or hangs makes the other ranks exit non-zero within a bounded time."""
import os
import signal
import subprocess
import sys
import time

import pytest

from distributed import REPO, free_port
from _train_worker import TINY


def start_job(tmp_path, world=2):
    port = free_port()
    overrides = TINY + ["train.train_steps=100000", "scheduler.warmup_steps=1", "parallel.tensor_parallel=2",
                        "train.dist_timeout_minutes=0.5"]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "pretrain", "--config", "configs/bert-tiny.yaml",
                                       *overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for_training(tmp_path, procs, timeout=300):
    deadline = time.monotonic() + timeout
    while "step 2/" not in (tmp_path / "rank0.log").read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (tmp_path / "rank0.log").read_text()
        time.sleep(0.5)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_survivor_exits_nonzero(tmp_path, how):
    procs = start_job(tmp_path)
    try:
        wait_for_training(tmp_path, procs)
        os.kill(procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        code = procs[0].wait(timeout=120)
        assert code != 0
        assert time.monotonic() - started < 120
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
