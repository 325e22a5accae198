"""SQuAD evaluation: a drop-in for the official evaluate-v1.1.py and evaluate-v2.0.py.

usage:
  python tools/evaluate_squad.py DATA.json PREDICTIONS.json [--version 1.1|2.0]
         [--na-prob-file NA_PROB.json] [--na-prob-thresh 1.0] [--out-file EVAL.json]

DATA.json is the official dataset file ({"version", "data": [articles]}), PREDICTIONS.json maps
question id -> answer text ("" = no answer). --version defaults to the dataset's "version".
Prints the official script's JSON (v1.1: exact_match, f1; v2.0: exact, f1, total, HasAns_*,
NoAns_*, and with --na-prob-file best_exact(_thresh), best_f1(_thresh)), or writes it to
--out-file. Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from finetune.squad_metrics import evaluate_v1, evaluate_v2  # noqa: E402
from pretrain.cli import run_command  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/evaluate_squad.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_file", metavar="data.json", help="input data JSON file")
    parser.add_argument("pred_file", metavar="pred.json", help="model predictions")
    parser.add_argument("--version", choices=("1.1", "2.0"), help="scoring rules (default: the dataset's version)")
    parser.add_argument("--out-file", "-o", metavar="eval.json", help="write accuracy metrics to file (default stdout)")
    parser.add_argument("--na-prob-file", "-n", metavar="na_prob.json", help="model estimates of probability of no answer")
    parser.add_argument("--na-prob-thresh", "-t", type=float, default=1.0,
                        help='predict "" if no-answer probability exceeds this (default = 1.0)')
    return parser.parse_args(argv)


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None


def evaluate(args) -> dict:
    dataset_json = _read_json(args.data_file, "data file")
    if not isinstance(dataset_json, dict) or not isinstance(dataset_json.get("data"), list):
        raise ValueError(f"data file {args.data_file}: expected {{\"version\": ..., \"data\": [articles]}}")
    predictions = _read_json(args.pred_file, "prediction file")
    if not isinstance(predictions, dict) or not all(isinstance(v, str) for v in predictions.values()):
        raise ValueError(f"prediction file {args.pred_file}: expected a JSON object of question id -> answer text")
    version = args.version or str(dataset_json.get("version", "1.1"))
    if version not in ("1.1", "2.0"):
        raise ValueError(f"data file {args.data_file}: version {version!r}; pass --version 1.1 or 2.0")
    warn = lambda message: print(message, file=sys.stderr)  # noqa: E731
    if version == "1.1":
        if str(dataset_json.get("version")) != "1.1":
            warn(f"Evaluation expects v-1.1, but got dataset with v-{dataset_json.get('version')}")
        return evaluate_v1(dataset_json["data"], predictions, warn)
    na_probs = _read_json(args.na_prob_file, "no-answer probability file") if args.na_prob_file else None
    return evaluate_v2(dataset_json["data"], predictions, na_probs, args.na_prob_thresh, warn)


def main(argv=None) -> int:
    # bad files: evaluate's own checks raise ValueError, the official scoring code meets a wrong
    # structure as KeyError or TypeError
    return run_command(parse_args, score, argv, name="evaluate_squad", input_errors=(ValueError, KeyError, TypeError))


def score(args: argparse.Namespace) -> None:
    result = evaluate(args)
    if args.out_file:
        with open(args.out_file, "w") as f:
            json.dump(result, f)
    else:
        print(json.dumps(result, indent=2) if args.version != "1.1" and "exact" in result else json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
