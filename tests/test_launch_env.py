"""Rank discovery for every launcher: torchrun/deepspeed variables, SLURM, and mpirun (mpi4py)."""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LAUNCH_KEYS
from distributed import REPO, free_port
from pretrain.distributed.device import prepare_extensions_dir
from pretrain.distributed.parallel import LaunchEnv, _first_slurm_host, discover_launch_env, init_parallel, shutdown_parallel


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


def test_srun_pmi_variables_with_an_mpi_that_sees_one_rank(monkeypatch):
    """Under a real srun with a PMI plugin, an MPI library that cannot speak it reports rank 0 of
    1 in every task: SLURM's own variables must win then, or all tasks write one save_dir."""
    import pretrain.distributed.parallel as parallel

    lone = parallel.LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "mpi")
    monkeypatch.setattr(parallel, "_mpi_launch_env", lambda env: lone)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "3",
             "SLURM_JOB_NODELIST": "n1", "PMIX_RANK": "0"}
    env = discover_launch_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (3, 4, 3, "slurm")
    # mpirun -np 1 from a batch script of an 8-task allocation (no srun step): one process, as MPI says
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1", "PMI_SIZE": "1"}
    assert discover_launch_env(batch) == lone
    # mpirun inside an allocation: MPI sees the whole job and is believed
    whole = parallel.LaunchEnv(2, 4, 2, "n1", 29500, "mpi")
    monkeypatch.setattr(parallel, "_mpi_launch_env", lambda env: whole)
    assert discover_launch_env(dict(slurm, SLURM_NTASKS="1", SLURM_PROCID="0")) == whole


def test_single_process_default():
    env = discover_launch_env({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single")


def test_single_process_port_is_free_while_a_job_holds_29500():
    """A tool run beside a launched job (which listens on the default 29500) must not collide."""
    import socket

    with socket.socket() as job:
        job.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            job.bind(("127.0.0.1", 29500))
        except OSError:
            pass  # already held by a real job: the same situation
        job.listen()
        port = discover_launch_env({}).master_port
        assert port != 29500
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
    assert discover_launch_env({"MASTER_PORT": "1234"}).master_port == 1234



def test_free_ports_come_from_outside_the_kernels_ephemeral_range():
    """A port the kernel handed out (bind to 0) may go to any outgoing connection once released:
    CI lost a job to EADDRINUSE that way. Ours come from below the ephemeral range, all `span` free."""
    import socket

    from pretrain.distributed.ports import ephemeral_range

    low, high = ephemeral_range()
    for span in (1, 3):
        for _ in range(20):
            port = free_port(span=span)
            assert port + span - 1 < low or port > high, (port, low, high)
            for k in range(span):
                with socket.socket() as probe:
                    probe.bind(("", port + k))


def test_free_port_skips_ports_in_use_and_reads_the_range(tmp_path, monkeypatch):
    import socket

    from pretrain.distributed import ports

    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("20000\t60999\n")
    assert ports.ephemeral_range(str(range_file)) == (20000, 60999)
    assert ports.ephemeral_range(str(tmp_path / "missing")) is None
    draws = iter(range(0, 10000))
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: next(draws))
    with socket.socket() as job:  # someone's store on the first candidate
        try:
            job.bind(("", ports.LOWEST_PORT))
        except OSError:
            pass  # already taken on this machine: the same situation
        job.listen()
        port = ports.free_port(range_file=str(range_file))
    assert ports.LOWEST_PORT < port < 20000
    range_file.write_text("1024 65535\n")  # no gap left: the kernel's pick
    assert ports.free_port(range_file=str(range_file)) >= 1024

def test_a_picker_never_hands_out_one_port_twice(monkeypatch):
    """Jobs started side by side (a sweep's slots, the signal tests' six launches) draw before any
    binds: independent draws repeated a port about once in 20,000 pairs and the second job died of
    EADDRINUSE. Draws forced to repeat: the picker still returns distinct, non-overlapping spans,
    from threads too."""
    from concurrent.futures import ThreadPoolExecutor

    from pretrain.distributed import ports

    draws = iter([5, 5, 5, 6, 6, 7, 8, 9, 10, 11, 12, 13] + list(range(20, 10000)))
    monkeypatch.setattr(ports.secrets, "randbelow", lambda n: next(draws))
    pick = ports.PortPicker()
    first, second = pick(), pick()
    assert first == ports.LOWEST_PORT + 5 and second == ports.LOWEST_PORT + 6  # the repeated 5 skipped
    block = pick(span=3)
    assert not {first, second} & set(range(block, block + 3))
    assert pick() >= block + 3  # nothing inside the span either
    monkeypatch.undo()
    with ThreadPoolExecutor(8) as pool:
        drawn = list(pool.map(lambda _: pick(), range(400)))
    assert len(set(drawn)) == 400


def test_extensions_are_built_in_the_environment_unless_the_user_chose(tmp_path):
    environ = {}
    prepare_extensions_dir(environ)
    assert environ == {"TORCH_EXTENSIONS_DIR": os.path.join(sys.prefix, "torch_extensions")}
    chosen = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    prepare_extensions_dir(chosen)
    assert chosen == {"TORCH_EXTENSIONS_DIR": str(tmp_path)}


def test_export_to_writes_exactly_the_launch_variables():
    environ = {"PATH": "/bin", "RANK": "0"}
    LaunchEnv(5, 8, 1, "gpu07", 4000, "slurm").export_to(environ)
    assert environ == {"PATH": "/bin", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                       "MASTER_PORT": "4000"}


def gloo_event_loops() -> int:
    """Threads of this process running a gloo transport device's event loop."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return names.count("gloo_tcp_loop")


def test_init_parallel_leaves_the_environment_alone(monkeypatch):
    """The rendezvous comes from the LaunchEnv argument; exporting it is the caller's visible step."""
    for key in LAUNCH_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    before = dict(os.environ)
    loops_before = gloo_event_loops()
    parallel = init_parallel(LaunchEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), 1, 1, timeout_minutes=1)
    try:
        assert (parallel.rank, parallel.world_size, parallel.tp_size, parallel.dp_size) == (0, 1, 1, 1)
        # megatron-core's groups (18 here) share one gloo device, so one event-loop thread that
        # wakes every 10 ms instead of one per group (none more if an earlier test made it)
        import torch
        import torch.distributed as dist

        assert len(dist.distributed_c10d._world.pg_map) > 10
        assert gloo_event_loops() - loops_before <= 1, gloo_event_loops() - loops_before
        total = torch.ones(2)
        dist.all_reduce(total, group=parallel.tp_group)
        assert total.tolist() == [1.0, 1.0]
        # DeepSpeed's CPU shared-memory inference op is not built (30-40 s of compiling; training never
        # calls it): neither here nor in a job of several ranks (test_launcher.py: no /dev/shm buffer)
        from pretrain.distributed.internals import uses_shared_memory_comm

        assert not uses_shared_memory_comm()
        assert [key for key in LAUNCH_KEYS if key in os.environ] == []
        # nothing else of ours either (torch and DeepSpeed add their own on first import)
        assert {key: os.environ.get(key) for key in before} == before
    finally:
        shutdown_parallel()


