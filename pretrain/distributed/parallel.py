"""Process groups: one init path for torchrun, the deepspeed launcher, mpirun and SLURM.

Rank layout (fastest-varying first): tensor, context, data, pipeline. megatron-core's
`initialize_model_parallel(order="tp-cp-ep-dp-pp")` and DeepSpeed's
`PipeModelDataParallelTopology` (axes pipe, data, model) both use it, DeepSpeed's data axis being
context x data (the ranks that average gradients and share ZeRO partitions, as in Megatron);
`init_parallel` asserts that the two agree, because another order silently pairs the wrong ranks.

Context parallelism (CP) splits each micro-batch's tokens over the ranks of a CP group, which
therefore read the same micro-batches: the loaders' "data parallel" is `dp_*` (which samples),
DeepSpeed's is `dp_cp_*` (which ranks hold replicas of the weights).
"""
from __future__ import annotations

import datetime
import math
import os
import re
import socket
from dataclasses import dataclass
from typing import MutableMapping

import torch
import torch.distributed as dist

from .device import backend_for, select_device
from .ports import free_port as _free_port
from .internals import one_gloo_device_per_process, without_shared_memory_comm
from ..common.quiet import without_noise_lines


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun/deepspeed", "mpi", "slurm" or "single"

    def export_to(self, environ: MutableMapping[str, str]) -> None:
        """Write the torchrun-style variables. DeepSpeed's engine, deepspeed.comm and
        PipelineModule read LOCAL_RANK, RANK and the master address from the environment, whichever
        launcher started us, so the programs export them before the process groups start."""
        environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def _mpi_launch_env(environ) -> LaunchEnv:
    from mpi4py import MPI  # imported only under mpirun: it needs an MPI runtime

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    addr = environ.get("MASTER_ADDR")
    if addr is None:
        addr = comm.bcast(socket.gethostbyname(socket.gethostname()) if rank == 0 else None, root=0)
    port = int(environ.get("MASTER_PORT", 29500))
    return LaunchEnv(rank, size, local_rank, addr, port, "mpi")


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as 'node[03-05,07],gpu1' -> 'node03'."""
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ValueError(f"cannot parse SLURM nodelist {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = match.groups()
    return prefix if ranges is None else prefix + re.split(r"[,-]", ranges)[0]


def discover_launch_env(environ=None) -> LaunchEnv:
    """Read rank and rendezvous from whichever launcher started us."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun and the deepspeed launcher
        return LaunchEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
            "torchrun/deepspeed",
        )
    slurm = "SLURM_PROCID" in env and "SLURM_NTASKS" in env
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env or "PMIX_RANK" in env:
        launch = _mpi_launch_env(env)
        # A real srun sets PMI/PMIx variables too; an MPI library that cannot speak srun's PMI
        # (pip's MPICH under PMIx) then makes every task rank 0 of 1, all writing one save_dir.
        # Inside an srun step (SLURM_STEP_NUM_TASKS exists only there) SLURM's own variables win
        # when MPI sees one rank of several; a batch script's mpirun -np 1 stays a single process.
        step_tasks = int(env.get("SLURM_STEP_NUM_TASKS", 1))
        if not (slurm and launch.world_size == 1 and step_tasks > 1):
            return launch
    if slurm:
        return LaunchEnv(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))),
            int(env.get("MASTER_PORT", 29500)),
            "slurm",
        )
    # A lone process (a tool, a test) rendezvouses with itself: any free port will do, and a fixed
    # default would collide with a job running on this machine.
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else _free_port()
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")




class DeepSpeedMPU:
    """The `mpu` object DeepSpeed asks for in non-pipeline mode: "model parallel" means TP here."""

    def __init__(self, parallel: "Parallel"):
        self._p = parallel

    def get_model_parallel_rank(self):
        return self._p.tp_rank

    def get_model_parallel_world_size(self):
        return self._p.tp_size

    def get_model_parallel_group(self):
        return self._p.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    # DeepSpeed's data parallelism: every rank holding a replica of the weights (context x data)
    def get_data_parallel_rank(self):
        return self._p.dp_cp_rank

    def get_data_parallel_world_size(self):
        return self._p.dp_cp_size

    def get_data_parallel_group(self):
        return self._p.dp_cp_group

    def get_pipeline_model_parallel_rank(self):
        return self._p.pp_rank

    def get_pipeline_model_parallel_world_size(self):
        return self._p.pp_size

    def get_pipeline_model_parallel_group(self):
        return self._p.pp_group


