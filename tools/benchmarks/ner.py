"""Token-classification benchmark: our fine-tuning step against Hugging Face's
BertForTokenClassification on the same windows, and the feature-based path's extraction and cache.

usage: python tools/benchmarks/ner.py [--model mini|base] [--seq 128] [--batch 8] [--steps 8] [--warmup 2]
                                      [--words 4000] [--threads 2] [--json out.json]

Method: a random-init BertForPreTraining of the chosen size (mini: L4 H256 A4; base: L12 H768
A12) and a synthetic CoNLL-2003 file (documents of names and other words, IOB1 tags) are written to
a temporary directory. Each side runs in a fresh child process (this script with --child), one
after the other:

- ours: the fine-tuning runner's real objects (one-rank gloo world, `Finetuner` with
  configs/finetune/conll2003.yaml and the size/batch overrides: our encoder + head under the
  DeepSpeed engine, AdamW, fp32); a step is the trainer's: forward, loss, backward, step.
- Hugging Face: BertForTokenClassification (SDPA attention) loaded from the same directory, the
  SAME windows (our TaggingFeatures: input ids, attention mask, labels -100 off first sub-tokens),
  torch AdamW with the same lr/betas/eps/weight-decay groups, gradient clipping to the same norm.
- features: the feature-based tagger's extraction of the last four layers for every word of the
  file (words/s), then the same call again, served by the cache.

Reported: median step time over --steps after --warmup, tokens/s (batch x seq), the ratio of our
time to Hugging Face's, peak RSS per side; extraction words/s and the cached read's time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from tools.benchmarks.harness import one_rank_world  # noqa: E402

SIZES = {"mini": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024),
         "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072)}
KINDS = ("PER", "ORG", "LOC", "MISC")


def write_inputs(root: str, model: str, words: int, seed: int = 0) -> None:
    """root/hf (random BertForPreTraining + vocab.txt) and root/train.txt (CoNLL, IOB1)."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    rng = random.Random(seed)
    names = {k: [f"{k.lower()}{i}" for i in range(50)] for k in KINDS}
    other = [f"w{i}" for i in range(400)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + other + [n for v in names.values() for n in v] + \
        [f"##{c}" for c in "abcdefghij"]
    torch.manual_seed(seed)
    BertForPreTraining(BertConfig(vocab_size=len(vocab), max_position_embeddings=512, **SIZES[model])).save_pretrained(
        os.path.join(root, "hf"))
    with open(os.path.join(root, "hf", "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    lines, count = [], 0
    while count < words:
        lines += ["-DOCSTART- -X- -X- O", ""]
        for _ in range(rng.randrange(8, 20)):  # sentences of a document
            for _ in range(rng.randrange(6, 25)):
                if rng.random() < 0.2:
                    kind = rng.choice(KINDS)
                    lines += [f"{n} NNP B-NP I-{kind}" for n in rng.sample(names[kind], rng.randrange(1, 3))]
                else:
                    lines.append(f"{rng.choice(other)}{rng.choice(['', 'a', 'bc'])} NN I-NP O")
                count += 1
            lines.append("")
    with open(os.path.join(root, "train.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def config(args, root: str, **overrides):
    from finetune.config import load_finetune_config

    values = {"model.init_from": os.path.join(root, "hf"), "task.train_file": os.path.join(root, "train.txt"),
              "task.dev_files": f"[{os.path.join(root, 'train.txt')}]", "task.max_seq_length": args.seq,
              "task.doc_stride": args.seq // 2, "train.global_batch_size": args.batch,
              "train.micro_batch_size": args.batch, "train.progress": "false", "train.keep_best": "false",
              "train.output_dir": os.path.join(root, "out"), **overrides}
    return load_finetune_config(os.path.join(REPO, "configs", "finetune", "conll2003.yaml"),
                                ["task.name=conll2003", *(f"{k}={v}" for k, v in values.items())])


def timed(step, warmup: int, steps: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        started = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def child_ours(args, root: str) -> dict:
    from finetune.finetuner import Finetuner

    parallel = one_rank_world()
    tuner = Finetuner(config(args, root), parallel)
    features, engine, task = tuner.train_features, tuner.engine, tuner.task

    def step(i):
        inputs, labels = features.batch(range(i * args.batch, (i + 1) * args.batch), parallel.device)
        loss = task.loss(engine(*inputs), labels)
        engine.backward(loss)
        engine.step()

    timed_windows = features.attention_mask[:(args.warmup + args.steps) * args.batch]
    return {"times": timed(step, args.warmup, args.steps), "windows": len(features),
            "real_token_share": float(timed_windows.float().mean())}  # the same windows on both sides


def child_hf(args, root: str) -> dict:
    import torch
    from transformers import BertForTokenClassification

    from finetune.tasks import TASKS
    from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer

    cfg = config(args, root)
    task = TASKS["conll2003"]
    read = task.read(cfg.task.train_file, "train", cfg.task)
    with open(os.path.join(root, "hf", "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    tokenizer = checkpoint_tokenizer(os.path.join(root, "hf"), vocab_size, root).tokenizer
    features = task.encode(tokenizer, read.examples, cfg.task, True)
    model = BertForTokenClassification.from_pretrained(os.path.join(root, "hf"), num_labels=len(task.labels),
                                                       attn_implementation="sdpa")
    t = cfg.train
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(0.9, 0.999), eps=1e-6)
    model.train()

    def step(i):
        index = torch.arange(i * args.batch, (i + 1) * args.batch)
        loss = model(input_ids=features.input_ids[index], attention_mask=features.attention_mask[index],
                     token_type_ids=features.token_type_ids[index], labels=features.labels[index]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad()

    timed_windows = features.attention_mask[:(args.warmup + args.steps) * args.batch]
    return {"times": timed(step, args.warmup, args.steps), "windows": len(features),
            "real_token_share": float(timed_windows.float().mean())}  # the same windows on both sides


def child_features(args, root: str) -> dict:
    from finetune.feature_tagger import FeatureTagger

    parallel = one_rank_world()
    tagger = FeatureTagger(config(args, root, **{"features.cache_dir": os.path.join(root, "cache")}), parallel)
    path = os.path.join(root, "train.txt")
    started = time.perf_counter()
    first = tagger.word_features("train", path, "train")
    extract = time.perf_counter() - started
    started = time.perf_counter()
    tagger.word_features("train", path, "train")
    return {"words": int(first.vectors.shape[0]), "width": int(first.vectors.shape[1]), "extract_s": extract,
            "cached_s": time.perf_counter() - started}


def run_child(kind: str, args, root: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, "--root", root, "--model", args.model,
               "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"the {kind} child failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SIZES), default="mini")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--words", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", choices=("ours", "hf", "features"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = {"ours": child_ours, "hf": child_hf, "features": child_features}[args.child](args, args.root)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as root:
        write_inputs(root, args.model, args.words)
        results = {kind: run_child(kind, args, root) for kind in ("ours", "hf", "features")}
    tokens = args.batch * args.seq
    print(f"BERT-{args.model}, seq {args.seq}, batch {args.batch}, {results['ours']['windows']} windows, "
          f"{args.threads} threads; median of {args.steps} steps after {args.warmup}")
    share = results["ours"]["real_token_share"]
    print(f"{'side':<14}{'step s':>9}{'tokens/s':>10}{'real tok/s':>12}{'peak RSS MB':>13}")
    for side in ("ours", "hf"):
        median = statistics.median(results[side]["times"])
        results[side]["median_s"], results[side]["tokens_per_s"] = median, tokens / median
        results[side]["real_tokens_per_s"] = share * tokens / median
        print(f"{side:<14}{median:>9.3f}{tokens / median:>10.0f}{share * tokens / median:>12.0f}"
              f"{results[side]['peak_rss_mb']:>13.0f}")
    ratio = results["ours"]["median_s"] / results["hf"]["median_s"]
    print(f"ours / Hugging Face step time: {ratio:.2f}")
    f = results["features"]
    print(f"features: {f['words']:,} words x {f['width']} values extracted in {f['extract_s']:.1f} s "
          f"({f['words'] / f['extract_s']:,.0f} words/s); read back from the cache in {f['cached_s']:.2f} s")
    results["ratio"] = ratio
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
