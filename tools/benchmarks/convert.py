"""Time checkpoint conversion against a plain Hugging Face load + save of the same model.

usage: python tools/benchmarks/convert.py [--size base|large] [--tp 2] [--pp 2] [--workdir DIR]

Each step runs in its own process (what a user runs), measured for wall time, the time the
program reports for the work itself (without interpreter start-up and imports) and peak RSS:

  peer:          transformers BertForPreTraining.from_pretrained + save_pretrained (safetensors)
  hf-to-native:  tools/convert_checkpoint.py, to TP x PP
  reshard:       the TP x PP checkpoint, with optimizer moments, to TP1 x PP1
  native-to-hf:  the TP x PP checkpoint back to Hugging Face format

Rates are MB of fp32 weights (moments included for reshard) per second of work.
Needs transformers (pip install -e ".[test]").
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
         "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)}

PEER = r"""
import sys, time
from transformers import BertForPreTraining
started = time.perf_counter()
model = BertForPreTraining.from_pretrained(sys.argv[1])
model.save_pretrained(sys.argv[2])
print(f"done in {time.perf_counter() - started:.1f} s")
"""

MAKE = r"""
import sys, torch
from transformers import BertConfig, BertForPreTraining
torch.manual_seed(0)
model = BertForPreTraining(BertConfig(vocab_size=30522, **eval(sys.argv[2])))
model.save_pretrained(sys.argv[1])
specials = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
words = [f"w{i}" for i in range(30522 - len(specials))]
open(sys.argv[1] + "/vocab.txt", "w").write("\n".join(specials + words) + "\n")
"""

ADD_MOMENTS = r"""
import sys, torch
from pretrain.checkpoint.logical import read_native, write_native
ckpt = read_native(sys.argv[1])
ckpt.moments = {n: {"exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)} for n, w in ckpt.weights.items()}
ckpt.step = ckpt.optimizer_step = ckpt.scheduler_steps = 1000
write_native(ckpt, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
"""


def measured(args: list[str]) -> dict:
    """Run a command; wall seconds, the work seconds it reports ("done in X s"), peak RSS."""
    started = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out}\n{err}")
    work = re.search(r"done in ([0-9.]+) s", out)
    return {"wall": wall, "work": float(work.group(1)) if work else wall, "rss_gb": usage.ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="base")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--workdir", help="where to write the checkpoints (default: a temporary directory)")
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_convert-")
    paths = {name: os.path.join(work, name) for name in ("hf", "peer", "native", "moments", "resharded", "back")}
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
    py, tool = sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py")
    subprocess.run([py, "-c", MAKE, paths["hf"], repr(SIZES[args.size])], check=True, cwd=REPO)
    weights_mb = os.path.getsize(os.path.join(paths["hf"], "model.safetensors")) / 1e6

    results = {"peer (HF load + save)": (measured([py, "-c", PEER, paths["hf"], paths["peer"]]), weights_mb)}
    results[f"hf-to-native TP{args.tp} PP{args.pp}"] = (measured(
        [py, tool, "hf-to-native", "--input", paths["hf"], "--output", paths["native"], "--tp", str(args.tp),
         "--pp", str(args.pp)]), weights_mb)
    subprocess.run([py, "-c", ADD_MOMENTS, paths["native"], paths["moments"], str(args.tp), str(args.pp)],
                   check=True, cwd=REPO)
    results["reshard to TP1 PP1 (+ moments)"] = (measured(
        [py, tool, "reshard", "--input", paths["moments"], "--output", paths["resharded"], "--tp", "1", "--pp", "1"]),
        3 * weights_mb)
    results["native-to-hf"] = (measured(
        [py, tool, "native-to-hf", "--input", paths["native"], "--output", paths["back"]]), weights_mb)

    print(f"\nBERT-{args.size}: {weights_mb:.0f} MB of fp32 weights; {os.cpu_count()} CPUs; work dir {work}")
    print(f"| step | wall s | work s | MB/s (work) | peak RSS GB | work vs peer |")
    print(f"|---|---|---|---|---|---|")
    peer_work = results["peer (HF load + save)"][0]["work"]
    for name, (r, mb) in results.items():
        print(f"| {name} | {r['wall']:.1f} | {r['work']:.1f} | {mb / r['work']:.0f} | {r['rss_gb']:.2f} "
              f"| {r['work'] / peer_work:.2f}x |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
