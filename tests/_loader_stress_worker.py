"""Rank entry point for tests/test_loader_starts.py: start loaders again and again in a rank whose
gloo process group runs live collectives, as a rank's evaluation loaders once did.

usage: python tests/_loader_stress_worker.py STARTS START_METHOD
On rank 0, each of STARTS rounds builds a loader with 2 worker processes started by START_METHOD (forkserver:
ours, pretrain/data/samples/batches.py; fork: the old path, for comparison), draws every micro-batch of
an evaluation pass and stops its workers (asserting they are not the rank's own children: forked
from the forkserver, not from the rank), while a second thread keeps all-reducing on its own
process group with the other ranks (gloo's threads busy, as the gradient reduction keeps them).
Prints one line:
"STARTS starts in S s; collectives N" when done.
"""
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
from pretrain.data.samples import batches
from pretrain.data.samples.synthetic import SyntheticDataset


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state


def main() -> None:
    starts, method = int(sys.argv[1]), sys.argv[2]
    parallel = init_parallel(discover_launch_env(), 1, 1, timeout_minutes=2)
    busy = dist.new_group(list(range(parallel.world_size)))
    stop = threading.Event()
    done = [0]

    def collectives():
        tensor = torch.ones(1 << 10)
        while True:
            dist.all_reduce(tensor, group=busy)
            done[0] += 1
            # every rank stops at the same collective: once all are done with their loaders
            flag = torch.tensor([float(stop.is_set())])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=busy)
            if flag.item():
                return
            time.sleep(0.001)  # live, not a busy loop starving the loaders of the 2 cores

    thread = threading.Thread(target=collectives, daemon=True)
    thread.start()
    dataset = SyntheticDataset(200, 32, 5, 1000, seed=1)
    batches.LOADER_START_METHOD = method
    began = time.monotonic()
    # rank 0 starts the loaders; the other ranks are its collectives' partners
    for round_ in range(starts if parallel.rank == 0 else 0):
        evaluation = batches.FixedMicroBatches(dataset, 4, 2, parallel.dp_rank, parallel.dp_size, parallel.device,
                                               num_workers=2)
        drawn = sum(1 for _ in evaluation.one_pass())
        assert drawn == 4 and len(evaluation.worker_pids()) == 2, (round_, drawn)
        parents = {parent_pid(pid) for pid in evaluation.worker_pids()}
        assert os.getpid() not in parents, f"loader processes forked from the rank ({method})"
        evaluation.close()
    seconds = time.monotonic() - began
    stop.set()  # rank 1 at once: the thread keeps going until rank 0 is done too
    thread.join()
    print(f"{starts} starts in {seconds:.1f} s; collectives {done[0]}", flush=True)
    shutdown_parallel()


if __name__ == "__main__":
    main()
