"""Benchmark of the BERT pretraining dataset: sample throughput, and whether the trainer waits.

usage: python tools/benchmarks/dataset.py [--prefix PREFIX --vocab-file vocab.txt | --corpus-dir DIR]
                                     [--samples 4000] [--train-steps 20] [--config configs/bert-mini.yaml]

Data: an existing preprocessed prefix, or (default) the text files of --corpus-dir (default
../shared/data/austen when it exists) turned into one with tools/build_vocab.py (30522 entries)
and tools/preprocess_data.py --split-sentences, one document per paragraph, in a temp dir.

Measured, one process unless said:
1. index build: the NSP segment table of the training split at seq 128 (what rank 0 builds once);
2. samples/s of dataset[i] (read, truncate, mask, pad) for seq 128 / 20 predictions and
   seq 512 / 80 predictions, static and dynamic masking, over --samples consecutive indices;
3. the trainer: --config (default bert-mini) on one rank, micro batch 32 at seq 128, for
   --train-steps steps with data.num_workers 0 (batches built inline) and 2 (loader processes):
   step time and the share of it spent waiting for batches (MicroBatchIterator.wait_seconds).
Targets (issue 3): >= 2,000 samples/s at seq 128 in one process; with workers the trainer never waits.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.benchmarks.harness import one_rank_world  # noqa: E402
DEFAULT_CORPUS = REPO.parent / "shared" / "data" / "austen"


def prepare(corpus_dir: Path, workdir: Path) -> tuple[str, str]:
    """Paragraphs of the corpus as JSON lines -> vocab.txt and a sentence-level indexed dataset."""
    import json

    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        sys.exit(f"error: no .txt files in {corpus_dir}; give --prefix and --vocab-file instead")
    jsonl = workdir / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as out:
        for path in files:
            for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
                text = " ".join(paragraph.split())
                if text:
                    out.write(json.dumps({"text": text}) + "\n")
    python = sys.executable
    subprocess.run([python, str(REPO / "tools/build_vocab.py"), "--input", str(jsonl), "--output-dir",
                    str(workdir / "vocab")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([python, str(REPO / "tools/preprocess_data.py"), "--input", str(jsonl), "--output-prefix",
                    str(workdir / "corpus"), "--vocab-file", str(workdir / "vocab/vocab.txt"), "--split-sentences",
                    "--workers", "2", "--quiet"], check=True)
    return str(workdir / "corpus_text_sentence"), str(workdir / "vocab/vocab.txt")


def sample_rates(prefix: str, vocab_file: str, samples: int, cache_dir: str) -> list[tuple[str, float, float]]:
    from pretrain.data.samples.bert_dataset import CorpusSpec, SampleSettings, build_split_dataset
    from pretrain.data.samples.token_ids import WordPieceVocab

    vocab = WordPieceVocab.from_file(vocab_file)
    rows = []
    for seq, predictions in ((128, 20), (512, 80)):
        for dynamic in (False, True):
            settings = SampleSettings(seq_length=seq, segment_pairs="nsp", short_seq_prob=0.1, masked_lm_prob=0.15,
                                      max_predictions=predictions, whole_word_masking=True, max_ngram=1,
                                      dynamic_masking=dynamic, seed=1234)
            started = time.perf_counter()
            dataset = build_split_dataset([CorpusSpec(prefix, 1.0)], 0, "949,50,1", 10**7, settings, vocab,
                                          cache_dir, True, None)
            build = time.perf_counter() - started
            started = time.perf_counter()
            for i in range(samples):
                dataset[i]
            rate = samples / (time.perf_counter() - started)
            rows.append((f"seq {seq}, {predictions} predictions, {'dynamic' if dynamic else 'static'} masking",
                         rate, build))
    return rows


def trainer_wait(prefix: str, vocab_file: str, config: str, steps: int, workers: int, cache_dir: str) -> tuple[float, float]:
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.data.samples.token_ids import WordPieceVocab
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.training.trainer import Trainer

    vocab = WordPieceVocab.from_file(vocab_file)
    cfg = load_config(config, [
        "data.kind=indexed", f"data.paths=[{prefix}]", f"data.vocab_file={vocab_file}", f"data.num_workers={workers}",
        f"data.index_cache_dir={cache_dir}", f"model.vocab_size={vocab.size}", "train.global_batch_size=32",
        "train.micro_batch_size=32", f"train.train_steps={steps + 2}", "scheduler.warmup_steps=1",
        "eval.interval=0", "checkpoint.save_interval=0"])
    cfg.validate(1)
    parallel = one_rank_world()
    trainer = None
    try:
        trainer = Trainer(cfg, parallel)
        data = trainer.loaders.training(trainer.train_data, 0)
        for _ in range(2):  # warm-up: loader start, first allocations
            trainer.train_step(data)
        data.wait_seconds = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(data)
        elapsed = time.perf_counter() - started
        return elapsed / steps, data.wait_seconds / elapsed
    finally:
        if trainer is not None:  # its loader processes, or the program waits for them at exit
            trainer.close_loaders()
        if dist.is_initialized():
            shutdown_parallel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", help="an indexed dataset prefix (with --vocab-file)")
    p.add_argument("--vocab-file")
    p.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--config", default=str(REPO / "configs/bert-mini.yaml"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.prefix:
            prefix, vocab_file = args.prefix, args.vocab_file
            if not vocab_file:
                sys.exit("error: --prefix needs --vocab-file")
        else:
            prefix, vocab_file = prepare(args.corpus_dir, workdir)
        cache = str(workdir / "index-cache")
        print(f"data: {prefix} ({os.path.getsize(prefix + '.bin') / 1e6:.1f} MB of token ids)")
        print(f"{'dataset (one process)':<52}{'samples/s':>10}{'index build s':>15}")
        for name, rate, build in sample_rates(prefix, vocab_file, args.samples, cache):
            print(f"{name:<52}{rate:>10.0f}{build:>15.2f}")
        print(f"\ntrainer: {Path(args.config).name}, micro batch 32, seq 128, one rank")
        print(f"{'loader':<30}{'step s':>8}{'waiting for data':>18}")
        for workers in (0, 2):
            step, waiting = trainer_wait(prefix, vocab_file, args.config, args.train_steps, workers, cache)
            print(f"{'inline' if workers == 0 else f'{workers} worker processes':<30}{step:>8.3f}{100 * waiting:>17.1f}%")


if __name__ == "__main__":
    main()