@dataclass
class Parallel:
    """This rank's coordinates and groups. Built once by `init_parallel`, passed explicitly."""

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    topology: object  # deepspeed PipeModelDataParallelTopology
    device: torch.device
    backend: str
    store_address: tuple[str, int] | None = None  # the job's TCPStore (rank 0's), for the watchdog's heartbeats
    # context parallelism: this rank's place in its CP group (the ranks splitting one micro-batch's
    # tokens), and the context x data group DeepSpeed averages gradients over (the DP group at CP 1)
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: object = None
    dp_cp_size: int = 1
    dp_cp_rank: int = 0
    dp_cp_group: object = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def mpu(self) -> DeepSpeedMPU:
        return DeepSpeedMPU(self)

    @property
    def logging_rank(self) -> int:
        """Global rank of (last stage, dp 0, cp 0, tp 0): it holds every metric, so it logs."""
        return self.topology.get_rank(pipe=self.pp_size - 1, data=0, model=0)


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def init_parallel(launch: LaunchEnv, tensor_parallel: int, pipeline_parallel: int,
                  timeout_minutes: float = 10.0, rendezvous_timeout_minutes: float = 10.0,
                  context_parallel: int = 1) -> Parallel:
    """Start torch.distributed (gloo on CPU, NCCL on GPU) and build the TP/CP/PP/DP groups.

    The rendezvous is `launch`'s, bounded by rendezvous_timeout_minutes (pretrain/distributed/rendezvous.py
    names the ranks that did not come); os.environ is left alone. Export `launch` first
    (LaunchEnv.export_to, as cli.run_distributed does): DeepSpeed reads LOCAL_RANK from the
    environment here on a GPU and later in its engine.
    """
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from .megatron_core import parallel_state

    from .rendezvous import join

    device = select_device(launch.local_rank)
    backend = backend_for(device)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    one_gloo_device_per_process()  # the CPU's groups; NCCL builds no gloo group
    if not dist.is_initialized():
        store = join(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                     rendezvous_timeout_minutes)
        # device_id as DeepSpeed gives it on CUDA: NCCL binds its communicators to this rank's GPU
        bound = dict(device_id=device) if device.type == "cuda" and launch.world_size > 1 else {}
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, **bound)
    # DeepSpeed's communication layer over the group just started (it starts none of its own),
    # without the CPU inference op training never calls (internals.without_shared_memory_comm)
    with without_noise_lines(), without_shared_memory_comm():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    world = dist.get_world_size()
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    if world % model_parallel:
        raise ValueError(f"world size {world} is not divisible by tensor_parallel x pipeline_parallel x "
                         f"context_parallel = {model_parallel}")
    data_parallel = world // model_parallel
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        distributed_timeout_minutes=max(1, math.ceil(timeout_minutes)),
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=False,
    )
    # DeepSpeed's data axis is context x data: its coordinate is cp_rank + context_parallel * dp_rank
    topology = PipeModelDataParallelTopology(num_pp=pipeline_parallel, num_mp=tensor_parallel,
                                             num_dp=data_parallel * context_parallel)
    rank = dist.get_rank()
    coord = topology.get_coord(rank)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    cp_group = parallel_state.get_context_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()

    # The two libraries must agree on which ranks share a group.
    for axis, group in (("model", tp_group), ("data", dp_cp_group), ("pipe", pp_group)):
        expected = next(sorted(r) for r in topology.get_axis_comm_lists(axis) if rank in r) if topology.get_dim(axis) > 1 else [rank]
        if _ranks(group) != expected:
            raise RuntimeError(
                f"rank {rank}: megatron-core {axis} group {_ranks(group)} != DeepSpeed topology {expected}"
            )
    cp_rank, dp_rank = parallel_state.get_context_parallel_rank(), parallel_state.get_data_parallel_rank()
    assert coord.model == parallel_state.get_tensor_model_parallel_rank()
    assert coord.data == cp_rank + context_parallel * dp_rank
    assert coord.pipe == parallel_state.get_pipeline_model_parallel_rank()
    return Parallel(
        rank=rank,
        world_size=world,
        local_rank=launch.local_rank,
        tp_size=tensor_parallel,
        pp_size=pipeline_parallel,
        dp_size=data_parallel,
        tp_rank=coord.model,
        pp_rank=coord.pipe,
        dp_rank=dp_rank,
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        topology=topology,
        device=device,
        backend=backend,
        store_address=(launch.master_addr, launch.master_port),
        cp_size=context_parallel,
        cp_rank=cp_rank,
        cp_group=cp_group,
        dp_cp_size=data_parallel * context_parallel,
        dp_cp_rank=coord.data,
        dp_cp_group=dp_cp_group,
    )


def shutdown_parallel() -> None:
    from .megatron_core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
