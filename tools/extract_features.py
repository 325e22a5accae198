"""Hidden states of chosen layers for every token of a text file (BERT's feature-based use).

usage: python tools/extract_features.py --checkpoint CKPT --input-file lines.txt --output-file features.jsonl
         [--layers=-1,-2,-3,-4] [--max-seq-length 128] [--vocab-file vocab.txt] [--batch-size 32] [--tp 1]

CKPT is a native checkpoint (any layout) or a Hugging Face BERT directory. One text per line, or a
pair as "A ||| B". Output: google-research/bert's extract_features.py JSON lines, one per input
line, every token with the values of each requested layer (-1: last layer, 0: embeddings).
Several processes (launcher.sh ... tool tools/extract_features.py ... --tp 2) split the model
with tensor parallelism. Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import sys
import time

from pretrain.cli import accept_launcher_args, positive_int, run_command, run_distributed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/extract_features.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input-file", required=True)
    parser.add_argument("--output-file", required=True)
    parser.add_argument("--layers", default="-1,-2,-3,-4", help="comma-separated layer indexes; write --layers=-1,-2 (negative values need the =)")
    parser.add_argument("--max-seq-length", type=positive_int, default=128)
    parser.add_argument("--vocab-file", help="default: the checkpoint's own vocab.txt")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (the world size when launched)")
    accept_launcher_args(parser)
    args = parser.parse_args(argv)
    try:
        args.layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers {args.layers!r}: expected comma-separated integers")
    return args


def main(argv=None) -> int:
    return run_command(parse_args, start, argv, name="extract_features")


def start(args: argparse.Namespace) -> int:
    return run_distributed(lambda parallel: extract(args, parallel), args.tp)


def extract(args: argparse.Namespace, parallel) -> None:
    from finetune.features import extract_features

    started = time.perf_counter()
    lines = extract_features(args.checkpoint, args.input_file, args.output_file, args.layers,
                             args.max_seq_length, parallel, args.vocab_file, args.batch_size)
    if parallel.rank == 0:
        print(f"wrote features of {lines} line(s), layers {args.layers}, to {args.output_file} "
              f"in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