JOB = ["pretrain", "--config", "configs/bert-tiny.yaml", "model.vocab_size=1000", "parallel.tensor_parallel=2",
       "train.train_steps=2", "scheduler.warmup_steps=1", "logging.interval=1", "train.global_batch_size=4",
       "train.micro_batch_size=2"]

# Stand-in for SLURM's srun on a machine without SLURM: starts --nodes x --ntasks-per-node tasks
# of the command with the variables srun gives each task (and none of torchrun's), waits for all.
FAKE_SRUN = r"""#!/usr/bin/env python3
import os, subprocess, sys
args = sys.argv[1:]
nodes = tasks = 1
mpi = "pmix"  # a site default that sets PMIx variables in every task, as a real srun does
while args[0].startswith("--"):
    flag = args.pop(0)
    if flag == "--nodes": nodes = int(args.pop(0))
    elif flag == "--ntasks-per-node": tasks = int(args.pop(0))
    elif flag.startswith("--mpi="): mpi = flag.split("=", 1)[1]
    elif flag != "--kill-on-bad-exit=1": sys.exit(f"fake srun: unexpected {flag}")
assert nodes == 1, "one machine: one node"
assert mpi == "none", "launcher.sh must start tasks without a PMI plugin"
base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
procs = [subprocess.Popen(args, env=dict(base, SLURM_PROCID=str(t), SLURM_LOCALID=str(t), SLURM_NODEID="0",
                                         SLURM_NTASKS=str(tasks), SLURM_JOB_NUM_NODES="1",
                                         SLURM_JOB_NODELIST="localhost")) for t in range(tasks)]
import signal  # srun forwards SIGINT and SIGTERM to every task and keeps waiting for them
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda number, frame: [p.send_signal(number) for p in procs if p.poll() is None])
sys.exit(max(p.wait() for p in procs))
"""


def launch(launcher, extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", **extra_env)
    return subprocess.run(["bash", "launcher.sh", "--launcher", launcher, "--nproc-per-node", "2", "--master-port",
                           str(free_port()), *JOB], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_mpirun_two_ranks():
    """launcher.sh --launcher mpirun runs the venv's MPICH mpiexec; ranks come from mpi4py."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.fail(f"{mpiexec} missing: the project installs the mpich runtime from PyPI")
    result = launch("mpirun", {})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"+ {mpiexec} -n 2 -ppn 2" in result.stdout
    assert "step 2/2" in result.stdout


