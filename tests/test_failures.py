"""Jobs that heal, and jobs that must not: through launcher.sh --max-restarts, a rank killed mid-run
(what the OOM killer or a lost node does) makes the launcher start the job again, which resumes from
its last checkpoint and finishes; non-finite training is not restarted (it would diverge again) and
ends with its error and the launcher's reason. Without restarts a killed rank ends the job non-zero
(tests/test_multinode.py, across two nodes); a frozen one is ended by the watchdog (test_hangs.py).
The two jobs run side by side."""
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from distributed import REPO, free_port
from _train_worker import TINY

pytestmark = pytest.mark.slow


def launch_job(tmp_path, launcher, overrides, log_name, restarts):
    """launcher.sh pretraining with 2 ranks (TP2), checkpointing every 2 steps into tmp_path/ckpt."""
    ckpt = tmp_path / "ckpt"
    overrides = TINY + ["data.num_workers=2", "parallel.tensor_parallel=2", "checkpoint.save_interval=2", f"checkpoint.save_dir={ckpt}",
                        f"checkpoint.load_dir={ckpt}", "resilience.dist_timeout_minutes=0.5", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(tmp_path / log_name, "w")
    return subprocess.Popen(["bash", "launcher.sh", "--launcher", launcher, "--nproc-per-node", "2", "--master-port",
                             str(free_port(span=restarts + 1)), "--max-restarts", str(restarts), "pretrain", "--config",
                             "configs/bert-tiny.yaml", *overrides],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def rank_process(launcher_proc, rank):
    for child in psutil.Process(launcher_proc.pid).children(recursive=True):
        try:
            if "pretrain" in child.cmdline() and child.environ().get("RANK") == str(rank):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher")


def stop_tree(job):
    if job.poll() is None:
        for child in psutil.Process(job.pid).children(recursive=True):
            child.kill()
        job.kill()
        job.wait()


def killed_and_restarted(tmp_path):
    """DeepSpeed's launcher (which has no restarts of its own): rank 1 killed after the first save."""
    job = launch_job(tmp_path, "deepspeed", ["train.train_steps=30"], "killed.log", restarts=1)
    log = tmp_path / "killed.log"
    try:
        deadline = time.monotonic() + 300
        while "saved checkpoint" not in log.read_text():
            assert time.monotonic() < deadline and job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        rank_process(job, 1).kill()
        return job.wait(timeout=400), log.read_text()
    finally:
        stop_tree(job)


def diverged(tmp_path):
    """A learning rate that makes every step non-finite: NonFiniteTraining after 2 in a row."""
    job = launch_job(tmp_path, "torchrun", ["train.train_steps=30", "optimizer.lr=1e30", "optimizer.grad_clip=0",
                                            "resilience.max_consecutive_skips=2"], "diverged.log", restarts=2)
    try:
        return job.wait(timeout=400), (tmp_path / "diverged.log").read_text()
    finally:
        stop_tree(job)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    with ThreadPoolExecutor(2) as pool:  # a 2-rank job keeps 2 cores about half busy
        killed = pool.submit(killed_and_restarted, tmp_path_factory.mktemp("killed"))
        nonfinite = pool.submit(diverged, tmp_path_factory.mktemp("diverged"))
        return {"killed": killed.result(), "diverged": nonfinite.result()}


def test_killed_rank_restarts_the_job_which_resumes_and_finishes(jobs):
    code, log = jobs["killed"]
    assert code == 0, log[-4000:]
    assert "launcher.sh: the job failed" in log and "restart 1 of 1, resuming from the latest checkpoint" in log, log[-4000:]
    resumed = log.split("resumed from")[1]
    step = int(resumed.split("at step ")[1].split(" ")[0])
    assert step >= 2 and "step 30/30" in resumed, log[-4000:]
    assert f"step {step}/" not in resumed  # nothing before the checkpoint was trained again


def test_nonfinite_training_is_not_restarted(jobs):
    code, log = jobs["diverged"]
    assert code != 0, log[-4000:]
    assert "non-finite" in log and "launcher.sh: not restarting: a restart would fail the same way" in log, log[-4000:]
    assert "restart 1 of" not in log
