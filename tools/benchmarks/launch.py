"""Time to the first log line of a launch, with two checkouts side by side (issue 37, item 6).

usage: python tools/benchmarks/launch.py CHECKOUT_A CHECKOUT_B [--rounds 3]

Each checkout has its own `.venv` (bash tools/install.sh there). The launches alternate A, B, A,
B, ...: a 2-rank BERT-tiny job of one step on synthetic data (`./launcher.sh --nproc-per-node 2
pretrain`) that saves a checkpoint, then the one-process fill-mask tool on it. The environment is
the caller's: with TORCH_EXTENSIONS_DIR unset, DeepSpeed's JIT-built CPU communication op goes to
torch's default ~/.cache/torch_extensions, shared by both checkouts, in code before issue 37, and
to each environment's own `.venv/torch_extensions` since (pretrain/distributed/device.py:
prepare_extensions_dir); one-process tools stopped building it, and since then no process does
(distributed/internals.py: without_shared_memory_comm). Run it on two checkouts of the old commit,
then of the new one.

Prints the seconds from the command's start to the trainer's first log line, and fill-mask's wall
time, per launch, and their medians without the first round (which may build the op once).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

JOB = ["--config", "configs/bert-tiny.yaml", "model.vocab_size=1000", "train.train_steps=1", "train.global_batch_size=4",
       "train.micro_batch_size=2", "scheduler.warmup_steps=0", "logging.interval=1", "data.num_workers=0"]


def first_line_seconds(command: list[str], cwd: str, env: dict, marker: str) -> tuple[float, float]:
    """(seconds to the first output line containing `marker`, seconds to the end)."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    for line in process.stdout:
        if first is None and marker in line:
            first = time.monotonic() - started
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(command)} in {cwd} failed (exit {process.returncode}); run it for its error")
    return (first if first is not None else float("nan")), time.monotonic() - started


def write_vocab(path: str, size: int = 1000) -> str:
    """A vocabulary for fill-mask (a synthetic-data checkpoint keeps none): any tokens will do."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(tokens + [f"word{i}" for i in range(size - len(tokens))]) + "\n")
    return path


def measure(checkouts: list[str], rounds: int, work: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"launch": [], "fill-mask": []}
    vocab = write_vocab(os.path.join(work, "vocab.txt"))
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}  # launcher.sh: each checkout's .venv
    env["OMP_NUM_THREADS"] = "1"
    for round_ in range(rounds):
        for index, checkout in enumerate(checkouts):
            save = os.path.join(work, f"ck{index}-{round_}")
            first, _ = first_line_seconds(["bash", "launcher.sh", "--nproc-per-node", "2", "pretrain", *JOB,
                                           f"checkpoint.save_dir={save}"], checkout, env, "rank 0]")
            _, mask = first_line_seconds([os.path.join(checkout, ".venv", "bin", "python"), "tools/fill_mask.py",
                                          "--checkpoint", save, "--vocab-file", vocab, "--top-k", "1",
                                          "a [MASK] b"], checkout, env, "[MASK]")
            print(f"  round {round_ + 1} checkout {'AB'[index]}: first log line {first:5.1f} s, fill-mask {mask:5.1f} s",
                  flush=True)
            if round_:  # the first round may build the op once per directory: not the steady state
                times["launch"].append(first)
                times["fill-mask"].append(mask)
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkouts", nargs=2, help="two checkouts of this project, each with its .venv")
    p.add_argument("--rounds", type=int, default=3, help="launches per checkout and mode (the first is not counted)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="launch-bench-")
    try:
        print(f"TORCH_EXTENSIONS_DIR={os.environ.get('TORCH_EXTENSIONS_DIR', 'unset')}", flush=True)
        times = measure([os.path.abspath(c) for c in args.checkouts], args.rounds, work)
        print(f"median over rounds 2-{args.rounds}, both checkouts: first log line {statistics.median(times['launch']):.1f} s, "
              f"fill-mask wall {statistics.median(times['fill-mask']):.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
