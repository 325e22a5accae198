"""Rank entry point: transformers' ModernBertForMaskedLM vs our ModernBERT at TP = world size.

usage: python tests/_modern_parity_worker.py OUT.json
For each shape (tests/test_modernbert.py SHAPES) and attention implementation (eager, sdpa): a
randomly initialised transformers model is saved (rank 0), read back through our converter
(read_hf: its Wqkv and Wi rows reordered) and loaded into our model's TP shards. Rank 0 writes
the largest differences of the MLM logits on a padded batch of unequal lengths (rows longer than
the window) and on packed rows, each document of which transformers runs alone.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import ModernBertForMaskedLM  # noqa: E402

from pretrain.checkpoint.hf import read_hf  # noqa: E402
from pretrain.checkpoint.sharding import load_hf_state_dict  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402
from pretrain.model.bert import build_model  # noqa: E402
from pretrain.model.rng import RngTracker, seed_streams  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_modernbert import SEQ, SHAPES, VOCAB, hf_config, randomise  # noqa: E402


def gathered_logits(model, parallel, inputs) -> torch.Tensor:
    """Our MLM logits at every masked position over the whole vocabulary (gathered over TP)."""
    local, _ = model(inputs)
    pieces = [torch.empty_like(local) for _ in range(parallel.tp_size)]
    dist.all_gather(pieces, local.contiguous(), group=parallel.tp_group)
    return torch.cat(pieces, dim=-1)[..., :VOCAB]


def padded_batch(generator):
    """Rows of unequal lengths, all longer than the shapes' windows; every position predicted."""
    lengths = [SEQ, 27, 19, 12]
    ids = torch.randint(5, VOCAB, (len(lengths), SEQ), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0
    positions = torch.arange(SEQ).expand(len(lengths), SEQ).contiguous()
    return (ids, torch.zeros_like(ids), mask, positions), lengths


def packed_rows(generator):
    """Documents packed two rows of SEQ tokens (the data.packing tensors), and each document."""
    rows = [[20, 9], [7, 13, 11]]  # document lengths per row; row 1 ends in padding
    documents, sample_ids, position_ids = [], torch.zeros(len(rows), SEQ, dtype=torch.long), torch.zeros(len(rows), SEQ, dtype=torch.long)
    ids = torch.zeros(len(rows), SEQ, dtype=torch.long)
    masked, number = [], 0
    for r, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            number += 1
            doc = torch.randint(5, VOCAB, (n,), generator=generator)
            ids[r, start:start + n] = doc
            sample_ids[r, start:start + n] = number
            position_ids[r, start:start + n] = torch.arange(n)
            masked.append(torch.arange(r * SEQ + start, r * SEQ + start + n))
            documents.append(doc)
            start += n
    flat = torch.cat(masked)[None]  # every real token predicted (flat indices into rows x SEQ)
    cls_positions = torch.tensor([int(m[0]) for m in masked])
    return (ids, torch.zeros_like(ids), sample_ids, flat, position_ids, cls_positions), documents


def main():
    out_path = sys.argv[1]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, int(os.environ["WORLD_SIZE"]), 1)
    directory = os.path.join(os.path.dirname(out_path), "hf")
    results = {}
    for name, shape in SHAPES.items():
        for implementation in ("eager", "sdpa"):
            torch.manual_seed(1234)  # the same transformers model on every rank
            hf = ModernBertForMaskedLM(hf_config(shape, implementation)).eval()
            randomise(hf)
            path = f"{directory}-{name}-{implementation}"
            if parallel.rank == 0:
                hf.save_pretrained(path)
            dist.barrier()
            ckpt = read_hf(path)
            m = ckpt.config.model
            padded = m.padded_vocab_size(parallel.tp_size)
            tracker = RngTracker(parallel.device)
            seed_streams(tracker, 1, parallel.tp_rank, 0, 0)
            model = build_model(m, padded, torch.float32, tracker, parallel.tp_group, binary_head=False)
            load_hf_state_dict(model, ckpt.weights, padded, parallel.tp_rank, parallel.tp_size)
            model.eval()
            generator = torch.Generator().manual_seed(5)
            inputs, lengths = padded_batch(generator)
            packed, documents = packed_rows(generator)
            with torch.no_grad():
                ours = gathered_logits(model, parallel, inputs)
                theirs = hf(input_ids=inputs[0], attention_mask=inputs[2]).logits
                padded_diff = max((ours[r, :n] - theirs[r, :n]).abs().max().item() for r, n in enumerate(lengths))
                ours_packed = gathered_logits(model, parallel, packed)[0]
                alone = torch.cat([hf(input_ids=doc[None]).logits[0] for doc in documents])
            results[f"{name}/{implementation}"] = {
                "padded_max_abs": padded_diff, "scale": theirs.abs().max().item(),
                "packed_max_abs": (ours_packed - alone).abs().max().item(), "packed_tokens": len(alone),
                "local_heads": model.layers[1].local_heads, "global_layers": [
                    layer.layer_index for layer in model.layers if getattr(layer, "is_global", False)],
                "windows": sorted({layer.half_window for layer in model.layers
                                   if getattr(layer, "half_window", None) is not None}),
            }
    if parallel.rank == 0:
        with open(out_path, "w") as f:
            json.dump({"tp": parallel.tp_size, "results": results}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
