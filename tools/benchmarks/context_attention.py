"""Context parallelism's global attention on this machine: the split (contiguous equal shares
against shares balanced by tokens and attention work) and the exchange (all-gather against the
ring, with the ring's overlap measured), on the same rows.

usage: python tools/benchmarks/context_attention.py [--seq 8192] [--cp 2] [--mix skewed|one]
                                                    [--steps 3] [--warmup 1] [--json out.json]

--cp ranks (one thread each; 2 = this machine's cores) run one global attention layer's core at
ModernBERT-base's shape (12 heads of 64, fp32), forward and backward, on rows of --seq tokens:
`skewed` = one document of half the row, then documents of 64-512 tokens, `one` = one document.
Per variant: the slowest rank's median time per step (the ranks wait for each other), each
rank's query-key pairs (the work), and the bytes autograd keeps for backward beyond the core's
inputs and output (which the layer around it keeps anyway). The ring runs twice, each transfer
overlapping the attention and waiting for it first; rank 0's time blocked on the transfers in
each (and the transfers alone, without attention) says how much of the communication is hidden.
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

from tools.benchmarks.harness import launch_ranks, write_json  # noqa: E402

HEADS, DIM = 12, 64
MB = 2**20
VARIANTS = ("contiguous-allgather", "balanced-allgather", "balanced-ring", "balanced-ring-no-overlap")


def document_lengths(seq: int, mix: str, seed: int = 0) -> list[int]:
    import random

    if mix == "one":
        return [seq]
    rng, lengths = random.Random(seed), [seq // 2]
    while sum(lengths) < seq:
        lengths.append(min(rng.randint(64, 512), seq - sum(lengths)))
    return lengths


def saved_bytes(run, inputs) -> tuple:
    """run()'s output and the bytes of the distinct storages autograd keeps for backward while it
    builds the graph, other than those of `inputs` and of the output."""
    import torch

    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    for t in (*inputs, out):
        storages.pop(t.untyped_storage().data_ptr(), None)
    return out, sum(storages.values())


def child(args) -> dict:
    import torch
    import torch.distributed as dist

    from pretrain.distributed import device
    from pretrain.model.context_parallel import attention_work, context_parallel_attention
    from pretrain.model.context_split import ContextSplit
    from pretrain.model.ring_attention import RingPlan, ring_attention
    from pretrain.model.context_parallel import GLOBAL_BLOCK, document_bounds

    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    lengths = document_lengths(args.seq, args.mix)
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[None]
    generator = torch.Generator().manual_seed(0)
    row = [torch.randn(args.seq, HEADS, DIM, generator=generator) for _ in range(4)]  # q, k, v, upstream
    splits = {"contiguous": ContextSplit.even(args.seq, rank, cp), "balanced": ContextSplit.balanced(ids, rank, cp,
                                                                                                    None, 64)}
    starts, ends = document_bounds(ids)

    def variant(name):
        split = splits[name.split("-")[0]]
        plan = RingPlan.build(split, ids, starts, ends, GLOBAL_BLOCK)
        q, k, v = (split.local(t).clone().requires_grad_() for t in row[:3])
        upstream = split.local(row[3])

        def step():
            if "ring" in name:
                out = ring_attention(q, k, v, split, plan, overlap="no-overlap" not in name)
            else:
                out = context_parallel_attention(q, k, v, ids, split, half_window=None)
            return out
        return split, (q, k, v), upstream, step

    # the time the ring's ranks spend blocked on their transfers (what the overlap left exposed)
    waited, start_exchange = [0.0], device.start_exchange

    class TimedExchange:
        def __init__(self, exchange):
            self.exchange = exchange

        def wait(self):
            start = time.perf_counter()
            self.exchange.wait()
            waited[0] += time.perf_counter() - start

    device.start_exchange = lambda *a: TimedExchange(start_exchange(*a))
    results = {}
    for name in VARIANTS:
        split, inputs, upstream, step = variant(name)
        times, waits = [], []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            waited[0], start = 0.0, time.perf_counter()
            out, kept = saved_bytes(step, inputs)
            out.backward(upstream)
            waits.append(waited[0])
            dist.barrier()
            times.append(time.perf_counter() - start)
        results[name] = {"time": statistics.median(times[args.warmup:]), "kept_mb": kept / MB,
                         "waited": statistics.median(waits[args.warmup:]),
                         "work": attention_work(ids, split), "shares": [split.share(r) for r in range(cp)]}
    device.start_exchange = start_exchange
    # the ring's transfers alone: size - 1 hops forward, size hops of keys and values (plus their
    # gradients) backward, as the ring makes them
    split = splits["balanced"]
    held = torch.zeros(2, max(split.share(r) for r in range(cp)), HEADS, DIM)
    times = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        for hop in range(cp - 1):
            device.start_exchange([((rank + 1) % cp, held)], [((rank - 1) % cp, torch.empty_like(held))], None).wait()
        for hop in range(cp):
            sends = [((rank + 1) % cp, held)] * (1 + (0 < hop < cp - 1))
            device.start_exchange(sends, [((rank - 1) % cp, torch.empty_like(held)) for _ in sends], None).wait()
        device.start_exchange([((rank + 1) % cp, held)], [((rank - 1) % cp, torch.empty_like(held))], None).wait()
        dist.barrier()
        times.append(time.perf_counter() - start)
    results["ring-transfers-alone"] = {"time": statistics.median(times[args.warmup:])}
    dist.destroy_process_group()
    return {"lengths": lengths, "results": results}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--mix", choices=("skewed", "one"), default="skewed")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        from pretrain.common.quiet import hide_library_warnings

        hide_library_warnings()
        import torch

        torch.set_num_threads(1)
        result = child(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.child_out).write_text(json.dumps(result))
        return
    out = launch_ranks([str(Path(__file__).resolve()), "--child", "--seq", str(args.seq), "--mix", args.mix,
                        "--steps", str(args.steps), "--warmup", str(args.warmup)], args.cp, 1,
                       "context-attention benchmark")
    r = out["results"]
    lengths = out["lengths"]
    print(f"one global attention layer (12 x 64 heads, fp32), forward + backward, CP{args.cp}, rows of "
          f"{args.seq:,} tokens in {len(lengths)} documents (longest {max(lengths):,}), one thread per rank")
    print(f"  {'variant':<26} {'ms/step':>8} {'vs contiguous':>13} {'work max/min':>12} "
          f"{'kept beyond q, k, v, out':>25}")
    base = r["contiguous-allgather"]["time"]
    for name in VARIANTS:
        v = r[name]
        balance = max(v["work"]) / min(v["work"])
        print(f"  {name:<26} {v['time'] * 1e3:>8.0f} {base / v['time']:>12.2f}x {balance:>12.2f} "
              f"{v['kept_mb']:>22.1f} MB")
    alone = r["ring-transfers-alone"]["time"]
    exposed, blocked = r["balanced-ring"]["waited"], r["balanced-ring-no-overlap"]["waited"]
    print(f"  the ring's transfers alone: {alone * 1e3:.0f} ms a step; rank 0 blocked on them {blocked * 1e3:.0f} ms "
          f"waiting first, {exposed * 1e3:.0f} ms overlapped ({1 - exposed / max(blocked, 1e-9):.0%} hidden)")
    write_json(args.json, {"seq": args.seq, "cp": args.cp, "mix": args.mix, **out})


if __name__ == "__main__":
    main()
