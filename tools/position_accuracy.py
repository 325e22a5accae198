"""Masked-token accuracy by position on held-out long documents: does a long-context model predict
its far positions as well as its near ones (after a context extension, say)?

usage: python tools/position_accuracy.py --checkpoint CKPT --input DOCS [--buckets 1024,4096,16384,32768]
         [--max-length N] [--mask-rate 0.15] [--seed 0] [--max-documents N] [--tp 1] [--cp 1] [--json]

CKPT is a native checkpoint (any layout) or a Hugging Face directory with its MLM head, as
tools/fill_mask.py takes it. DOCS holds one document per line: plain text, or JSON lines with a
"text" field (a name ending in .jsonl). Each document is tokenized with the checkpoint's own
tokenizer (with its [CLS] ... [SEP]) and cut at --max-length tokens (default the model's
max_position_embeddings). In each, --mask-rate of the tokens other than the special ones become the
mask token, drawn with --seed (the same documents and seed mask the same positions, whatever the
layout); the model's top prediction at each is right or wrong. The accuracy is reported per bucket
of position in the document: [0, 1024), [1024, 4096), ... (--buckets are the upper edges; positions
past the last edge form one more bucket):

  positions        masked   correct  accuracy
  0-1k              4,210     2,305     0.548
  ...

Empty lines are counted and skipped. Several processes split the model: --tp its heads, --cp each
document's tokens (context parallelism: what a 32k-token document needs on GPUs of modest memory;
launcher.sh --nproc-per-node TPxCP tool tools/position_accuracy.py ... --cp 4); rank 0 prints.
Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from pretrain.cli import accept_launcher_args, positive_int, run_command, run_distributed
from pretrain.common.errors import UsageError, UserError
from pretrain.common.textfile import read_lines

DEFAULT_BUCKETS = "1024,4096,16384,32768"


class PositionAccuracyError(UserError, ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/position_accuracy.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True, help="one document per line (text, or .jsonl with 'text')")
    parser.add_argument("--buckets", default=DEFAULT_BUCKETS, help=f"upper edges of the position buckets "
                                                                    f"(default {DEFAULT_BUCKETS})")
    parser.add_argument("--max-length", type=positive_int, help="tokens per document at most (default: the "
                                                                 "model's max_position_embeddings)")
    parser.add_argument("--mask-rate", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-documents", type=positive_int, help="the first N documents only")
    parser.add_argument("--vocab-file", help="vocab.txt or tokenizer.json; default: the checkpoint's own")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (tp x cp processes)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    accept_launcher_args(parser)
    args = parser.parse_args(argv)
    try:
        args.edges = [int(edge) for edge in args.buckets.split(",")]
    except ValueError:
        parser.error(f"--buckets {args.buckets!r}: comma-separated whole numbers, such as {DEFAULT_BUCKETS}")
    if any(edge < 1 for edge in args.edges) or args.edges != sorted(set(args.edges)):
        parser.error(f"--buckets {args.buckets!r}: increasing positive edges")
    if not 0.0 < args.mask_rate < 1.0:
        parser.error(f"--mask-rate {args.mask_rate}: between 0 and 1")
    return args


def read_documents(path: str, limit: int | None) -> tuple[list[tuple[str, str]], int]:
    """([(where, text)], empty lines skipped) of the input file."""
    lines = read_lines(path, PositionAccuracyError, what="--input ")
    documents, empty = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            empty += 1
            continue
        text = line
        if path.endswith(".jsonl"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PositionAccuracyError(f"{path}:{number}: not JSON ({e.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise PositionAccuracyError(f"{path}:{number}: no \"text\" string field")
            if not text.strip():
                empty += 1
                continue
        documents.append((f"{path}:{number}", text))
        if limit is not None and len(documents) == limit:
            break
    if not documents:
        raise PositionAccuracyError(f"{path}: no documents (empty lines only)")
    return documents, empty


def masked_positions(ids: list[int], special_ids: set[int], rate: float, seed: int, index: int) -> list[int]:
    """The positions of document `index` that become the mask token: `rate` of its non-special
    tokens (at least one), drawn from a generator of (seed, index) alone."""
    import numpy as np

    candidates = [i for i, token in enumerate(ids) if token not in special_ids]
    if not candidates:
        return []
    count = max(1, round(rate * len(candidates)))
    chosen = np.random.default_rng([seed, index]).choice(len(candidates), size=count, replace=False)
    return sorted(candidates[int(i)] for i in chosen)


def bucket_names(edges: list[int]) -> list[str]:
    def short(n):
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)
    bounds = [0] + edges
    return [f"{short(a)}-{short(b)}" for a, b in zip(bounds[:-1], bounds[1:])] + [f"{short(edges[-1])}-"]


def bucket_of(position: int, edges: list[int]) -> int:
    return next((i for i, edge in enumerate(edges) if position < edge), len(edges))


def evaluate(args, parallel) -> dict:
    import torch

    from pretrain.checkpoint.load import inference_model, read_any
    from pretrain.checkpoint.logical import check_layout
    from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.distributed.device import all_gather

    documents, empty = read_documents(args.input, args.max_documents)
    ckpt = read_any(args.checkpoint, with_optimizer=False)
    if "MLM head" in ckpt.initialised_heads:
        raise PositionAccuracyError(f"{args.checkpoint} has no trained MLM head: position accuracy needs a "
                                    "pretraining checkpoint (or a *ForMaskedLM / *ForPreTraining directory)")
    check_layout(ckpt.config, parallel.tp_size, 1)
    m = ckpt.config.model
    max_length = args.max_length or m.max_position_embeddings
    if max_length > m.max_position_embeddings:
        raise PositionAccuracyError(f"--max-length {max_length} is past the model's {m.max_position_embeddings} "
                                    "positions (model.max_position_embeddings)")
    try:
        info = checkpoint_tokenizer(ckpt.vocab_dir, m.vocab_size, args.checkpoint, args.vocab_file)
    except CheckpointError as e:
        raise PositionAccuracyError(str(e)) from None
    info.tokenizer.no_padding()
    info.tokenizer.no_truncation()
    specials = set(info.specials.control_ids)  # never masked: [CLS], [SEP], padding and the like
    model = inference_model(ckpt, parallel)
    masked = [0] * (len(args.edges) + 1)
    correct = [0] * (len(args.edges) + 1)
    longest = 0
    for index, encoding in enumerate(info.tokenizer.encode_batch([text for _, text in documents])):
        ids = encoding.ids[:max_length]
        positions = masked_positions(ids, specials, args.mask_rate, args.seed, index)
        if not positions:
            continue
        longest = max(longest, len(ids))
        labels = torch.tensor([ids[p] for p in positions])
        inputs = torch.tensor(ids)
        inputs[positions] = info.specials.mask_id
        batch = (inputs[None], torch.zeros(1, len(ids), dtype=torch.long), torch.ones(1, len(ids), dtype=torch.long),
                 torch.tensor(positions)[None])
        with torch.no_grad():
            local, _ = model(tuple(t.to(parallel.device) for t in batch))
            if parallel.tp_size > 1:
                local = torch.cat(all_gather(local, parallel.tp_group), dim=-1)
            predicted = local[0, :, :m.vocab_size].argmax(-1).cpu()
        for position, right in zip(positions, (predicted == labels).tolist()):
            bucket = bucket_of(position, args.edges)
            masked[bucket] += 1
            correct[bucket] += int(right)
    names = bucket_names(args.edges)
    bounds = [0] + args.edges + [None]
    return {"checkpoint": args.checkpoint, "documents": len(documents), "empty_lines_skipped": empty,
            "longest_document": longest, "max_length": max_length, "mask_rate": args.mask_rate, "seed": args.seed,
            "buckets": [{"positions": name, "start": bounds[i], "end": bounds[i + 1], "masked": masked[i],
                         "correct": correct[i], "accuracy": correct[i] / masked[i] if masked[i] else None}
                        for i, name in enumerate(names)]}


def table(result: dict) -> list[str]:
    lines = [f"{result['documents']} documents (longest {result['longest_document']:,} tokens; "
             f"{result['empty_lines_skipped']} empty lines skipped), {result['mask_rate']:.0%} of each masked",
             f"  {'positions':<12} {'masked':>9} {'correct':>9} {'accuracy':>9}"]
    for b in result["buckets"]:
        accuracy = "-" if b["accuracy"] is None else f"{b['accuracy']:.3f}"
        lines.append(f"  {b['positions']:<12} {b['masked']:>9,} {b['correct']:>9,} {accuracy:>9}")
    return lines


def main(argv=None) -> int:
    return run_command(parse_args, start, argv, name="position_accuracy")


def start(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # the libraries' chatter to stderr, the result to stdout
        from pretrain.distributed.parallel import discover_launch_env

        launch = discover_launch_env()
        if launch.world_size != args.tp * args.cp:
            if launch.rank != 0:
                return UsageError.exit_status
            raise UsageError(f"--tp {args.tp} x --cp {args.cp} needs {args.tp * args.cp} processes, "
                             f"{launch.world_size} launched")

        def answer(parallel) -> None:
            result = evaluate(args, parallel)
            if parallel.rank == 0:
                print(json.dumps(result) if args.json else "\n".join(table(result)), file=out, flush=True)

        return run_distributed(answer, args.tp, launch=launch, context_parallel=args.cp)


if __name__ == "__main__":
    sys.exit(main())
