"""A rank that dies or hangs makes the other ranks exit non-zero within a bounded time; through
launcher.sh the whole job exits non-zero, and launching it again resumes from the last checkpoint."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from distributed import REPO, free_port
from _train_worker import TINY

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier


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


def launch_job(tmp_path, launcher, steps, log_name):
    """launcher.sh pretraining with 2 ranks (TP2), checkpointing every 2 steps into tmp_path/ckpt."""
    ckpt = tmp_path / "ckpt"
    overrides = TINY + [f"train.train_steps={steps}", "parallel.tensor_parallel=2", "train.save_interval=2",
                        f"train.save_dir={ckpt}", f"train.load_dir={ckpt}", "train.dist_timeout_minutes=0.5"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen(["bash", "launcher.sh", "--launcher", launcher, "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "pretrain", "--config", "configs/bert-tiny.yaml", *overrides],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def rank_process(launcher_proc, rank):
    for child in psutil.Process(launcher_proc.pid).children(recursive=True):
        try:
            if "pretrain" in child.cmdline() and child.environ().get("RANK") == str(rank):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher")


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_killed_rank_fails_the_job_and_relaunch_resumes(tmp_path, launcher):
    job = launch_job(tmp_path, launcher, 100000, "first.log")
    log = tmp_path / "first.log"
    try:
        deadline = time.monotonic() + 300
        while "saved checkpoint" not in log.read_text():
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        rank_process(job, 1).kill()
        started = time.monotonic()
        code = job.wait(timeout=120)
        assert code != 0, log.read_text()[-3000:]
        assert time.monotonic() - started < 120
    finally:
        if job.poll() is None:
            for child in psutil.Process(job.pid).children(recursive=True):
                child.kill()
            job.kill()
            job.wait()
    saved = int((tmp_path / "ckpt" / "latest").read_text().strip().split("_")[-1])
    assert saved >= 2
    again = launch_job(tmp_path, launcher, saved + 2, "second.log")
    assert again.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    second = (tmp_path / "second.log").read_text()
    assert f"at step {saved} " in second and f"step {saved + 2}/{saved + 2}" in second, second[-3000:]
    assert f"step {saved}/" not in second  # nothing before the checkpoint was trained again
