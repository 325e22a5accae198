"""Concatenate Megatron indexed datasets into one.

usage: python tools/merge_datasets.py --input PREFIX|DIR [...] --output-prefix OUT

Each --input is a dataset prefix (PREFIX.bin + PREFIX.idx) or a directory, meaning every dataset
in it (sorted by name). Documents keep their order: the first input's, then the second's, ...
All inputs must have the same token dtype, and those that record their vocabulary the same one
(OUT records it, and the inputs' token counts added up, when every input has a record).
OUT.bin and OUT.idx are written under temporary names and renamed when complete. Exit status:
0 done, 1 error (nothing written), 2 bad usage.
"""
from __future__ import annotations

import argparse
import sys

from pretrain.cli import run_command


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/merge_datasets.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="PREFIX|DIR",
                        help="dataset prefixes (without .bin/.idx) or directories of datasets")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(parse_args, merge, argv, name="merge_datasets", input_errors=(OSError,),
                       interrupted="no output written")


def merge(args: argparse.Namespace) -> None:
    from pretrain.data.preprocess.merge import merge_datasets

    result = merge_datasets(args.input, args.output_prefix)
    for prefix in result.inputs:
        print(f"  {prefix}")
    print(f"merged {len(result.inputs)} datasets: {result.documents:,} documents, {result.sentences:,} sentences, "
          f"{result.tokens:,} tokens ({result.dtype}) -> {args.output_prefix}.{{bin,idx}}")


if __name__ == "__main__":
    sys.exit(main())
