"""Sequence packing benchmark: pretraining with data.packing against the padded path, side by side.

usage: python tools/benchmarks/packing.py [--austen DIR] [--work-dir DIR] [--config configs/bert-mini.yaml]
                                          [--seqs 128,512] [--batch 64] [--steps 3] [--threads 2] [--json OUT]

For each corpus and sequence length, in this one process (a one-rank gloo world):
1. padding: real tokens / seq_length over the first SAMPLES (3,000) training samples (the project's own
   sample builder, google-research's segment rules, short_seq_prob 0.1), and the packing
   efficiency (real tokens / computed rows x seq_length) of first-fit decreasing over windows of
   32, 64 and 128 consecutive samples (data.packing packs a rank's share of a step: the window is
   global batch / data-parallel size);
2. training speed: two Trainers of the same config, one padded and one packed, each from sample 0
   (the same samples in every step), stepped in alternation (padded, packed, padded, ...: the
   machine's drift falls on both) after one untimed step each; real (non-padding) tokens per
   second of each, the ratio, and the computed tokens per second.

Corpora: the demo's Python-documentation corpus (tools/demo/python_docs_corpus.py: the prose
that ships with Python), and with --austen the Jane Austen novels (one document per paragraph:
--input-format text-blank-lines), each with its own 8,000-token WordPiece vocabulary. Prepared
data is kept in --work-dir and reused.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tools.benchmarks.harness
from tools.benchmarks.harness import alternate, one_rank_world, token_rates, write_json  # noqa: E402
WINDOWS = (32, 64, 128)
SAMPLES = 3000  # the padding figures' samples


def run(*command: str) -> None:
    subprocess.run([sys.executable, *command], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def prepare(work: Path, austen: str | None) -> dict[str, tuple[str, str]]:
    """corpus name -> (dataset prefix, vocab.txt), built once in `work`."""
    corpora = {}
    pydocs = work / "pydocs"
    if not (pydocs / "data_text_sentence.idx").exists():
        run("tools/demo/python_docs_corpus.py", "--output-dir", str(pydocs))
        sources = {"pydocs": ([str(pydocs / "corpus.jsonl")], "jsonl")}
    else:
        sources = {}
    corpora["pydocs"] = (str(pydocs / "data_text_sentence"), str(pydocs / "vocab" / "vocab.txt"))
    if austen:
        out = work / "austen"
        corpora["austen"] = (str(out / "data_text_sentence"), str(out / "vocab" / "vocab.txt"))
        if not (out / "data_text_sentence.idx").exists():
            sources["austen"] = (sorted(str(p) for p in Path(austen).glob("*.txt")), "text-blank-lines")
    for name, (files, kind) in sources.items():
        out = work / name
        run("tools/build_vocab.py", "--input", *files, "--input-format", kind, "--output-dir", str(out / "vocab"),
            "--vocab-size", "8000")
        run("tools/preprocess_data.py", "--input", *files, "--input-format", kind, "--vocab-file",
            str(out / "vocab" / "vocab.txt"), "--split-sentences", "--output-prefix", str(out / "data"),
            "--workers", "2", "--quiet")
    return corpora


def config(args, prefix: str, vocab: str, seq: int, packing: bool, work: Path):
    from pretrain.config import load_config

    micro = args.batch // 2  # two micro-batches per step: packed rows are dealt out to both
    overrides = [
        "data.kind=indexed", f"data.paths=[{prefix}]", f"data.vocab_file={vocab}", "model.vocab_size=8000",
        f"data.seq_length={seq}", f"data.max_predictions_per_seq={-(-seq * 15 // 100)}",
        f"data.index_cache_dir={work / 'index-cache'}", "data.num_workers=0", f"data.packing={str(packing).lower()}",
        f"train.global_batch_size={args.batch}", f"train.micro_batch_size={micro}",
        f"train.train_steps={max(args.steps + 1, -(-SAMPLES // args.batch))}",  # the dataset's size "eval.interval=0", "checkpoint.save_interval=0", "checkpoint.save_dir=null",
        "checkpoint.load_dir=null", "logging.tensorboard_dir=null", "logging.interval=1000", "scheduler.warmup_steps=0",
        "scheduler.decay=constant", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
        "parallel.zero_stage=0", "model.max_position_embeddings=512",
    ]
    cfg = load_config(args.config, overrides)
    cfg.validate(world_size=1)
    return cfg


def padding_figures(cfg, count: int = SAMPLES) -> dict:
    import numpy as np

    from pretrain.data.samples.packing import packing_efficiency
    from pretrain.data.samples.provider import pretraining_datasets

    train, _, _ = pretraining_datasets(cfg, is_builder=True, barrier=None)
    lengths = np.array([int(train[i]["padding_mask"].sum()) for i in range(count)])
    seq = cfg.data.seq_length
    efficiency = {w: float(np.mean([packing_efficiency(lengths[i:i + w], seq) for i in range(0, count - w + 1, w)]))
                  for w in WINDOWS}
    return {"real_share": float(lengths.sum() / (count * seq)), "p50_real_tokens": float(np.median(lengths)),
            "packing_efficiency": efficiency}


def speed(args, cfgs: dict) -> dict:
    """{padded, packed}: real and computed tokens per second over the timed steps."""
    from pretrain.training.trainer import Trainer

    trainers = {name: Trainer(cfg, PARALLEL) for name, cfg in cfgs.items()}
    iterators = {name: t.loaders.training(t.train_data, 0) for name, t in trainers.items()}

    def step_of(name):
        def step(_round: int) -> tuple[float, float]:
            metrics = trainers[name].train_step(iterators[name])
            return metrics["real_tokens"], metrics["computed_tokens"]
        return step

    timed = alternate({name: step_of(name) for name in trainers}, args.steps)
    for name, t in trainers.items():
        iterators[name].close()
        t.close_loaders()
    return {name: token_rates(rounds) for name, rounds in timed.items()}


PARALLEL = None


def main() -> None:
    global PARALLEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default_austen = REPO.parent / "shared" / "data" / "austen"
    parser.add_argument("--austen", default=str(default_austen) if default_austen.is_dir() else None,
                        help="directory of the Austen .txt files (default ../shared/data/austen when present)")
    parser.add_argument("--work-dir", default="/tmp/packing-benchmark")
    parser.add_argument("--config", default=str(REPO / "configs" / "bert-mini.yaml"))
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--batch", type=int, default=64, help="global batch in samples (two micro-batches)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    PARALLEL = one_rank_world()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpora = prepare(work, args.austen)
    results = []
    for corpus, (prefix, vocab) in corpora.items():
        for seq in (int(s) for s in args.seqs.split(",")):
            cfgs = {name: config(args, prefix, vocab, seq, name == "packed", work) for name in ("padded", "packed")}
            row = {"corpus": corpus, "seq": seq, **padding_figures(cfgs["padded"]), **speed(args, cfgs)}
            row["speedup"] = row["packed"]["real_tokens_per_second"] / row["padded"]["real_tokens_per_second"]
            results.append(row)
            eff = " ".join(f"{w}:{100 * e:.1f}%" for w, e in row["packing_efficiency"].items())
            print(f"{corpus:<7} seq {seq:<4} padding {100 * (1 - row['real_share']):5.1f}% (p50 "
                  f"{row['p50_real_tokens']:.0f} real tokens) | packing efficiency by window {eff} | real tok/s "
                  f"padded {row['padded']['real_tokens_per_second']:,.0f}, packed "
                  f"{row['packed']['real_tokens_per_second']:,.0f} = {row['speedup']:.2f}x | computed tok/s "
                  f"{row['padded']['computed_tokens_per_second']:,.0f} / {row['packed']['computed_tokens_per_second']:,.0f}"
                  f" | packed rows {100 * row['packed']['real_share_of_computed']:.1f}% real", flush=True)
    print(f"config {args.config}, global batch {args.batch} samples in 2 micro-batches, {args.steps} timed steps "
          f"each, {args.threads} threads, fp32, ZeRO-0, one process")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
