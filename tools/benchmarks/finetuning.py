"""Fine-tuning benchmark: our runner against Hugging Face's Trainer on a sentence-pair task.

usage: python tools/benchmarks/finetuning.py [--work-dir DIR] [--train 2000] [--dev 500] [--batch 32]
                                           [--seq 128] [--threads 2] [--sides ...] [--json OUT]

The task: the demo's held-out sentence pairs (tools/demo/python_docs_corpus.py: does sentence 2
follow sentence 1 in Python's documentation? GLUE MRPC's layout), the first --train and --dev
pairs. The model: a BERT of all-MiniLM-L6-v2's shape (6 layers, hidden 384, 12 heads, FFN 1536),
randomly initialised from a seed (nothing is downloaded; speed does not depend on the weights),
with the demo corpus's 8,000-token WordPiece vocabulary, saved once as a Hugging Face directory
both sides load. One epoch of --train pairs at batch --batch, then one evaluation of the --dev
pairs, fp32, AdamW, --threads threads, each side in a fresh process, one after the other:

- ours-fixed: `finetune` with train.padding=max_length, train.group_by_length=false (every batch
  padded to --seq: the path of old);
- ours: the defaults (batches padded to their longest example rounded to 8, training batches
  grouped by length);
- hf-fixed: transformers' Trainer, the tokenizer padding to --seq;
- hf-dynamic: the Trainer with DataCollatorWithPadding and length-grouped sampling
  (train_sampling_strategy="group_by_length", transformers 5's spelling of group_by_length=True).

Reported per side: training examples/s (the epoch), evaluation examples/s, dev accuracy, the
whole process's wall time, peak RSS, and the ratios against ours.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tools.benchmarks.harness
from tools.benchmarks.harness import one_rank_world, write_json  # noqa: E402
SIDES = ("ours-fixed", "ours", "hf-fixed", "hf-dynamic")
LR = 5e-5


def prepare(work: Path, train: int, dev: int) -> tuple[Path, Path]:
    """(task directory with train.tsv and dev.tsv, model directory), built once in `work`."""
    data, model = work / "task", work / "model"
    if not (data / "dev.tsv").exists():
        corpus = work / "corpus"
        subprocess.run([sys.executable, "tools/demo/python_docs_corpus.py", "--output-dir", str(corpus)], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)
        data.mkdir(parents=True, exist_ok=True)
        for name, count in (("train.tsv", train), ("dev.tsv", dev)):
            lines = (corpus / "coherence" / name).read_text(encoding="utf-8").splitlines(keepends=True)
            (data / name).write_text("".join(lines[:count + 1]), encoding="utf-8")  # the header and `count` pairs
        subprocess.run([sys.executable, "tools/build_vocab.py", "--input", str(corpus / "corpus.jsonl"),
                        "--output-dir", str(work / "vocab"), "--vocab-size", "8000"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    if not (model / "config.json").exists():
        import torch
        from transformers import BertConfig, BertForPreTraining

        torch.manual_seed(0)
        BertForPreTraining(BertConfig(vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                      intermediate_size=1536, max_position_embeddings=512)).save_pretrained(model)
        (model / "vocab.txt").write_text((work / "vocab" / "vocab.txt").read_text(encoding="utf-8"), encoding="utf-8")
    return data, model


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0




def child_ours(args, fixed: bool) -> dict:
    from finetune.config import load_finetune_config
    from finetune.finetuner import Finetuner
    from finetune.tasks import TASKS
    from pretrain.distributed.parallel import shutdown_parallel

    overrides = [
        "task.name=mrpc", f"task.data_dir={args.data}", f"model.init_from={args.model}", f"task.max_seq_length={args.seq}",
        "train.epochs=1", f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
        f"train.eval_batch_size={args.batch}", f"train.lr={LR}", "train.keep_best=false", "train.progress=false",
        f"train.output_dir={args.work / ('out-' + args.side)}", "train.log_interval=1000",
        *(["train.padding=max_length", "train.group_by_length=false"] if fixed else []),
    ]
    cfg = load_finetune_config(None, overrides)
    cfg.validate(1, TASKS)
    parallel = one_rank_world()
    runner = Finetuner(cfg, parallel)
    accounting = token_accounting(runner, args) if not fixed else None
    started = time.perf_counter()
    summary = runner.train()  # one epoch, then the evaluation of the dev set
    total = time.perf_counter() - started
    started = time.perf_counter()
    runner.outputs(runner.dev_sets[0].features)  # the evaluation's forward passes again, alone
    evaluation = time.perf_counter() - started
    shutdown_parallel()
    return {"train_seconds": total - evaluation, "eval_seconds": evaluation,
            "accuracy": summary["best"]["metrics"]["accuracy"], "tokens": accounting}


def token_accounting(runner, args) -> dict:
    """Tokens one epoch computes under each way of batching the training pairs (the same epoch
    order: a seeded shuffle, grouped by length for the grouped ones): what packing could save."""
    import torch

    from finetune.inputs import length_grouped
    from finetune.finetuner import LENGTH_GROUP_WINDOW
    from pretrain.data.samples.packing import first_fit_decreasing

    lengths = runner.train_features.lengths.tolist()
    n = len(lengths)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(42)).tolist()
    grouped = length_grouped(shuffled, lengths, LENGTH_GROUP_WINDOW * args.batch)
    batches = {name: [order[k:k + args.batch] for k in range(0, n, args.batch)]
               for name, order in (("shuffled", shuffled), ("grouped", grouped))}

    def padded(name, multiple=1):
        return sum(len(b) * -(-max(lengths[i] for i in b) // multiple) * multiple for b in batches[name])

    def packed(name):  # rows of --seq, first-fit decreasing within each batch
        return sum(args.seq * len(first_fit_decreasing([lengths[i] for i in b], args.seq)) for b in batches[name])

    return {"real": sum(lengths), "max_length": n * args.seq, "longest": padded("shuffled"),
            "longest_grouped": padded("grouped"), "longest_grouped_multiple_of_8": padded("grouped", 8),
            "packed_rows": packed("shuffled"), "packed_rows_grouped": packed("grouped")}


def child_hf(args, dynamic: bool) -> dict:
    import numpy as np
    from transformers import (BertForSequenceClassification, BertTokenizerFast, DataCollatorWithPadding, Trainer,
                              TrainingArguments, default_data_collator)

    tokenizer = BertTokenizerFast(vocab_file=str(args.model / "vocab.txt"), do_lower_case=True)

    def read(name):
        rows = [line.rstrip("\n").split("\t") for line in (args.data / name).read_text(encoding="utf-8").splitlines()[1:]]
        encoded = tokenizer([r[3] for r in rows], [r[4] for r in rows], truncation=True, max_length=args.seq,
                            padding=False if dynamic else "max_length")
        return [{**{k: v[i] for k, v in encoded.items()}, "labels": int(r[0])} for i, r in enumerate(rows)]

    train, dev = read("train.tsv"), read("dev.tsv")
    model = BertForSequenceClassification.from_pretrained(args.model, num_labels=2, attn_implementation="sdpa")
    training = TrainingArguments(
        output_dir=str(args.work / f"out-{args.side}"), per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, num_train_epochs=1, learning_rate=LR, weight_decay=0.01,
        warmup_steps=int(0.1 * -(-len(train) // args.batch)), adam_epsilon=1e-6, save_strategy="no", report_to=[],
        logging_strategy="no", train_sampling_strategy="group_by_length" if dynamic else "random",
        dataloader_num_workers=0, use_cpu=True, seed=42, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=dev,
                      data_collator=DataCollatorWithPadding(tokenizer) if dynamic else default_data_collator,
                      compute_metrics=lambda p: {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())})
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    started = time.perf_counter()
    metrics = trainer.evaluate()
    eval_seconds = time.perf_counter() - started
    return {"train_seconds": train_seconds, "eval_seconds": eval_seconds, "accuracy": metrics["eval_accuracy"]}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    runs = {"ours-fixed": lambda: child_ours(args, fixed=True), "ours": lambda: child_ours(args, fixed=False),
            "hf-fixed": lambda: child_hf(args, dynamic=False), "hf-dynamic": lambda: child_hf(args, dynamic=True)}
    result = runs[args.side]()
    result["peak_rss_mb"] = peak_rss_mb()
    Path(args.child_out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="/tmp/finetune-benchmark")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--dev", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = Path(args.work_dir)
    if args.side:
        args.data, args.model = args.work / "task", args.work / "model"
        child(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    prepare(args.work, args.train, args.dev)
    results = {}
    for side in args.sides.split(","):
        out = args.work / f"{side}.json"
        started = time.perf_counter()
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
        subprocess.run([sys.executable, __file__, "--side", side, "--child-out", str(out),
                        *[f"--{k}={v}" for k, v in (("work-dir", args.work_dir), ("batch", args.batch),
                                                      ("seq", args.seq), ("threads", args.threads))]],
                       cwd=REPO, check=True, env=env, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        result["wall_seconds"] = time.perf_counter() - started
        result["train_examples_per_second"] = args.train / result["train_seconds"]
        result["eval_examples_per_second"] = args.dev / result["eval_seconds"]
        results[side] = result
        print(f"{side:<11} train {result['train_examples_per_second']:7.1f} ex/s ({result['train_seconds']:6.1f} s) | "
              f"eval {result['eval_examples_per_second']:7.1f} ex/s | accuracy {result['accuracy']:.4f} | "
              f"process {result['wall_seconds']:6.1f} s | peak RSS {result['peak_rss_mb']:,.0f} MB", flush=True)
    tokens = results.get("ours", {}).get("tokens")
    if tokens:
        print("tokens one epoch computes: " + ", ".join(f"{k} {v:,} ({v / tokens['real']:.3f}x real)"
                                                       for k, v in tokens.items()))
    if "ours" in results:
        for side, result in results.items():
            if side != "ours":
                print(f"ours / {side}: training {results['ours']['train_examples_per_second'] / result['train_examples_per_second']:.2f}x, "
                      f"evaluation {results['ours']['eval_examples_per_second'] / result['eval_examples_per_second']:.2f}x, "
                      f"process {result['wall_seconds'] / results['ours']['wall_seconds']:.2f}x")
    print(f"{args.train} training pairs (one epoch) and {args.dev} dev pairs, batch {args.batch}, seq {args.seq}, fp32, "
          f"{args.threads} threads, MiniLM-L6 shape (L6/H384/A12), each side in a fresh process")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
