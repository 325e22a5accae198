"""launcher.sh starts N ranks on this node with torchrun or the deepspeed launcher, prints the
command it runs, and refuses an invalid config before starting anything."""
import os
import subprocess

import pytest

from distributed import REPO, free_port

COMMON = ["--config", "configs/bert-tiny.yaml", "model.vocab_size=1000", "train.train_steps=2",
          "scheduler.warmup_steps=1", "train.log_interval=1", "train.global_batch_size=8", "train.micro_batch_size=2"]


def launch(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(["bash", str(REPO / "launcher.sh"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("launcher,layout", [("torchrun", "parallel.tensor_parallel=2"),
                                             ("deepspeed", "parallel.pipeline_parallel=2")])
def test_launch_two_ranks(launcher, layout):
    result = launch("--launcher", launcher, "--nproc-per-node", "2", "--master-port", str(free_port()),
                    "pretrain", *COMMON, layout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert printed and ("torch.distributed.run" in printed[0] if launcher == "torchrun" else "deepspeed" in printed[0])
    assert "step 2/2" in result.stdout


def test_invalid_config_is_refused_before_launch():
    result = launch("--nproc-per-node", "2", "pretrain", *COMMON, "parallel.tensor_parallel=3",
                    "train.micro_batch_size=3")
    assert result.returncode == 2
    errors = result.stderr
    assert "model.num_attention_heads (2) must be divisible by parallel.tensor_parallel (3)" in errors
    assert "world size (2) must be a positive multiple" in errors
    assert "+ " not in result.stdout  # nothing was launched
