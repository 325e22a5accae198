"""Sentence embeddings of a text file with an encoder checkpoint, as sentence-transformers computes them.

usage: python tools/embed.py --checkpoint CKPT --input texts.txt --output embeddings.npy
         [--input-format lines|jsonl] [--json-key text] [--pooling mean|cls|last] [--[no-]normalize]
         [--max-length N] [--vocab-file F] [--batch-size 32] [--tp 1]

CKPT is a native checkpoint (any layout) or a Hugging Face BERT or ModernBERT directory. Each text
(one per line, or the --json-key field of each JSON line) is tokenized with the checkpoint's own
tokenizer ([CLS] text [SEP]), run through the encoder, and pooled from the last layer's token
states (finetune/embedding/loss.py's `pool`: mean over the real tokens, the first token, or the
last real token), optionally L2-normalised; a sentence-transformers model (what `python -m finetune
embed` and the converters export) gives its own pooling and normalisation as the defaults. Texts
longer than --max-length tokens (default: the length the checkpoint was trained at,
checkpoint/trained_length.py) are cut, and counted. The output is a float32 [texts, hidden] .npy, rows in input order, written whole or not at all; an
existing file there is refused, never replaced.
Several processes (launcher.sh ... tool tools/embed.py ... --tp 2) split the model with tensor
parallelism. Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pretrain.cli import accept_launcher_args, positive_int, run_command
from pretrain.common.errors import UserError

POOLING_MODES = ("mean", "cls", "last")  # finetune/embedding/loss.py's (not imported here: torch)


class EmbedError(UserError, ValueError):
    """An input file that cannot be embedded, named."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/embed.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True, help="one text per line, or JSON lines (--input-format jsonl)")
    parser.add_argument("--output", required=True, help="a .npy file")
    parser.add_argument("--input-format", choices=("lines", "jsonl"), default="lines")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--pooling", choices=POOLING_MODES, default=None,
                        help="default: a sentence-transformers model's own (our exports), else mean")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalise each embedding (default: as a sentence-transformers model says, else not)")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens per text, longer ones cut (default: the length the checkpoint was trained at)")
    parser.add_argument("--vocab-file", help="default: the checkpoint's own tokenizer")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (the world size when launched)")
    accept_launcher_args(parser)
    return parser.parse_args(argv)


def read_texts(path: str, input_format: str, json_key: str) -> list[str]:
    """The texts of the input file; an empty text or a bad JSON line is an error naming its line."""
    texts = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if input_format == "jsonl":
                    if not line.strip():
                        continue
                    try:
                        value = json.loads(line).get(json_key)
                    except (json.JSONDecodeError, AttributeError):
                        raise EmbedError(f"{path}:{number}: not a JSON object") from None
                    if not isinstance(value, str):
                        raise EmbedError(f"{path}:{number}: no text under '{json_key}'")
                    line = value
                if not line.strip():
                    raise EmbedError(f"{path}:{number}: empty text (every line is one text to embed)")
                texts.append(line)
    except FileNotFoundError:
        raise EmbedError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise EmbedError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    if not texts:
        raise EmbedError(f"{path}: no text")
    return texts


def run(args, parallel) -> str:
    import numpy as np

    from pretrain.common.atomic import atomic_outputs
    from finetune.embedding.inference import SentenceEncoder, sentence_transformers_settings

    started = time.perf_counter()
    if os.path.exists(args.output):  # a user's file is never replaced
        raise EmbedError(f"--output {args.output} already exists: name a new file (or remove that one)")
    texts = read_texts(args.input, args.input_format, args.json_key)  # before the checkpoint: the cheapest mistake
    own = sentence_transformers_settings(args.checkpoint)  # (pooling, normalize) of a sentence-transformers export
    pooling = args.pooling or (own[0] if own else "mean")
    normalize = args.normalize if args.normalize is not None else bool(own and own[1])
    encoder = SentenceEncoder.load(args.checkpoint, parallel, args.vocab_file, args.max_length)
    encodings, cut = encoder.tokenize(texts)
    embeddings = encoder.encode(encodings, pooling, normalize, args.batch_size)
    if parallel.rank == 0:
        with atomic_outputs([args.output]) as temporary, open(temporary[args.output], "wb") as f:
            np.save(f, embeddings)
    return (f"embedded {len(texts):,} texts with {args.checkpoint} ({pooling} pooling"
            f"{', normalised' if normalize else ''}, at most {encoder.max_length} tokens; {cut:,} cut) into "
            f"{args.output} ({embeddings.shape[0]:,} x {embeddings.shape[1]}) in {time.perf_counter() - started:.1f} s")


def main(argv=None) -> int:
    return run_command(parse_args, start, argv, name="embed", input_errors=(OSError,))


def start(args: argparse.Namespace) -> int:
    from finetune.embedding.inference import start_on_ranks  # torch: after the arguments are checked

    return start_on_ranks(run, args)


if __name__ == "__main__":
    sys.exit(main())
