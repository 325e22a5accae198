"""Hard negatives for contrastive training, mined with an embedding model (sentence-transformers'
mine_hard_negatives, exact search).

usage: python tools/mine_negatives.py --checkpoint MODEL --input pairs.jsonl --output mined.jsonl
         [--anchor-column anchor] [--positive-column positive] [--source-column S]
         [--corpus passages.jsonl [--corpus-key text]] [--num-negatives 3]
         [--range-min 0] [--range-max 100] [--margin M] [--max-score S] [--sampling top|random]
         [--pooling mean|cls|last] [--max-length N] [--batch-size 64] [--tp 1]

MODEL is a trained embedding model (`python -m finetune embed`'s best/, any sentence-transformers
export of ours, a native checkpoint or a Hugging Face BERT/ModernBERT directory). The corpus is
every distinct positive of the input, plus the texts of --corpus (JSON lines, the --corpus-key
field, or one text per line). Each anchor is scored against the whole corpus by cosine similarity;
its candidates, best first, leave out every positive the input gives that anchor (and the anchor's
own text). Of those, the ones at ranks --range-min to --range-max (0-based; skipping the very top
keeps likely unlabelled positives out) are taken, the first --num-negatives of them (--sampling
random: drawn from the whole window, seeded by --seed and the row); with --margin
only those scoring at least that much below the anchor's positive, with --max-score only those
scoring at most that (sentence-transformers' mine_hard_negatives' absolute margin and max_score).
The output has one JSON line per input row: anchor, positive, negatives (a list; train with
data.negative_columns=[negatives]) and the source column when given. A row with fewer candidates
than --num-negatives in the window is left out and counted; the summary says how many rows had
their positive ranked first. Written whole or not at all; an existing --output is refused.
Several processes (launcher.sh ... tool tools/mine_negatives.py ... --tp 2) split the model with
tensor parallelism. Exit status: 0 done, 1 bad input, 2 bad usage.
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
BLOCK = 256  # anchors scored against the corpus at a time: memory stays flat


class MiningError(UserError, ValueError):
    """An input that cannot be mined, named."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/mine_negatives.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input", required=True, help="(anchor, positive) rows: .jsonl, .tsv with a header, or .parquet")
    parser.add_argument("--output", required=True, help="a .jsonl file")
    parser.add_argument("--anchor-column", default="anchor")
    parser.add_argument("--positive-column", default="positive")
    parser.add_argument("--source-column", default=None, help="kept in the output (one source per training batch)")
    parser.add_argument("--corpus", help="more candidate passages: JSON lines (--corpus-key) or one per line")
    parser.add_argument("--corpus-key", default="text")
    parser.add_argument("--num-negatives", type=positive_int, default=3)
    parser.add_argument("--range-min", type=int, default=0, help="skip the candidates ranked above this (0-based)")
    parser.add_argument("--range-max", type=positive_int, default=100, help="look no further than this rank")
    parser.add_argument("--margin", type=float, default=None,
                        help="a negative scores at least this much below the anchor's positive (default: no such rule)")
    parser.add_argument("--max-score", type=float, default=None, help="a negative scores at most this (default: any)")
    parser.add_argument("--sampling", choices=("top", "random"), default="top",
                        help="top: the best-ranked in the window; random: drawn from the whole window (seeded), so a "
                             "few passages near every query do not become everyone's negative")
    parser.add_argument("--seed", type=int, default=42, help="of --sampling random")
    parser.add_argument("--pooling", choices=POOLING_MODES, default=None,
                        help="default: a sentence-transformers model's own (our exports), else mean")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="tokens per text (default: the length the checkpoint was trained at)")
    parser.add_argument("--vocab-file", help="default: the checkpoint's own tokenizer")
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (the world size when launched)")
    accept_launcher_args(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.range_min < args.range_max:
        parser.error(f"--range-min ({args.range_min}) must be >= 0 and below --range-max ({args.range_max})")
    return args


def read_corpus(path: str, key: str) -> list[str]:
    texts = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if path.lower().endswith((".jsonl", ".json")):
                    try:
                        value = json.loads(line).get(key)
                    except (json.JSONDecodeError, AttributeError):
                        raise MiningError(f"{path}:{number}: not a JSON object") from None
                    if not isinstance(value, str) or not value.strip():
                        raise MiningError(f"{path}:{number}: no text under '{key}'")
                    texts.append(value)
                else:
                    texts.append(line.rstrip("\n"))
    except FileNotFoundError:
        raise MiningError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise MiningError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None
    return texts


def mine(anchor_vectors, corpus_vectors, rows: list[tuple[int, int]], excluded: list[set[int]], args):
    """For each row (anchor index, positive's corpus index): the corpus indices of its negatives, or
    None when the window holds fewer than --num-negatives; and whether its positive ranked first.
    `excluded[a]`: the corpus indices anchor a may never take (its positives, its own text)."""
    import numpy as np

    corpus = corpus_vectors / np.maximum(np.linalg.norm(corpus_vectors, axis=1, keepdims=True), 1e-12)
    anchors = anchor_vectors / np.maximum(np.linalg.norm(anchor_vectors, axis=1, keepdims=True), 1e-12)
    depth = min(args.range_max + max(len(e) for e in excluded), len(corpus))
    found, first = [], []
    for start in range(0, len(rows), BLOCK):
        block = rows[start:start + BLOCK]
        scores = anchors[[a for a, _ in block]] @ corpus.T
        for (anchor, positive), row_scores in zip(block, scores):
            order = np.argsort(-row_scores, kind="stable")[:depth]  # ties: the earlier corpus entry first
            candidates = [int(i) for i in order if int(i) not in excluded[anchor]]
            first.append(int(order[0]) == positive)
            ceiling = min(np.inf if args.max_score is None else args.max_score,
                          np.inf if args.margin is None else row_scores[positive] - args.margin)
            window = [i for i in candidates[args.range_min:args.range_max] if row_scores[i] <= ceiling]
            if len(window) < args.num_negatives:
                found.append(None)
            elif args.sampling == "random":  # a draw per row from (seed, row): the same output on every run
                draw = np.random.default_rng([args.seed, len(found)]).choice(
                    len(window), args.num_negatives, replace=False)
                found.append([window[j] for j in sorted(draw)])
            else:
                found.append(window[:args.num_negatives])
    return found, first


def run(args, parallel) -> str:
    from finetune.embedding.data import Columns, ContrastiveDataError, read_examples
    from finetune.embedding.inference import SentenceEncoder, sentence_transformers_settings
    from pretrain.common.atomic import atomic_outputs

    started = time.perf_counter()
    if os.path.exists(args.output):  # a user's file is never replaced
        raise MiningError(f"--output {args.output} already exists: name a new file (or remove that one)")
    try:
        examples, report = read_examples(args.input, Columns(args.anchor_column, args.positive_column,
                                                             source=args.source_column))
    except ContrastiveDataError as error:
        raise MiningError(str(error)) from None
    corpus = list(dict.fromkeys([e.positive for e in examples] + (read_corpus(args.corpus, args.corpus_key)
                                                                   if args.corpus else [])))
    place = {text: i for i, text in enumerate(corpus)}
    anchors = list(dict.fromkeys(e.anchor for e in examples))
    anchor_index = {text: i for i, text in enumerate(anchors)}
    excluded = [set() for _ in anchors]
    for e in examples:
        excluded[anchor_index[e.anchor]].add(place[e.positive])
    for text, a in anchor_index.items():
        if text in place:
            excluded[a].add(place[text])
    own = sentence_transformers_settings(args.checkpoint)
    pooling = args.pooling or (own[0] if own else "mean")
    encoder = SentenceEncoder.load(args.checkpoint, parallel, args.vocab_file, args.max_length)
    anchor_vectors = encoder.encode(encoder.tokenize(anchors)[0], pooling, False, args.batch_size)
    corpus_vectors = encoder.encode(encoder.tokenize(corpus)[0], pooling, False, args.batch_size)
    rows = [(anchor_index[e.anchor], place[e.positive]) for e in examples]
    found, first = mine(anchor_vectors, corpus_vectors, rows, excluded, args)
    written = 0
    if parallel.rank == 0:
        with atomic_outputs([args.output]) as temporary, open(temporary[args.output], "w", encoding="utf-8") as f:
            for example, negatives in zip(examples, found):
                if negatives is None:
                    continue
                row = {"anchor": example.anchor, "positive": example.positive,
                       "negatives": [corpus[i] for i in negatives]}
                if args.source_column:
                    row[args.source_column] = example.source
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                written += 1
    short = sum(1 for negatives in found if negatives is None)
    return (f"{report.summary()}\nmined {args.num_negatives} negatives each for {written:,} of {len(examples):,} rows "
            f"from {len(corpus):,} passages with {args.checkpoint} ({pooling} pooling; ranks {args.range_min}-"
            f"{args.range_max}, margin {'none' if args.margin is None else args.margin}, max score "
            f"{'none' if args.max_score is None else args.max_score}); {short:,} rows left out with fewer "
            f"in that window; the positive ranked first for {sum(first) / max(len(first), 1):.1%} of rows; into "
            f"{args.output} in {time.perf_counter() - started:.1f} s")


def main(argv=None) -> int:
    return run_command(parse_args, start, argv, name="mine_negatives", input_errors=(OSError,))


def start(args: argparse.Namespace) -> int:
    from finetune.embedding.inference import start_on_ranks  # torch: after the arguments are checked

    return start_on_ranks(run, args)


if __name__ == "__main__":
    sys.exit(main())
