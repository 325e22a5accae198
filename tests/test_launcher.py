"""launcher.sh starts N ranks on this node with torchrun or the deepspeed launcher, prints the
command it runs, and refuses an invalid config before starting anything."""
import glob
import os
import re
import socket
import subprocess
import sys

import pytest

from distributed import REPO, free_port

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

COMMON = ["--config", "configs/bert-tiny.yaml", "model.vocab_size=1000", "train.train_steps=2",
          "scheduler.warmup_steps=1", "logging.interval=1", "train.global_batch_size=8", "train.micro_batch_size=2"]


def launch(*args, timeout=300, **extra_env):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra_env)
    return subprocess.run(["bash", str(REPO / "launcher.sh"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_launch_two_ranks_with_deepspeed():
    """The deepspeed launcher (torchrun, the default: tests/test_first_run.py and the multi-node tests)."""
    port = free_port()
    result = launch("--launcher", "deepspeed", "--nproc-per-node", "2", "--master-port", str(port),
                    "pretrain", *COMMON, "parallel.pipeline_parallel=2", "parallel.zero_stage=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # DeepSpeed's CPU shared-memory all-reduce (its launcher sets LOCAL_SIZE) would leave a 69 MB file
    # per rank in /dev/shm: the ranks start DeepSpeed's backend without it (pretrain/distributed/parallel.py)
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    assert not left, left
    printed = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
    assert printed and "deepspeed" in printed[0]
    assert "step 2/2" in result.stdout
    # DeepSpeed's CPU-only chatter (pretrain/common/quiet.py) is not printed by the ranks; DeepSpeed's
    # own launcher process still logs its accelerator line
    output = result.stdout + result.stderr
    assert "built successfully" not in output, output[-3000:]
    # nor any other library warning of the ranks (at ZeRO-1: DeepSpeed's "untested optimizer"; issue 36)
    warned = [line for line in output.splitlines() if re.search(r"\b\w*Warning\b|warnings\.warn\(|\[WARNING\]", line)
              and not re.search(r"Setting accelerator to CPU|\[runner\.py:", line)]  # the deepspeed launcher's own process
    assert not warned, "\n".join(warned[:10])


def test_invalid_config_is_refused_before_launch():
    result = launch("--nproc-per-node", "2", "pretrain", *COMMON, "parallel.tensor_parallel=3",
                    "train.micro_batch_size=3")
    assert result.returncode == 2
    errors = result.stderr
    assert "model.num_attention_heads (2) must be divisible by parallel.tensor_parallel (3)" in errors
    assert "world size (2) must be a positive multiple" in errors
    assert "+ " not in result.stdout  # nothing was launched


def test_a_failed_job_ends_with_the_rank_s_own_error(tmp_path):
    """A rank that fails on bad input prints its one-line error (a tool's here: pretraining's ranks
    report through the same run_command); torchrun's ChildFailedError traceback and report box give
    way to one line per failed rank, and the launcher repeats the rank's error as the last line."""
    missing = tmp_path / "missing"
    result = launch("--master-port", str(free_port()), "tool", "tools/convert_checkpoint.py", "native-to-hf",
                    "--input", str(missing), "--output", str(tmp_path / "hf"))
    error = f"{missing}: no such checkpoint directory"
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert f"convert_checkpoint: error: {error}" in lines  # the rank's own line
    assert any(re.fullmatch(r"torchrun: rank 0 \(local rank 0, pid \d+, .+\) exited with status 1", line)
               for line in lines), lines
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr
    assert lines[-1] == f"launcher.sh: the job failed (exit 1): {error}"


def test_torchrun_names_a_killed_rank_in_one_line():
    from types import SimpleNamespace

    from pretrain.resilience.torchrun import describe

    killed = SimpleNamespace(local_rank=1, pid=42, exitcode=-9, signal_name=lambda: "SIGKILL")
    assert re.fullmatch(r"rank 3 \(local rank 1, pid 42, .+\) was killed by SIGKILL", describe(3, killed))


def test_a_failed_rank_tells_the_launcher_its_error(tmp_path, monkeypatch, capsys):
    """What the launcher repeats: the printing process's error, in the status directory under its
    rank, also for a program that starts no process group (a tool)."""
    from pretrain.cli import run_command
    from pretrain.common.errors import UserError

    def bad_input(args):
        raise UserError("data.vocab_file x.txt:\n  line 3 is empty")

    monkeypatch.setenv("BERT_LAUNCH_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    assert run_command(lambda argv: None, bad_input, [], name="tool") == 1
    assert capsys.readouterr().err == "tool: error: data.vocab_file x.txt:\n  line 3 is empty\n"
    assert (tmp_path / "rank-2").read_text() == "failed data.vocab_file x.txt: line 3 is empty\n"


def test_dry_run_commands(tmp_path):
    """Multi-node command lines as printed (and not run) for every launcher, from one hostfile."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=2\nnode-b slots=2  # the second\n")
    expected = {
        ("torchrun", "--node-rank", "1"): "python -m pretrain.resilience.torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 "
                                          "--master-addr node-a --master-port 29500 -m pretrain",
        ("deepspeed", "--node-rank", "0"): f"deepspeed --hostfile {hostfile} --no_ssh --node_rank 0 --master_addr "
                                           "node-a --master_port 29500 --module pretrain",
        ("deepspeed",): f"deepspeed --hostfile {hostfile} --master_addr node-a --master_port 29500 --module pretrain",
        ("mpirun",): "-n 4 -ppn 2 -genv MASTER_ADDR node-a -hosts node-a\\,node-b python -m pretrain",
    }
    for (launcher, *extra), command in expected.items():
        result = launch("--launcher", launcher, "--hostfile", str(hostfile), *extra, "--dry-run", "pretrain", *COMMON,
                        "parallel.tensor_parallel=2")
        assert result.returncode == 0, result.stderr
        printed = [line for line in result.stdout.splitlines() if line.startswith("+ ")]
        assert len(printed) == 1 and command in printed[0], (printed, command)
        assert "valid for 4 rank(s)" in result.stdout  # the config was checked for the whole job's world size
    result = launch("--launcher", "slurm", "--nnodes", "4", "--nproc-per-node", "8", "--dry-run", "pretrain", *COMMON,
                    "train.global_batch_size=64")
    assert "+ srun --mpi=none --nodes 4 --ntasks-per-node 8 --kill-on-bad-exit=1 python -m pretrain" in result.stdout


FAKE_NVIDIA_SMI = "#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: Stand-in (UUID: GPU-$i)\"; done\n"


def test_gpu_count_follows_cuda_visible_devices(tmp_path):
    """Four GPUs on the node (a stand-in nvidia-smi), two of them visible: two ranks by default,
    DeepSpeed told which two (its --num_gpus would drop CUDA_VISIBLE_DEVICES and take GPUs 0-1),
    tools single-process, and more ranks than visible GPUs refused."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"

    def dry(*args, visible="1,3"):
        env = dict(os.environ, PATH=path, PYTHONPATH=str(REPO))
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        result = subprocess.run(["bash", str(REPO / "launcher.sh"), *args], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120)
        return result, [line for line in result.stdout.splitlines() if line.startswith("+ ")]

    result, printed = dry("--dry-run", "pretrain", *COMMON)
    assert "--nproc-per-node 2 " in printed[0] and "valid for 2 rank(s)" in result.stdout
    result, printed = dry("--launcher", "deepspeed", "--dry-run", "pretrain", *COMMON)
    assert "deepspeed --include localhost:1\\,3 --master_addr" in printed[0] and "--num_gpus" not in printed[0]
    result, printed = dry("--dry-run", "pretrain", *COMMON, visible=None)
    assert "--nproc-per-node 4 " in printed[0]
    result, printed = dry("--dry-run", "tool", "tools/inspect_dataset.py", "--help")
    assert "--nproc-per-node 1 " in printed[0]
    result, printed = dry("--nproc-per-node", "3", "--dry-run", "pretrain", *COMMON)
    assert result.returncode == 2 and not printed
    assert "--nproc-per-node 3 but this node sees 2 GPU(s) (CUDA_VISIBLE_DEVICES=1,3)" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--launcher", "torchrun", "--nnodes", "2"], "torchrun across 2 nodes needs --node-rank"),
    (["--launcher", "torchrun", "--nnodes", "2", "--node-rank", "1"], "needs --master-addr"),
    (["--launcher", "deepspeed", "--nnodes", "2", "--node-rank", "0"], "deepspeed across 2 nodes needs --hostfile"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a"], "--node-rank 2 is not below --nnodes 2"),
    (["--nproc-per-node", "two"], "--nproc-per-node must be a non-negative integer, got 'two'"),
    (["--hostfile", "/nonexistent/hosts"], "hostfile '/nonexistent/hosts' not found"),
    (["--hostfile", "BAD"], "line 2: expected 'HOSTNAME slots=K', got 'node-b 2'"),
    (["--hostfile", "UNEVEN"], "line 2: every node needs the same slots (found 2 and 4)"),
    (["--launcher", "slurm", "--hostfile", "UNEVEN"], None),
    (["--launcher", "pdsh"], "unknown launcher 'pdsh'"),
])
def test_bad_launch_options(tmp_path, args, message):
    (tmp_path / "BAD").write_text("node-a slots=2\nnode-b 2\n")
    (tmp_path / "UNEVEN").write_text("node-a slots=2\nnode-b slots=4\n")
    args = [str(tmp_path / a) if a in ("BAD", "UNEVEN") else a for a in args]
    result = launch(*args, "--dry-run", "pretrain", *COMMON)
    assert result.returncode == 2
    assert "+ " not in result.stdout
    if message is not None:
        assert message in result.stderr, result.stderr


def test_help_is_the_header_comment():
    result = launch("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("Launch pretraining") and "hostfile is DeepSpeed's format" in result.stdout
    assert "set -euo" not in result.stdout and "#" not in result.stdout.splitlines()[0]


def test_environment_reaching_every_node(tmp_path):
    """What DeepSpeed's ssh mode exports to the other nodes (the file launcher.sh writes, read by a
    stand-in `deepspeed`): the NCCL/CUDA/fabric settings a GPU cluster needs, nothing else."""
    stub = tmp_path / "deepspeed"
    stub.write_text('#!/bin/sh\ncat "$DS_ENV_FILE"\n')
    stub.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    passed = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "FI_PROVIDER": "efa", "UCX_TLS": "rc",
              "LD_LIBRARY_PATH": "/opt/nccl/lib", "CUDA_LAUNCH_BLOCKING": "1", "NCCL_IB_HCA": "mlx5",
              "BERT_FAKE_GPU": "1"}
    # VIRTUAL_ENV set: launcher.sh then leaves PATH alone, and the stand-in comes first on it
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=sys.prefix, UNRELATED_SETTING="x", **passed)
    env.pop("DS_ENV_FILE", None)
    result = subprocess.run(["bash", str(REPO / "launcher.sh"), "--launcher", "deepspeed", "--hostfile", str(hostfile),
                             "pretrain", *COMMON], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    exported = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line and not line.startswith("+"))
    for name, value in passed.items():
        assert exported.get(name) == value, (name, sorted(exported))
    assert "UNRELATED_SETTING" not in exported


def test_one_node_takes_a_free_rendezvous_port_and_refuses_a_named_one_in_use():
    """Two single-node launches without --master-port both took torchrun's 29500 (the second died
    in EADDRINUSE's traceback): on one node an unnamed port is a free one, taken anew per launch,
    and a named port in use (flag or MASTER_PORT) is one line naming --master-port."""
    held = socket.socket()
    held.bind(("", 0))
    held.listen()
    port = held.getsockname()[1]
    default = socket.socket()
    try:
        default.bind(("", 29500))  # torchrun's default taken, as by a first job
        default.listen()
    except OSError:
        pass  # taken already
    try:
        for result in (launch("--master-port", str(port), "--dry-run", "pretrain", *COMMON),
                       launch("--dry-run", "pretrain", *COMMON, MASTER_PORT=str(port))):
            assert result.returncode == 2, result.stdout
            assert result.stderr.strip() == (f"launcher.sh: --master-port {port} is in use on this node (another "
                                             "job's rendezvous?): name a free port, or leave --master-port (and "
                                             "MASTER_PORT) out to take a free one")
        chosen = []
        for _ in range(2):
            result = launch("--dry-run", "pretrain", *COMMON)
            assert result.returncode == 0, result.stderr
            chosen += [int(p) for p in re.findall(r"--master-port (\d+)", result.stdout)]
        assert len(chosen) == 2 and chosen[0] != chosen[1] and not {port, 29500} & set(chosen), chosen
        # a real launch beside the held ports: its rendezvous starts and the tool runs
        result = launch("tool", "tools/inspect_dataset.py", "--help")
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout and re.search(r"--master-port (\d+)", result.stdout)
    finally:
        held.close()
        default.close()
