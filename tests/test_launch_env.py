"""Rank discovery for every launcher: torchrun/deepspeed variables, SLURM, and mpirun (mpi4py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import REPO, free_port
from pretrain.parallel import _first_slurm_host, discover_launch_env


def test_torchrun_variables():
    env = discover_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5",
                               "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "10.0.0.5", 1234)


def test_slurm_variables():
    env = discover_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                               "SLURM_JOB_NODELIST": "gpu[07-08,11]", "MASTER_PORT": "4000"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        5, 8, 1, "gpu07", 4000, "slurm")


@pytest.mark.parametrize("nodelist,first", [("node[03-05,07],gpu1", "node03"), ("gpu1,gpu2", "gpu1"),
                                            ("a-b12", "a-b12"), ("n[9]", "n9")])
def test_slurm_nodelist(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_single_process_default():
    env = discover_launch_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_mpirun_two_ranks(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.fail(f"{mpiexec} missing: the project installs the mpich runtime from PyPI")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, "-m", "pretrain", "--config", "configs/bert-tiny.yaml",
         "model.vocab_size=1000", "parallel.tensor_parallel=2", "train.train_steps=2", "scheduler.warmup_steps=1",
         "train.log_interval=1", "train.global_batch_size=4", "train.micro_batch_size=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2" in result.stdout
