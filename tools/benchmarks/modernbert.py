"""ModernBERT training speed against transformers' ModernBertForMaskedLM, on the same batches.

usage: python tools/benchmarks/modernbert.py [--work-dir DIR] [--config configs/modernbert-tiny.yaml]
                                             [--seqs 512,2048] [--tokens 16384] [--steps 3] [--threads 2] [--json OUT]

For each sequence length, in this one process (a one-rank gloo world), one optimizer step at a
time in alternation (the machine's drift falls on every side), after one untimed step each:
- ours, padded: our Trainer on the demo corpus (tools/demo/python_docs_corpus.py: Python's own
  documentation) with a byte-level BPE vocabulary of 8,000 (tools/build_vocab.py --model bpe),
  data.segment_pairs none, fp32, ZeRO-0, AdamW, dropout off; the global batch is --tokens tokens
  (rows of seq_length);
- ours, packed: the same samples, data.packing on (several documents per row, attention and
  rotary positions per document);
- transformers, padded: ModernBertForMaskedLM (attn_implementation sdpa, the same shape) trained
  with torch.optim.AdamW on the very batches of "ours, padded" (input_ids, attention_mask, the
  masked positions' labels), as the published configs set it (sparse_prediction false: its
  decoder runs over every token);
- transformers, sparse: the same with sparse_prediction true (its decoder at the masked positions
  only, what our model does), the fairest peer.
Real (non-padding) tokens per second of each and the ratios; the issue's targets are ours padded
>= 1.3x transformers padded and ours packed >= 2x.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tools.benchmarks.harness
from tools.benchmarks.harness import alternate, one_rank_world, token_rates, write_json  # noqa: E402
VOCAB = 8000


def run(*command: str) -> None:
    subprocess.run([sys.executable, *command], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def prepare(work: Path) -> tuple[str, str]:
    """(dataset prefix, tokenizer.json) of the demo corpus, built once in `work`."""
    prefix, tokenizer = work / "data" / "pydocs", work / "vocab" / "tokenizer.json"
    if not Path(f"{prefix}_text_sentence.idx").exists():
        run("tools/demo/python_docs_corpus.py", "--output-dir", str(work / "data"))
        corpus = str(work / "data" / "corpus.jsonl")
        run("tools/build_vocab.py", "--model", "bpe", "--input", corpus, "--output-dir", str(work / "vocab"),
            "--vocab-size", str(VOCAB))
        run("tools/preprocess_data.py", "--input", corpus, "--tokenizer-json", str(tokenizer), "--split-sentences",
            "--output-prefix", str(prefix), "--workers", "2", "--quiet")
    return f"{prefix}_text_sentence", str(tokenizer)


def config(args, prefix: str, tokenizer: str, seq: int, packing: bool, work: Path):
    from pretrain.config import load_config

    rows = max(1, args.tokens // seq)
    overrides = [
        "data.kind=indexed", f"data.paths=[{prefix}]", f"data.vocab_file={tokenizer}", f"model.vocab_size={VOCAB}",
        "data.segment_pairs=none", f"data.seq_length={seq}", f"data.max_predictions_per_seq={-(-seq * 15 // 100)}",
        f"data.index_cache_dir={work / 'index-cache'}", "data.num_workers=0", f"data.packing={str(packing).lower()}",
        f"train.global_batch_size={rows}", f"train.micro_batch_size={rows}", f"train.train_steps={args.steps + 2}",
        "eval.interval=0", "checkpoint.save_interval=0", "checkpoint.save_dir=null", "checkpoint.load_dir=null",
        "logging.tensorboard_dir=null", "logging.interval=1000", "scheduler.warmup_steps=0", "scheduler.decay=constant",
        "optimizer.name=adamw", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1", "parallel.zero_stage=0",
        "model.hidden_dropout=0.0", "model.attention_dropout=0.0", f"model.max_position_embeddings={max(seq, 512)}",
    ]
    cfg = load_config(args.config, overrides)
    cfg.validate(world_size=1)
    return cfg


def transformers_model(cfg, sparse: bool):
    import torch
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    from pretrain.data.preprocess.tokenizer import read_special_tokens

    m, specials = cfg.model, read_special_tokens(cfg.data.vocab_file)
    model = ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
        max_position_embeddings=m.max_position_embeddings, global_attn_every_n_layers=m.global_attn_every_n_layers,
        local_attention=m.local_attention, global_rope_theta=m.global_rope_theta, local_rope_theta=m.local_rope_theta,
        norm_eps=m.layernorm_epsilon, sparse_prediction=sparse, pad_token_id=specials.pad_id,
        cls_token_id=specials.cls_id, sep_token_id=specials.sep_id, bos_token_id=specials.cls_id,
        eos_token_id=specials.sep_id, attn_implementation="sdpa")).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01)


def transformers_step(model, optimizer, batch) -> None:
    import torch

    (input_ids, _types, padding_mask, positions), (masked_labels, weights, _) = batch
    labels = torch.full_like(input_ids, -100)
    rows = torch.arange(input_ids.shape[0])[:, None].expand_as(positions)
    keep = weights > 0
    labels[rows[keep], positions[keep]] = masked_labels[keep]
    loss = model(input_ids=input_ids, attention_mask=padding_mask, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def speed(args, cfgs: dict) -> dict:
    """Each side's real tokens per second (and computed ones) over the timed steps."""
    import torch

    from pretrain.data.samples.batches import collate, split_inputs_labels
    from pretrain.data.samples.provider import pretraining_datasets
    from pretrain.training.trainer import Trainer

    trainers = {name: Trainer(cfg, PARALLEL) for name, cfg in cfgs.items()}
    iterators = {name: t.loaders.training(t.train_data, 0) for name, t in trainers.items()}
    padded = cfgs["ours padded"]
    data, _, _ = pretraining_datasets(padded, is_builder=True, barrier=None)
    rows = padded.train.global_batch_size
    batches = [split_inputs_labels(collate([data[i] for i in range(s * rows, (s + 1) * rows)]), torch.device("cpu"))
               for s in range(args.steps + 1)]
    peers = {"transformers padded": transformers_model(padded, sparse=False),
             "transformers sparse": transformers_model(padded, sparse=True)}

    def ours(name):
        def step(round_: int) -> tuple[float, float]:
            metrics = trainers[name].train_step(iterators[name])
            real = float(batches[round_][0][2].sum())
            assert metrics["real_tokens"] == real, f"{name} step {round_}: {metrics['real_tokens']} real tokens, the peers {real}"
            return real, metrics["computed_tokens"]
        return step

    def peer(name):
        def step(round_: int) -> tuple[float, float]:
            transformers_step(*peers[name], batches[round_])
            return float(batches[round_][0][2].sum()), batches[round_][0][0].numel()
        return step

    timed = alternate({**{name: ours(name) for name in trainers}, **{name: peer(name) for name in peers}}, args.steps)
    for name, t in trainers.items():
        iterators[name].close()
        t.close_loaders()
    return {name: token_rates(rounds) for name, rounds in timed.items()}


