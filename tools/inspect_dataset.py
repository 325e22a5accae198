"""Statistics of a Megatron indexed dataset, and documents decoded back to text.

usage: python tools/inspect_dataset.py PREFIX [--decode N [N ...]] [--vocab-file vocab.txt | --tokenizer-json F]
                                       [--ids]

PREFIX is the path without .bin/.idx. Prints documents, sentences, tokens, dtype, sentences per
document and tokens per sentence (min/mean/max), empty documents and file sizes. --decode N
prints document N (0-based) one sentence per line, decoded with the vocabulary (--ids: the ids
too). The statistics end with the vocabulary and special-token counts the dataset records
(preprocess_data.py and merge_datasets.py write them). A missing, truncated or foreign .bin/.idx is an error naming the
file. Exit status: 0, 1 error, 2 bad usage.
"""
from __future__ import annotations

import argparse
import sys

from pretrain.cli import run_command
from pretrain.common.errors import UsageError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/inspect_dataset.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="dataset path without .bin/.idx")
    parser.add_argument("--decode", type=int, nargs="+", default=[], metavar="N", help="documents to print (0-based)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--vocab-file", help="vocab.txt to decode with")
    source.add_argument("--tokenizer-json", help="tokenizer.json to decode with")
    parser.add_argument("--ids", action="store_true", help="with --decode: print the token ids as well")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(parse_args, inspect, argv, name="inspect_dataset", input_errors=(OSError,))


def inspect(args: argparse.Namespace) -> None:
    from pretrain.data.preprocess.indexed import DataError, dataset_statistics, open_indexed_dataset
    from pretrain.data.preprocess.tokenizer import TokenizerError, bert_wordpiece_tokenizer, read_vocab

    if args.decode and not (args.vocab_file or args.tokenizer_json):
        raise UsageError("--decode needs --vocab-file or --tokenizer-json")
    stats = dataset_statistics(args.prefix)
    print(f"dataset     {stats.prefix}.{{bin,idx}} ({stats.bin_bytes / 1e6:,.2f} MB + {stats.idx_bytes / 1e6:,.2f} MB)")
    print(f"dtype       {stats.dtype}")
    print(f"documents   {stats.documents:,} ({stats.empty_documents:,} empty)")
    print(f"sentences   {stats.sentences:,}")
    print(f"tokens      {stats.tokens:,}")
    lo, mean, hi = stats.sentences_per_document
    print(f"sentences/document  min {lo:,}  mean {mean:,.2f}  max {hi:,}")
    lo, mean, hi = stats.tokens_per_sentence
    print(f"tokens/sentence     min {lo:,}  mean {mean:,.2f}  max {hi:,}")
    print_record(args.prefix)
    if not args.decode:
        return
    if args.vocab_file:
        tokenizer = bert_wordpiece_tokenizer(read_vocab(args.vocab_file), lowercase=True)  # case: encode only
    else:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(args.tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise TokenizerError(f"{args.tokenizer_json}: cannot load tokenizer ({e})") from None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dataset = open_indexed_dataset(args.prefix)
    for n in args.decode:
        if not 0 <= n < stats.documents:
            raise DataError(f"{args.prefix}: no document {n} (it has {stats.documents:,}, numbered from 0)")
        begin, end = int(dataset.document_indices[n]), int(dataset.document_indices[n + 1])
        print(f"\n--- document {n}: sentences {begin:,}-{end - 1:,} ({end - begin} sentences)")
        for s in range(begin, end):
            ids = dataset[s].tolist()
            outside = [i for i in ids if i >= vocab_size]
            if outside:
                raise DataError(f"{args.prefix}: sentence {s} has token id {outside[0]}, outside the "
                                f"{vocab_size:,}-entry vocabulary: not the vocabulary this dataset was made with")
            print(tokenizer.decode(ids, skip_special_tokens=False))
            if args.ids:
                print(f"    ids: {ids}")


def print_record(prefix: str) -> None:
    """What the dataset's fingerprint records about how it was made (nothing for Megatron-LM's files)."""
    from pretrain.data.preprocess.dataset_record import read_record

    vocabulary, counts = read_record(prefix)
    if vocabulary is not None:
        print(f"vocabulary  {vocabulary.describe()}, SHA-256 {vocabulary.sha256}")
    if counts is not None:
        print(f"special     {counts.special:,} of {counts.total:,} tokens ({counts.share:.1%}), [PAD] {counts.pad:,}")


if __name__ == "__main__":
    sys.exit(main())
