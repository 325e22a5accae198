"""The job's rendezvous, bounded: every rank joins a TCPStore served by rank 0 and the process
groups start only once all have; a rank that does not come within the timeout is named (with the
node it belongs to, when the launcher says how many ranks a node runs) instead of leaving the
others waiting without a word.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from ..common.errors import UserError

KEY_PREFIX = "bert-rendezvous/"
# ranks per node, as each launcher tells it (for naming the node of a missing rank)
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


class RendezvousError(UserError, RuntimeError):
    """Not every rank of the job arrived in time (exit status 1, one line, no traceback)."""


def _ranks_per_node(environ) -> int | None:
    for name in LOCAL_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def describe_missing(missing: list[int], arrived: dict[int, str], environ=None) -> str:
    """'rank 3 (node 1: the launch with --node-rank 1)'..., and where the others came from."""
    per_node = _ranks_per_node(os.environ if environ is None else environ)
    names = []
    for r in missing:
        node = f" (node {r // per_node}: the launch with --node-rank {r // per_node})" if per_node else ""
        names.append(f"{r}{node}")
    hosts = sorted({host.split()[0] for host in arrived.values()})
    return (f"rank(s) {', '.join(names)} did not join; {len(arrived)} joined from {', '.join(hosts) or 'nowhere'}")


def join(master_addr: str, master_port: int, rank: int, world_size: int, timeout_minutes: float,
         poll_seconds: float = 0.2) -> dist.TCPStore:
    """This rank's connection to the job's store once every rank has joined (RendezvousError
    naming the missing ranks after `timeout_minutes`)."""
    timeout = timedelta(minutes=timeout_minutes)
    where = f"{master_addr}:{master_port}"
    # torchrun's agent on node 0 already serves the store on the master port (and says so)
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(master_addr, master_port, world_size=None, is_master=serves, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as error:  # DistNetworkError/DistStoreError are RuntimeErrors
        if serves:
            raise RendezvousError(f"rank 0 cannot serve the job's store on {where} ({error}); is the port in use? "
                                  "Choose another with --master-port") from None
        raise RendezvousError(f"rank {rank} on {socket.gethostname()}: the job's store at {where} (served by rank 0, or under torchrun by node 0's agent) "
                              f"did not answer within {timeout_minutes:g} min (resilience.rendezvous_timeout_minutes): "
                              f"rank 0 did not start, or {master_addr} is not reachable from here") from None
    store.set(f"{KEY_PREFIX}{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    store.add(f"{KEY_PREFIX}count", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add(f"{KEY_PREFIX}count", 0) < world_size:
        if time.monotonic() > deadline:
            keys = [f"{KEY_PREFIX}{r}" for r in range(world_size)]
            arrived = {r: store.get(keys[r]).decode() for r in range(world_size) if store.check([keys[r]])}
            missing = [r for r in range(world_size) if r not in arrived]
            raise RendezvousError(f"rank {rank}: the job's rendezvous at {where} timed out after {timeout_minutes:g} "
                                  f"min (resilience.rendezvous_timeout_minutes): {describe_missing(missing, arrived)}")
        time.sleep(poll_seconds)
    return store
