"""Rank entry point: context-parallel attention (pretrain/model/context_parallel.py) against one
process's attention over the whole row, forward and backward.

usage: python tests/_cp_attention_worker.py OUT.json   (4 ranks: CP4, and CP2 on ranks {0,1} and {2,3})
For each case (rows of packed documents crossing the ranks' boundaries, one long document; global
and local layers; shares longer and shorter than the window's half) and split (contiguous equal
shares; balanced by tokens and work) every rank builds the same row, takes its share of the
queries, keys and values, runs the CP attention and its backward with its share of one upstream
gradient, and compares context and gradients with the reference's share. Rank 0 writes the
largest differences per case, split and CP size, what crossed the ranks, and what should have
(counted token by token from the rule).
"""
import json
import sys

import torch
import torch.distributed as dist

from pretrain.distributed import device
from pretrain.model.attention import encoder_attention
from pretrain.model.context_parallel import ContextSplit, attention_work, context_parallel_attention

HEADS, DIM = 2, 8
# name -> (document lengths of the row, half_window or None)
CASES = {
    "packed-global": ([9, 23, 5, 1, 14, 20], None),
    "packed-local": ([9, 23, 5, 1, 14, 20], 4),
    "one-document-global": ([61], None),
    "one-document-local": ([61], 6),
    "short-shares-local": ([7, 5], 5),  # 12 tokens over 4 ranks: shares of 3 < the halo: keys from 2 ranks away
    "skewed-global": ([40, 3, 2, 4, 1, 6, 4, 4], None),  # one long document among short ones: contiguous is uneven
}
SPLITS = ("even", "balanced", "ring")  # ring: the balanced split, global layers' keys passed around the ring
MIN_PIECE = 2  # the balanced split cuts documents of at least cp x 2 tokens


def expected_exchange(ids, owner, rank, half_window):
    """(tokens rank `rank` sends, tokens it receives) under the rule, by brute force: a key goes to
    every other rank holding a query of its document within the window."""
    if half_window is None:
        return 0, 0
    sent, received = set(), set()
    for q in range(len(ids)):
        for k in range(max(0, q - half_window), min(len(ids), q + half_window + 1)):
            if ids[q] == ids[k] and owner[q] != owner[k]:
                if owner[k] == rank:
                    sent.add((k, owner[q]))
                if owner[q] == rank:
                    received.add(k)
    return len(sent), len(received)


def reference(q, k, v, ids, half_window, upstream):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = encoder_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), ids[None], half_window=half_window)
    out = out[0].transpose(0, 1)
    out.backward(upstream)
    return out.detach(), q.grad, k.grad, v.grad


def main():
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {4: dist.group.WORLD, 2: None}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups[2] = pairs[rank // 2]
    sent, gathers = [], []  # elements per point-to-point exchange, all-gathers, on this rank
    start_exchange, all_gather = device.start_exchange, device.all_gather_with_grad

    def counting(sends, receives, group):
        sent.append(sum(t.numel() for _, t in (sends.items() if isinstance(sends, dict) else sends)))
        return start_exchange(sends, receives, group)

    def counting_gathers(tensor, group=None):
        gathers.append(tensor.shape[0])
        return all_gather(tensor, group)

    device.start_exchange, device.all_gather_with_grad = counting, counting_gathers
    results = {}
    for cp, group in groups.items():
        cp_rank = dist.get_rank(group)
        for (name, (lengths, half_window)), how in ((c, h) for c in CASES.items() for h in SPLITS):
            if how == "ring" and half_window is not None:
                continue  # the ring is the global layers'
            generator = torch.Generator().manual_seed(len(name))
            tokens = sum(lengths)
            ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
            q, k, v, upstream = (torch.randn(tokens, HEADS, DIM, generator=generator, dtype=torch.float64)
                                 for _ in range(4))
            expected = reference(q, k, v, ids, half_window, upstream)
            split = (ContextSplit.even(tokens, cp_rank, cp, group) if how == "even" else
                     ContextSplit.balanced(ids, cp_rank, cp, group, MIN_PIECE))
            owner = split.placement(torch.device("cpu"))[0].tolist()
            sends, receives = expected_exchange(ids.tolist(), owner, cp_rank, half_window)
            mine = [split.local(t).clone().requires_grad_() for t in (q, k, v)]
            del sent[:], gathers[:]
            out = context_parallel_attention(*mine, ids, split, half_window=half_window, ring=how == "ring")
            out.backward(split.local(upstream))
            got = (out.detach(), *(t.grad for t in mine))
            worst = max((a - split.local(b)).abs().max().item() for a, b in zip(got, expected))
            worst = device.reduce_floats([worst], torch.device("cpu"), op="max")[0]
            results[f"cp{cp}/{name}/{how}"] = {
                "max_abs": worst, "scale": expected[0].abs().max().item(),
                "queries": out.shape[0], "shares": [split.share(r) for r in range(cp)], "exchanged": list(sent),
                "gathers": len(gathers),
                "expected_exchange": [n * HEADS * DIM for n in (sends, sends, receives, receives)],
                "work": attention_work(ids, split), "tokens": tokens, "runs": [list(r) for r in split.runs],
            }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
