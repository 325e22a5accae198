"""Sweep benchmark: `python -m finetune sweep` against the loop users write without it, one
`python -m finetune TASK` process per trial, on the same trials.

usage: python tools/benchmarks/sweep.py [--work-dir DIR] [--train 400] [--dev 100] [--points 4] [--restarts 2]
                                        [--uneven] [--json OUT]

The task: an RTE-layout sentence-pair file (does sentence 2 repeat sentence 1, the tests' task) of
--train and --dev pairs; the model: the tests' tiny BERT (2 layers, hidden 64), randomly initialised,
saved as a Hugging Face directory. The grid: --points learning rates x --restarts seeds, 2 epochs
each, one slot on this machine. Both sides run the same trials with the same overrides, one after
the other; each side's wall time from its first process's start to its last one's end, the trials'
own seconds (from trial.json on the sweep's side), and the ratio. What the sweep saves is the work
done once per worker instead of once per trial: interpreter, torch/DeepSpeed imports, the process
group, reading model.init_from and tokenizing the task's files.

--uneven measures the queue instead: two slots, a grid of 2 learning rates x epochs [6, 1], so that
dealing the trials round robin in the sweep's order would give one slot both 6-epoch trials. It
prints the sweep's wall time, each slot's busy time (the sum of its trials' seconds, the slots read
from the claims), and what round robin would have cost on the same trials' seconds: the busier
round-robin slot's sum plus the same start-up.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(12)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_bert(root: Path) -> Path:
    import torch
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)).save_pretrained(root / "hf")
    (root / "hf" / "vocab.txt").write_text("\n".join(SPECIALS + WORDS + [f"x{i}" for i in range(15)]) + "\n")
    return root / "hf"


def repeat_task(root: Path, train: int, dev: int) -> dict[str, Path]:
    rng = random.Random(2)
    files = {}
    for split, n in (("train", train), ("dev", dev)):
        rows = ["index\tsentence1\tsentence2\tlabel"]
        for i in range(n):
            a = [rng.choice(WORDS) for _ in range(4)]
            same = rng.random() < 0.5
            b = a if same else [rng.choice(WORDS) for _ in range(4)]
            rows.append(f"{i}\t{' '.join(a)}\t{' '.join(b)}\t{'entailment' if same else 'not_entailment'}")
        files[split] = root / f"{split}.tsv"
        files[split].write_text("\n".join(rows) + "\n")
    return files


def timed_sweep(config: Path, sweep: dict) -> float | None:
    """Seconds of `python -m finetune sweep` on `sweep` (written to `config`); None when it failed
    (its output printed)."""
    config.write_text(json.dumps({"sweep": sweep}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "finetune", "sweep", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:] + done.stderr[-3000:], file=sys.stderr)
        return None
    return time.perf_counter() - started


def uneven(args) -> int:
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="sweep-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    hf, files = tiny_bert(root), repeat_task(root, args.train, args.dev)
    common = [f"model.init_from={hf}", "task.max_seq_length=12", "model.hidden_dropout=0", "model.attention_dropout=0",
              f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]"]
    out = root / "uneven"
    wall = timed_sweep(root / "uneven.yaml", {"tasks": ["rte"], "grid": {"train.lr": [1e-3, 5e-4], "train.epochs": [6, 1]},
                                              "output_dir": str(out), "overrides": common, "parallel_trials": 2})
    if wall is None:
        return 1
    queue = json.loads((out / ".slots" / "queue.json").read_text())["trials"]
    seconds = [json.loads((Path(e["directory"]) / "trial.json").read_text())["seconds"] for e in queue]
    slot_of = [int((out / ".slots" / "claims" / str(k)).read_text().split()[0]) for k in range(len(queue))]
    busy = [sum(s for s, slot in zip(seconds, slot_of) if slot == k) for k in range(2)]
    round_robin = [sum(seconds[k::2]) for k in range(2)]
    startup = wall - max(busy)
    report = {"trials": [e["id"] for e in queue], "seconds": seconds, "slot_of": slot_of, "wall_s": round(wall, 2),
              "slot_busy_s": [round(b, 2) for b in busy], "round_robin_busy_s": [round(b, 2) for b in round_robin],
              "round_robin_estimate_s": round(max(round_robin) + startup, 2),
              "round_robin_over_queue": round((max(round_robin) + startup) / wall, 2)}
    print(f"4 trials (rte, {args.train} training pairs, lr x epochs [6, 1]), 2 slots")
    for trial, s, slot in zip(report["trials"], seconds, slot_of):
        print(f"  {trial}: {s:6.1f} s on slot {slot}")
    print(f"  queue: {wall:6.1f} s wall; slots busy {busy[0]:.1f} s and {busy[1]:.1f} s")
    print(f"  round robin on the same trials: slots busy {round_robin[0]:.1f} s and {round_robin[1]:.1f} s, "
          f"about {report['round_robin_estimate_s']:.1f} s wall ({report['round_robin_over_queue']:.2f}x the queue's)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--dev", type=int, default=100)
    parser.add_argument("--points", type=int, default=4)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--uneven", action="store_true", help="two slots on trials of unequal length")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.uneven:
        return uneven(args)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="sweep-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    hf, files = tiny_bert(root), repeat_task(root, args.train, args.dev)
    lrs = [1e-3 / (2 ** k) for k in range(args.points)]
    common = [f"model.init_from={hf}", "task.max_seq_length=12", "train.epochs=2", "model.hidden_dropout=0",
              "model.attention_dropout=0", f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]"]
    sweep_s = timed_sweep(root / "sweep.yaml", {"tasks": ["rte"], "grid": {"train.lr": lrs}, "restarts": args.restarts,
                                                "output_dir": str(root / "sweep"), "overrides": common})
    if sweep_s is None:
        return 1
    records = [json.loads(p.read_text()) for p in (root / "sweep").rglob("trial.json")]
    in_trials = sum(r["seconds"] for r in records)

    started = time.perf_counter()
    for k, lr in enumerate(lrs):
        for restart in range(args.restarts):
            out = root / "loop" / f"lr-{k}" / f"restart-{restart}"
            one = subprocess.run([sys.executable, "-m", "finetune", "rte", *common, f"train.lr={lr}",
                                  f"train.seed={42 + restart}", f"train.output_dir={out}", "train.progress=false"],
                                 cwd=REPO, capture_output=True, text=True)
            if one.returncode != 0:
                print(one.stdout[-3000:] + one.stderr[-3000:], file=sys.stderr)
                return 1
    loop_s = time.perf_counter() - started
    trials = len(records)
    report = {"trials": trials, "sweep_s": round(sweep_s, 2), "sweep_s_per_trial": round(sweep_s / trials, 3),
              "sweep_inside_trials_s": round(in_trials, 2), "loop_s": round(loop_s, 2),
              "loop_s_per_trial": round(loop_s / trials, 3), "loop_over_sweep": round(loop_s / sweep_s, 2)}
    print(f"{trials} trials (rte, {args.train} training pairs, 2 epochs each, tiny BERT, one slot)")
    print(f"  sweep: {sweep_s:7.1f} s ({sweep_s / trials:.2f} s/trial; {in_trials:.1f} s inside the trials)")
    print(f"  loop of python -m finetune: {loop_s:7.1f} s ({loop_s / trials:.2f} s/trial)")
    print(f"  loop / sweep: {loop_s / sweep_s:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
