"""Contrastive training benchmark: `python -m finetune embed` against sentence-transformers' trainer.

usage: python tools/benchmarks/embedding.py [--work-dir DIR] [--pairs 2048] [--batch 32] [--seq 128]
                                          [--mini-batch 8] [--threads 2] [--sides ...] [--json OUT]

The data: the demo corpus's retrieval pairs (tools/demo/python_docs_corpus.py: a documentation
entry's summary line and the passage after it), the first --pairs. The model: a BERT of
all-MiniLM-L6-v2's shape (6 layers, hidden 384, 12 heads, FFN 1536) with the demo corpus's
8,000-token WordPiece vocabulary, randomly initialised from a seed (speed does not depend on the
weights), saved once as a Hugging Face directory both sides load. One epoch at batch --batch (full
batches only, no text twice in a batch), texts cut at --seq tokens, mean pooling, normalised,
MultipleNegativesRankingLoss (scale 20), AdamW at lr 5e-5 with 10 % warmup, fp32, --threads
threads, each side in a fresh process, one after the other:

- ours: `finetune.embedding` (each column embedded in one pass, its texts packed into rows:
  train.packing, the default);
- st: SentenceTransformerTrainer with MultipleNegativesRankingLoss and the NO_DUPLICATES sampler;
- ours-cached / st-cached: the same with gradient caching in mini-batches of --mini-batch
  (CachedMultipleNegativesRankingLoss on their side).

Reported per side: pairs/s of the epoch (pairs trained: steps x batch), real (non-padding) tokens
per second where we count them, peak RSS, and ours over theirs.
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

SIDES = ("ours", "st", "ours-cached", "st-cached")
LR = 5e-5


def prepare(work: Path, pairs: int) -> tuple[Path, Path]:
    """(the training pairs file, the model directory), built once in `work`."""
    corpus, model, data = work / "corpus", work / "model", work / f"pairs-{pairs}.jsonl"
    if not (corpus / "retrieval" / "train.jsonl").exists():
        subprocess.run([sys.executable, "tools/demo/python_docs_corpus.py", "--output-dir", str(corpus)], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)
    if not (work / "vocab" / "vocab.txt").exists():
        subprocess.run([sys.executable, "tools/build_vocab.py", "--input", str(corpus / "corpus.jsonl"),
                        "--output-dir", str(work / "vocab"), "--vocab-size", "8000"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    if not data.exists():
        lines = (corpus / "retrieval" / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
        data.write_text("".join(lines[:pairs]), encoding="utf-8")
    if not (model / "config.json").exists():
        import torch
        from transformers import BertConfig, BertModel, BertTokenizerFast

        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=8000, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                             intermediate_size=1536, max_position_embeddings=512)).save_pretrained(model)
        BertTokenizerFast(vocab_file=str(work / "vocab" / "vocab.txt"), do_lower_case=True).save_pretrained(model)
    return data, model


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def child_ours(args, cached: bool) -> dict:
    from finetune.embedding.config import load_embed_config
    from finetune.embedding.trainer import ContrastiveTrainer
    from pretrain.distributed.parallel import shutdown_parallel

    overrides = [f"data.train_files=[{args.data}]", f"model.init_from={args.model}", f"data.max_seq_length={args.seq}",
                 "train.epochs=1", f"train.global_batch_size={args.batch}", f"train.lr={LR}", "train.keep_best=false",
                 "train.progress=false", f"train.output_dir={args.work / ('out-' + args.side)}",
                 "train.overwrite_output_dir=true", "train.log_interval=100000",
                 *([f"train.micro_batch_size={args.mini_batch}"] if cached else [])]
    cfg = load_embed_config(None, overrides)
    cfg.validate(1)
    runner = ContrastiveTrainer(cfg, one_rank_world())
    counted = []
    add = runner._embed

    def counting(texts, window=None):  # the real tokens of the texts each step embeds (once per text)
        if window is not None or not cached:
            counted.append(sum(len(runner.token_ids[t]) for t in texts))
        return add(texts, window)

    runner._embed = counting
    started = time.perf_counter()
    summary = runner.train()
    seconds = time.perf_counter() - started
    shutdown_parallel()
    return {"seconds": seconds, "pairs": len(summary["train_losses"]) * args.batch, "real_tokens": sum(counted),
            "final_loss": summary["train_losses"][-1]}


def child_st(args, cached: bool) -> dict:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    try:  # sentence-transformers >= 6 (the old paths warn)
        from sentence_transformers.sentence_transformer import losses, modules as models
        from sentence_transformers.sentence_transformer.training_args import BatchSamplers
    except ImportError:
        from sentence_transformers import losses, models
        from sentence_transformers.training_args import BatchSamplers

    rows = [json.loads(line) for line in Path(args.data).read_text(encoding="utf-8").splitlines()]
    dataset = Dataset.from_dict({"anchor": [r["anchor"] for r in rows], "positive": [r["positive"] for r in rows]})
    transformer = models.Transformer(str(args.model), max_seq_length=args.seq)
    model = SentenceTransformer(modules=[transformer, models.Pooling(transformer.auto_model.config.hidden_size, "mean"),
                                         models.Normalize()], device="cpu")
    loss = (losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch) if cached
            else losses.MultipleNegativesRankingLoss(model))
    training = SentenceTransformerTrainingArguments(
        output_dir=str(args.work / f"out-{args.side}"), num_train_epochs=1, per_device_train_batch_size=args.batch,
        learning_rate=LR, warmup_steps=0.1, weight_decay=0.01, adam_epsilon=1e-6, save_strategy="no", report_to=[],
        logging_strategy="no", batch_sampler=BatchSamplers.NO_DUPLICATES, dataloader_drop_last=True,
        dataloader_num_workers=0, use_cpu=True, seed=42, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(model=model, args=training, train_dataset=dataset, loss=loss)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "pairs": trainer.state.global_step * args.batch, "real_tokens": None,
            "final_loss": result.training_loss}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    runs = {"ours": lambda: child_ours(args, cached=False), "ours-cached": lambda: child_ours(args, cached=True),
            "st": lambda: child_st(args, cached=False), "st-cached": lambda: child_st(args, cached=True)}
    result = runs[args.side]()
    result["peak_rss_mb"] = peak_rss_mb()
    Path(args.child_out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="/tmp/embedding-benchmark")
    parser.add_argument("--pairs", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.work = Path(args.work_dir)
    if args.side:
        child(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    data, model = prepare(args.work, args.pairs)
    results = {}
    for side in args.sides.split(","):
        out = args.work / f"{side}.json"
        started = time.perf_counter()
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
        log = args.work / f"{side}.log"  # the side's own output (the libraries' progress bars), kept apart
        with open(log, "w") as sink:
            done = subprocess.run([sys.executable, __file__, "--side", side, "--child-out", str(out), "--data", str(data),
                                   "--model", str(model),
                                   *[f"--{k}={v}" for k, v in (("work-dir", args.work_dir), ("batch", args.batch),
                                                                 ("seq", args.seq), ("mini-batch", args.mini_batch),
                                                                 ("threads", args.threads))]],
                                  cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        if done.returncode:
            sys.exit(f"{side} failed (exit {done.returncode}); its output: {log}")
        result = json.loads(out.read_text())
        result["wall_seconds"] = time.perf_counter() - started
        result["pairs_per_second"] = result["pairs"] / result["seconds"]
        tokens = f" | {result['real_tokens'] / result['seconds']:8,.0f} real tokens/s" if result["real_tokens"] else ""
        results[side] = result
        print(f"{side:<12} {result['pairs_per_second']:6.1f} pairs/s ({result['pairs']} pairs in {result['seconds']:6.1f} s)"
              f"{tokens} | final loss {result['final_loss']:.3f} | process {result['wall_seconds']:6.1f} s | "
              f"peak RSS {result['peak_rss_mb']:,.0f} MB", flush=True)
    for ours, theirs in (("ours", "st"), ("ours-cached", "st-cached")):
        if ours in results and theirs in results:
            print(f"{ours} / {theirs}: {results[ours]['pairs_per_second'] / results[theirs]['pairs_per_second']:.2f}x pairs/s")
    print(f"{args.pairs} pairs (one epoch), batch {args.batch}, seq {args.seq}, mini-batch {args.mini_batch} where cached, "
          f"fp32, {args.threads} threads, MiniLM-L6 shape (L6/H384/A12), each side in a fresh process")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
