"""Raw text -> Megatron indexed datasets for BERT pretraining.

usage: python tools/preprocess_data.py --input FILE|GLOB [...] --output-prefix PREFIX
           (--vocab-file vocab.txt | --tokenizer-json tokenizer.json) [--tokenizer-type T]
           [--input-format jsonl|text-lines|text-blank-lines|parquet|arrow] [--json-keys text ...]
           [--split-sentences [--keep-newlines]] [--append-eod] [--workers N] [--partitions N]
           [--dtype auto|uint16|int32|int64] [--strict] [--log-interval DOCS] [--group-by KEY]

Writes <PREFIX>_<key>_sentence.{bin,idx} (with --split-sentences: one item per sentence) or
<PREFIX>_<key>_document.{bin,idx} (one item per document), readable by megatron-core's
IndexedDataset, and <PREFIX>_<key>_*.fingerprint.json beside them (sizes and checksums, the
vocabulary and the token counts: docs/data.md). With --group-by, one dataset per value of that key
or column, <PREFIX>_<value>_<key>_*, and their manifest <PREFIX>_<key>_*.groups.json. An output of
mostly padding or special tokens is refused. Flags follow Megatron-LM's tools/preprocess_data.py where the concept is the same.
Exit status: 0 done, 1 error (nothing written), 2 bad usage, 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import sys

from pretrain.cli import INTERRUPTED, positive_int, run_command
from pretrain.common.errors import UserError
from pretrain.data.preprocess.corpus import INPUT_FORMATS

# Library imports happen inside run(): worker processes start by re-importing this file, and
# must not pay for megatron-core (torch) on the way.


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/preprocess_data.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", required=True, metavar="FILE|GLOB|FOLDER",
                       help="input files or globs (quote globs); .gz .bz2 .xz .zst are decompressed; parquet: "
                            "files or folders of shards; arrow: a folder saved by datasets.save_to_disk")
    group.add_argument("--input-format", default="jsonl", choices=INPUT_FORMATS,
                       help="jsonl: one JSON object per line (default); text-lines: one document per line; "
                            "text-blank-lines: documents separated by blank lines (hard-wrapped text; a warning "
                            "says when a file looks like the other plain-text format); parquet, arrow: tables "
                            "read in record batches (the parquet extra)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys of the JSON objects (columns of a table) to extract, one output per key "
                            "(default: text); for plain text it only names the output")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (blingfire); one item per sentence")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences: a line break inside a document always ends a sentence "
                            "(by default line breaks are spaces, right for hard-wrapped text)")
    group.add_argument("--group-by", metavar="KEY",
                       help="jsonl, parquet, arrow: a JSON key or column (a language, a source) whose every value "
                            "gets its own dataset, <PREFIX>_<value>_<key>_<level>, listed with its tokens in "
                            "<PREFIX>_<key>_<level>.groups.json; name that manifest in data.paths to train on all of "
                            "them (data.sampling_alpha weighs them by size)")
    group.add_argument("--max-groups", type=positive_int, default=4096,
                       help="with --group-by: the most distinct values allowed (default 4096)")
    group.add_argument("--strict", action="store_true",
                       help="a malformed line (bad JSON, missing key, non-string value, invalid UTF-8) is an "
                            "error instead of a counted skip")
    group = parser.add_argument_group("tokenizer")
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument("--vocab-file", help="Google BERT vocab.txt (e.g. from tools/build_vocab.py)")
    source.add_argument("--tokenizer-json", help="any Hugging Face tokenizer.json: WordPiece, byte-level BPE (e.g. from "
                                                 "tools/build_vocab.py --model bpe), ...; its special tokens are read "
                                                 "by role, its own padding and truncation are switched off")
    group.add_argument("--tokenizer-type", choices=("BertWordPieceLowerCase", "BertWordPieceCase"),
                       help="WordPiece only: lowercase or keep case; default: what the vocabulary shows (vocab.txt) "
                            "or the tokenizer.json's own normalizer. A choice contradicting the vocabulary is an error")
    group.add_argument("--allow-case-mismatch", action="store_true",
                       help="only warn when --tokenizer-type contradicts the vocabulary's case")
    group.add_argument("--append-eod", action="store_true",
                       help="append the tokenizer's sep token ([SEP], </s>) to the last sentence of every "
                            "document (BERT vocabularies have no end-of-document token)")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="path prefix of the outputs")
    group.add_argument("--dtype", default="auto", choices=("auto", "uint16", "int32", "int64"),
                       help="token dtype; auto: uint16 below 65500 vocabulary entries, else int32")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=positive_int, default=len(os.sched_getaffinity(0)),
                       help="worker processes (default: the CPUs available)")
    group.add_argument("--partitions", type=positive_int, default=1,
                       help="write the input in N consecutive parts to separate files, then merge them "
                            "(document order kept; the output is the same)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="accepted for Megatron compatibility; partitions always keep the input order")
    group.add_argument("--log-interval", type=positive_int, default=1000, help="documents between progress updates")
    group.add_argument("--chunk-bytes", type=positive_int, default=1 << 20,
                       help="input bytes per work unit (default 1 MiB)")
    group.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.vocab_file and args.vocab_file.endswith(".json"):
        parser.error(f"--vocab-file {args.vocab_file} is a tokenizer.json: pass it as --tokenizer-json")
    return args


def main(argv=None) -> int:
    return run_command(parse_args, run, argv, name="preprocess_data", interrupted="no output written")


def run(args: argparse.Namespace) -> int | None:
    from pretrain.data.preprocess.pipeline import Interrupted, PreprocessOptions, format_report, preprocess

    options = PreprocessOptions(
        inputs=tuple(args.input), output_prefix=args.output_prefix, vocab_file=args.vocab_file,
        tokenizer_json=args.tokenizer_json, tokenizer_type=args.tokenizer_type,
        allow_case_mismatch=args.allow_case_mismatch, json_keys=tuple(args.json_keys),
        input_format=args.input_format, split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
        append_eod=args.append_eod, workers=args.workers, partitions=args.partitions,
        log_interval=args.log_interval, dtype=args.dtype, strict=args.strict, chunk_bytes=args.chunk_bytes,
        progress=not args.quiet, group_by=args.group_by, max_groups=args.max_groups,
    )
    try:
        report = preprocess(options)  # its notes are warnings: on stderr (pretrain/observability/console.py)
    except Interrupted as e:  # SIGINT or SIGTERM: the pipeline turns them into this, and cleans up
        print(f"preprocess_data: {e}; no output written", file=sys.stderr)
        return INTERRUPTED
    except (UserError, ValueError, OSError) as e:
        # a worker's failure carries the worker's traceback (multiprocessing's RemoteTraceback)
        cause = getattr(e.__cause__, "__cause__", None)
        if cause is not None and getattr(cause, "tb", None):
            print(f"worker traceback:{cause.tb}", file=sys.stderr)
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        print("preprocess_data: no output written", file=sys.stderr)
        return 1
    print(format_report(report))
    return None


if __name__ == "__main__":
    sys.exit(main())
