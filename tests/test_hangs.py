"""A frozen process ends the job within resilience.hang_timeout_minutes plus a minute, at the default
collective timeout (10 minutes), with a diagnosis: the watchdog's line naming the stuck rank, the
loader process states, and every thread's stack (faulthandler's format) of each rank that can still
write. Three DP2 jobs side by side, the pretraining ones at the default data.num_workers:
- frozen-worker: one loader process of rank 1 stopped with SIGSTOP (a fork deadlock looks like that
  from outside): rank 1 waits for its batch, rank 0 for rank 1 in the gradient all-reduce;
- frozen-rank: rank 1 itself stopped: rank 0 waits in a collective, rank 1 writes nothing;
- frozen-finetuning: the same in fine-tuning (python -m finetune), which has its own watchdog.
"""
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from distributed import REPO, free_port, start_python
from _train_worker import TINY
from test_finetune_tasks import QUIET, repeat_task, tiny_bert

pytestmark = pytest.mark.slow

# a step or evaluation of the tiny models takes well under a second on a loaded 2-core machine (pretraining's
# first step, with its start-up, has its own resilience.startup_timeout_minutes)
HANG_MINUTES = 0.25
STACK_HEADER = "most recent call first"  # faulthandler: "Thread 0x... (most recent call first):"


def start_job(tmp_path, name):
    port = free_port()
    if name == "frozen-finetuning":  # 300 epochs of a small task, evaluated after each
        files = repeat_task(tmp_path, train=64, dev=16)
        command = ["-m", "finetune", "rte", *QUIET, f"model.init_from={tiny_bert(tmp_path)}", "train.epochs=300",
                   f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]", "train.global_batch_size=16",
                   "train.micro_batch_size=8", f"train.output_dir={tmp_path / 'finetuned'}", "train.keep_best=false",
                   "task.max_seq_length=12", f"train.hang_timeout_minutes={HANG_MINUTES}"]
    else:
        command = ["-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY, "data.num_workers=2",
                   "train.train_steps=100000", "scheduler.warmup_steps=1", "logging.interval=1",
                   "resilience.dist_timeout_minutes=10", f"resilience.hang_timeout_minutes={HANG_MINUTES}"]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(tmp_path / f"{name}-rank{rank}.log", "w") as log:
            procs.append(start_python(command, env, output=log))
    return procs


def loader_processes(rank_proc) -> list[psutil.Process]:
    """The loader processes of a rank: children of its forkserver (itself a child of the rank)."""
    return [worker for server in psutil.Process(rank_proc.pid).children()
            for worker in server.children()]


def freeze_and_wait(tmp_path, name):
    """Start a job, freeze its target at step 3 (fine-tuning: after epoch 2), return (seconds until
    every live rank ended, exit codes, the two logs)."""
    procs = start_job(tmp_path, name)
    logs = [tmp_path / f"{name}-rank{r}.log" for r in range(2)]
    frozen = None
    started_training = "epoch 2 |" if name == "frozen-finetuning" else "step 3/"
    try:
        deadline = time.monotonic() + 300
        while started_training not in logs[0].read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.2)
        if name == "frozen-worker":
            workers = loader_processes(procs[1])
            assert len(workers) == 2, [w.cmdline() for w in workers]  # the default data.num_workers
            frozen = workers[0]
        else:
            frozen = psutil.Process(procs[1].pid)
        frozen.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        waiting = procs if name == "frozen-worker" else procs[:1]
        limit = HANG_MINUTES * 60 + 60
        for p in waiting:
            p.wait(timeout=max(1, limit - (time.monotonic() - started)))
        return time.monotonic() - started, [p.returncode for p in waiting], [log.read_text() for log in logs], frozen.pid
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def frozen_jobs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hangs")
    for name in ("frozen-worker", "frozen-rank", "frozen-finetuning"):
        (tmp / name).mkdir()
    with ThreadPoolExecutor(3) as pool:  # a 2-rank job keeps 2 cores about half busy; a frozen one idles
        runs = {name: pool.submit(freeze_and_wait, tmp / name, name)
                for name in ("frozen-worker", "frozen-rank", "frozen-finetuning")}
        return {name: run.result() for name, run in runs.items()}


def test_frozen_loader_process_ends_the_job_naming_rank_and_wait(frozen_jobs):
    seconds, codes, (log0, log1), worker_pid = frozen_jobs["frozen-worker"]
    assert seconds < HANG_MINUTES * 60 + 60 and codes == [124, 124], (codes, log1[-3000:])
    # rank 1 says what it waits for, and which of its loader processes is stopped
    assert "watchdog: rank 1" in log1 and "data: waiting for the loader" in log1, log1[-3000:]
    assert f"loader process {worker_pid}: T (stopped)" in log1, log1[-3000:]
    assert STACK_HEADER in log1 and "_get_data" in log1, log1[-3000:]  # the DataLoader wait, in its stack
    assert "stuck rank(s): 1" in log1, log1[-3000:]
    # the other rank names rank 1 as the one it waits for (behind in the collectives)
    assert "stuck rank(s): 1" in log0 and STACK_HEADER in log0, log0[-3000:]
    assert "behind the others" in log0 and "last collective" in log0, log0[-3000:]


def test_frozen_rank_ends_the_job_naming_it(frozen_jobs):
    seconds, codes, (log0, _), _ = frozen_jobs["frozen-rank"]
    assert seconds < HANG_MINUTES * 60 + 60 and codes == [124], (codes, log0[-3000:])
    assert "stuck rank(s): 1" in log0 and "heartbeat stopped" in log0, log0[-3000:]
    assert STACK_HEADER in log0 and "watchdog: rank 0" in log0, log0[-3000:]


def test_frozen_rank_in_fine_tuning_ends_the_job_naming_it(frozen_jobs):
    seconds, codes, (log0, _), _ = frozen_jobs["frozen-finetuning"]
    assert seconds < HANG_MINUTES * 60 + 60 and codes == [124], (codes, log0[-3000:])
    assert "stuck rank(s): 1" in log0 and "heartbeat stopped" in log0, log0[-3000:]
    assert STACK_HEADER in log0 and "watchdog: rank 0" in log0, log0[-3000:]
    # where it waited: a step's gradient all-reduce, or the gather of an evaluation
    assert "forward, backward, gradient reduction" in log0 or "evaluating" in log0, log0[-3000:]
