"""Attention-core benchmark: forward + backward time and peak tensor memory of each path of
pretrain/model/attention.py, global and local (sliding-window) layers, over packed rows (what
the model attends: it computes real tokens only, one row per micro-batch).

usage: python tools/benchmarks/attention.py [--tokens 8192] [--seqs 1024 4096 8192] [--half-window 64]
           [--heads 2] [--head-dim 64] [--repeats 3] [--threads 2] [--blocks 64 128 256]
           [--documents 32 2048] [--layers global local] [--skip PATH ...] [--json out.json]

BERT-tiny width by default (hidden 128: 2 heads of 64), batch x seq = --tokens at every length.
Rows hold documents of 32-2,048 random tokens (--documents; cut at the row's end), the last 2% of
each row padding.

Time: the best of --repeats forward + backward passes (q, k, v require grad; the upstream
gradient is ones) after one warm-up, wall clock and CPU time of this process (on a machine shared
with other work the best and the CPU time are the steadier).

Peak: the largest sum of live tensor storages created during one forward + backward (a dispatch
mode sees every op's outputs and drops a storage when it is freed): scores, masks, saved
activations, gradients. Scratch buffers inside a fused kernel are not tensors and not counted.
tracemalloc cannot see tensor memory and RSS deltas lag the allocator, hence this.

The last column says which path encoder_attention takes for the case (attention.choose_path).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from pretrain.model import attention  # noqa: E402


class PeakTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that ops created while the mode was on."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, size) in list(self.live.items()):  # freed first: a new storage may reuse the address
            if ref.expired():
                del self.live[ptr]
                self.current -= size
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size and ptr not in self.live:
                    self.live[ptr] = (StorageWeakRef(storage), size)
                    self.current += size
        self.peak = max(self.peak, self.current)
        return out


def rows(batch: int, seq: int, generator: torch.Generator, documents=(32, 2048)) -> torch.Tensor:
    """Sample ids of packed rows: documents of random lengths, the last 2% of each row padding."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    number = 0
    for row in range(batch):
        position, end = 0, seq - seq // 50
        while position < end:
            number += 1
            length = int(torch.randint(documents[0], documents[1] + 1, (1,), generator=generator))
            ids[row, position:min(position + length, end)] = number
            position += length
    return ids


def candidates(half_window, blocks) -> list[tuple[str, dict]]:
    if half_window is None:
        return [("dense", {}), ("documents", {})]
    return [("dense", {})] + [("banded", {"block": block}) for block in blocks]


def measure(path: str, extra: dict, q, k, v, sample_ids, half_window, repeats: int) -> dict:
    def once():
        q.grad = k.grad = v.grad = None
        out = attention.run_path(path, q, k, v, sample_ids, half_window=half_window, **extra)
        out.backward(torch.ones_like(out))

    once()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        once()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    q.grad = k.grad = v.grad = None
    with PeakTensorBytes() as tracker:
        once()
    return {"seconds": min(wall), "cpu_seconds": min(cpu), "median_seconds": statistics.median(wall),
            "peak_mib": tracker.peak / 2 ** 20}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--half-window", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--layers", nargs="+", default=["global", "local"])
    parser.add_argument("--skip", nargs="*", default=[], help="path names not to run (e.g. dense at long rows)")
    parser.add_argument("--documents", type=int, nargs=2, default=[32, 2048], metavar=("MIN", "MAX"),
                        help="the range of document lengths in packed rows")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}; "
          f"{args.heads} heads x {args.head_dim}, {args.tokens} tokens per batch, "
          f"local half_window {args.half_window}, packed documents of {args.documents[0]}-{args.documents[1]} tokens")
    print(f"{'seq':>5} {'batch':>5} {'layer':>6} {'path':>16} {'fwd+bwd ms':>11} {'cpu ms':>8} "
          f"{'peak MiB':>9}  chosen")
    for seq in args.seqs:
        batch = max(args.tokens // seq, 1)
        sample_ids = rows(batch, seq, generator, args.documents)
        q, k, v = (torch.randn(batch, args.heads, seq, args.head_dim, generator=generator).requires_grad_()
                   for _ in range(3))
        for layer in args.layers:
            half_window = args.half_window if layer == "local" else None
            chosen = attention.choose_path(seq, half_window)
            for path, extra in candidates(half_window, args.blocks):
                if path in args.skip:
                    continue
                result = measure(path, extra, q, k, v, sample_ids, half_window, args.repeats)
                name = path + (f"/{extra['block']}" if extra else "")
                picked = path == chosen and extra.get("block", attention.BAND_BLOCK) == attention.BAND_BLOCK
                print(f"{seq:>5} {batch:>5} {layer:>6} {name:>16} {1e3 * result['seconds']:>11.1f} "
                      f"{1e3 * result['cpu_seconds']:>8.1f} {result['peak_mib']:>9.1f}  "
                      f"{'<-' if picked else ''}", flush=True)
                results.append({"seq": seq, "batch": batch, "layer": layer, "path": name, "chosen": picked,
                                **result})
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
