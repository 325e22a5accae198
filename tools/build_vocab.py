"""Train a BERT WordPiece vocabulary, or a byte-level BPE tokenizer, from raw text.

usage: python tools/build_vocab.py --input FILE|GLOB [...] --output-dir DIR [--model wordpiece|bpe]
           [--input-format jsonl|text-lines|text-blank-lines|parquet|arrow] [--json-keys text ...]
           [--lowercase | --cased] [--vocab-size 30522] [--min-frequency 2] [--limit-alphabet 1000]
           [--strict] [--force]

--model wordpiece (default) writes DIR/vocab.txt (Google BERT's format: one token per line, id =
line number - 1, [PAD] = 0, then [UNK] [CLS] [SEP] [MASK]) and DIR/tokenizer.json (the complete
Hugging Face tokenizer: BertNormalizer, BertPreTokenizer, WordPiece, WordPiece decoder, [CLS]/[SEP]
template). --model bpe writes DIR/tokenizer.json (a byte-level BPE as ModernBERT's: the learnt
entries, then [UNK] [CLS] [SEP] [PAD] [MASK], then [unused*] up to exactly --vocab-size; a
[CLS] $A [SEP] template) and DIR/tokenizer_config.json (the special tokens for transformers).
Each file is written under a temporary name renamed when complete. No text read (a plain-text
corpus read as JSON lines, a wrong --json-keys, an empty input) is an error, and an existing
vocabulary is not replaced by a smaller one without --force. Exit status: 0 done, 1 error, 2 bad
usage.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from pretrain.cli import positive_int, run_command
from pretrain.data.preprocess.corpus import INPUT_FORMATS


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/build_vocab.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE|GLOB|FOLDER",
                        help="input files or globs (quote globs); .gz .bz2 .xz .zst are decompressed; parquet: "
                             "files or folders of shards; arrow: a folder saved by datasets.save_to_disk")
    parser.add_argument("--input-format", default="jsonl", choices=INPUT_FORMATS,
                        help="jsonl: one JSON object per line (default); text-lines: one document per line; "
                             "text-blank-lines: documents separated by blank lines; parquet, arrow: tables")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSON keys (table columns) whose text is used (default: text)")
    parser.add_argument("--model", default="wordpiece", choices=("wordpiece", "bpe"),
                        help="wordpiece: BERT's vocab.txt and tokenizer.json (default); bpe: a byte-level BPE "
                             "tokenizer.json as ModernBERT's, special tokens after the learnt entries")
    case = parser.add_mutually_exclusive_group()
    case.add_argument("--lowercase", dest="lowercase", action="store_true", default=None,
                      help="lowercase (WordPiece: and strip accents, uncased BERT; the default for wordpiece)")
    case.add_argument("--cased", dest="lowercase", action="store_false",
                      help="keep case (and accents; the default for bpe, as ModernBERT and RoBERTa)")
    parser.add_argument("--vocab-size", type=positive_int, default=None,
                        help="entries, special tokens included (default 30522 for wordpiece, 50368 for bpe); "
                             "bpe fills up to exactly this size with [unused*] tokens")
    parser.add_argument("--min-frequency", type=positive_int, default=2, help="minimum count of a merged pair (default 2)")
    parser.add_argument("--limit-alphabet", type=positive_int, default=1000,
                        help="keep the N most frequent characters; rarer ones become [UNK] (default 1000; "
                             "wordpiece only: a byte-level BPE has all 256 bytes)")
    parser.add_argument("--output-dir", required=True,
                        help="directory for vocab.txt and tokenizer.json (bpe: tokenizer.json, tokenizer_config.json)")
    parser.add_argument("--strict", action="store_true", help="a malformed input line is an error, not a counted skip")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing vocabulary in --output-dir even by a smaller one")
    args = parser.parse_args(argv)
    bpe = args.model == "bpe"
    if args.lowercase is None:
        args.lowercase = not bpe
    if args.vocab_size is None:
        args.vocab_size = 50368 if bpe else 30522
    return args


def main(argv=None) -> int:
    # ValueError: the options the vocabulary builder refuses (build_vocab lists them in one message)
    return run_command(parse_args, build, argv, name="build_vocab", input_errors=(ValueError, OSError),
                       interrupted="no output written")


def build(args: argparse.Namespace) -> None:
    from pretrain.data.preprocess.corpus import CorpusError, expand_inputs, layout_hint
    from pretrain.data.preprocess.vocab_builder import VocabOptions, build_vocab

    try:
        files = expand_inputs(args.input, args.input_format)
    except CorpusError:
        files = []  # build_vocab names the input that is missing
    for path in files:  # as preprocess_data.py says it: a vocabulary learnt from such documents is off too
        hint = layout_hint(path, args.input_format)
        if hint:
            print(f"warning: {hint}", file=sys.stderr)
    options = VocabOptions(vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                           limit_alphabet=args.limit_alphabet, lowercase=args.lowercase, model=args.model)
    started = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    report = build_vocab(args.input, args.input_format, args.json_keys, options,
                         vocab_path=os.path.join(args.output_dir, "vocab.txt"),
                         tokenizer_json_path=os.path.join(args.output_dir, "tokenizer.json"), strict=args.strict,
                         replace_larger=args.force)
    malformed = sum(report.problem_counts.values())
    print(f"read {report.files} file{'s' if report.files != 1 else ''}: {report.documents:,} documents, "
          f"{report.text_chars / 1e6:,.1f} M characters")
    print(f"malformed lines skipped: {malformed:,}"
          + (f" ({', '.join(f'{k} {v:,}' for k, v in report.problem_counts.items())})" if malformed else ""))
    for problem in report.problems:
        print(f"  {problem}")
    note = "" if report.vocab_size == args.vocab_size else " (the corpus supports no more)"
    if report.unused:
        note = (f" ({report.vocab_size - report.unused:,} learnt and special, {report.unused:,} [unused*] filling up "
                "to --vocab-size: the corpus supports no more merges)")
    kind = "byte-level BPE" if args.model == "bpe" else "WordPiece"
    print(f"vocabulary: {report.vocab_size:,} entries{note}, {kind}, {'lowercased' if args.lowercase else 'cased'}")
    print(f"wrote {', '.join(report.outputs)} in {time.perf_counter() - started:,.1f} s")


if __name__ == "__main__":
    sys.exit(main())