PARALLEL = None


def main() -> None:
    global PARALLEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="/tmp/modernbert-benchmark")
    parser.add_argument("--config", default=str(REPO / "configs" / "modernbert-tiny.yaml"))
    parser.add_argument("--seqs", default="512,2048")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per global batch (rows x seq_length)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each side")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    PARALLEL = one_rank_world()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    prefix, tokenizer = prepare(work)
    results = []
    for seq in (int(s) for s in args.seqs.split(",")):
        cfgs = {name: config(args, prefix, tokenizer, seq, name == "ours packed", work)
                for name in ("ours padded", "ours packed")}
        row = {"seq": seq, "rows": cfgs["ours padded"].train.global_batch_size, **speed(args, cfgs)}
        base = row["transformers padded"]["real_tokens_per_second"]
        sparse = row["transformers sparse"]["real_tokens_per_second"]
        results.append(row)
        print(f"seq {seq:<5} rows {row['rows']:<3} real tok/s: " + " | ".join(
            f"{name} {row[name]['real_tokens_per_second']:,.0f}" for name in
            ("transformers padded", "transformers sparse", "ours padded", "ours packed"))
              + f" | ours padded / transformers padded {row['ours padded']['real_tokens_per_second'] / base:.2f}x"
              f" (/ sparse {row['ours padded']['real_tokens_per_second'] / sparse:.2f}x), ours packed "
              f"{row['ours packed']['real_tokens_per_second'] / base:.2f}x (/ sparse "
              f"{row['ours packed']['real_tokens_per_second'] / sparse:.2f}x) | padded rows "
              f"{100 * row['ours padded']['real_share_of_computed']:.0f}% real, packed "
              f"{100 * row['ours packed']['real_share_of_computed']:.0f}%", flush=True)
    print(f"config {args.config} (vocabulary {VOCAB}), {args.tokens} tokens per step, {args.steps} timed steps "
          f"each, {args.threads} threads, fp32, AdamW, one process")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
