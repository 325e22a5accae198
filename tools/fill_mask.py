"""Top-k predictions of a pretrained model for every [MASK] of a sentence (a quick sanity check).

usage: python tools/fill_mask.py --checkpoint CKPT [--top-k 5] [--vocab-file vocab.txt] [--tp 1] [--json]
         [--batch-size 32] "The capital of France is [MASK]." ["more sentences" ...]
       python tools/fill_mask.py --checkpoint CKPT --input-file lines.txt [...]

CKPT is a native checkpoint (a save_dir, following `latest`, or one iter_* directory; any layout)
or a Hugging Face directory with its MLM head (BertForPreTraining, BertForMaskedLM,
ModernBertForMaskedLM): a checkpoint without one (BertModel, ModernBertModel, a fine-tuned
classifier, or their native conversion) is refused rather than answered with random predictions.
The mask is written as the tokenizer spells it ([MASK] for BERT and ModernBERT, <mask> for a
RoBERTa-style tokenizer). Text is tokenized with the checkpoint's
own tokenizer (tokenizer.json, else vocab.txt, lowercasing as the vocabulary implies) unless
--vocab-file names another. Sentences come from the command line or, one per line, from
--input-file; each needs at least one [MASK], and every [MASK] gets its own list of the top-k
tokens with their probabilities (softmax over the whole vocabulary, vocabulary padding excluded):

  The capital of France is [MASK].
    [MASK] #1: paris 0.412 | lyon 0.101 | ...

--json prints one JSON object per sentence instead. Several processes (launcher.sh
--nproc-per-node 2 tool tools/fill_mask.py ... --tp 2) split the model with tensor parallelism,
or a ModernBERT's long texts with context parallelism (--cp: each text's tokens over the ranks);
rank 0 prints. Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from pretrain.cli import accept_launcher_args, positive_int, run_command, run_distributed
from pretrain.common.errors import UsageError, UserError
from pretrain.common.textfile import read_lines

MASK = "[MASK]"
MASK_SPELLINGS = (MASK, "<mask>")  # BERT's and ModernBERT's, RoBERTa's: checked before the tokenizer is read


class FillMaskError(UserError, ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/fill_mask.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sentences", nargs="*", metavar="SENTENCE", help=f"text with one or more {MASK}")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--input-file", help="one sentence per line, instead of SENTENCE arguments")
    parser.add_argument("--top-k", type=positive_int, default=5, help="predictions per [MASK] (default 5)")
    parser.add_argument("--vocab-file", help="vocab.txt or tokenizer.json; default: the checkpoint's own")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (the world size when launched)")
    parser.add_argument("--cp", type=positive_int, default=1,
                        help="context-parallel size: each text's tokens split over --cp processes (ModernBERT)")
    parser.add_argument("--json", action="store_true", help="one JSON object per sentence")
    parser.add_argument("--batch-size", type=positive_int, default=32)
    accept_launcher_args(parser)
    args = parser.parse_args(argv)
    if bool(args.sentences) == bool(args.input_file):
        parser.error("give sentences as arguments or --input-file FILE (exactly one of the two)")
    for name in ("top_k", "tp", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    return args


def read_sentences(args) -> list[tuple[str, str]]:
    """(how to name it in an error, text) of every sentence."""
    if not args.input_file:
        return [(f"sentence {i} {text!r}", text) for i, text in enumerate(args.sentences, start=1)]
    lines = read_lines(args.input_file, FillMaskError, what="--input-file ")
    sentences = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise FillMaskError(f"{args.input_file}:{number}: empty line (one sentence per line)")
        sentences.append((f"{args.input_file}:{number} {line!r}", line))
    if not sentences:
        raise FillMaskError(f"{args.input_file}: empty file")
    return sentences


def load_tokenizer_for(ckpt, checkpoint: str, vocab_file: str | None):
    """The tokenizer --vocab-file names, else the checkpoint's (tokenizer.json, else vocab.txt),
    as the fine-tuner chooses it; padding and truncation off."""
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer

    try:
        info = checkpoint_tokenizer(ckpt.vocab_dir, ckpt.config.model.vocab_size, checkpoint, vocab_file)
    except CheckpointError as e:
        raise FillMaskError(str(e)) from None
    info.tokenizer.no_padding()
    info.tokenizer.no_truncation()
    return info


def check_mlm_head(ckpt, checkpoint: str) -> None:
    """Refuse a checkpoint whose MLM head the reader (or hf-to-native) had to initialise."""
    if "MLM head" not in ckpt.initialised_heads:
        return
    from pretrain.checkpoint.load import is_hf_directory

    if is_hf_directory(checkpoint):
        from pretrain.checkpoint.hf import read_hf_config

        architecture = read_hf_config(checkpoint)[1]
        kind = f"a {architecture} directory" if architecture else "its config.json names no architecture"
        raise FillMaskError(f"{checkpoint} has no MLM head: {kind}; fill-mask needs a BertForPreTraining, "
                            "BertForMaskedLM or ModernBertForMaskedLM directory, or a pretraining checkpoint")
    raise FillMaskError(f"{ckpt.source} has no trained MLM head: it was converted from a source without one (a "
                        "BertModel or a fine-tuned classifier); fill-mask needs a pretraining checkpoint")


def encode(sentences, info, max_length: int) -> list:
    mask_id, mask = info.specials.mask_id, info.specials.token("mask")
    encodings = info.tokenizer.encode_batch([text for _, text in sentences])
    for (name, text), e in zip(sentences, encodings):
        wanted = text.count(mask)
        if wanted == 0:
            raise FillMaskError(f"{name}: no {mask} to fill (this tokenizer's mask token)")
        if e.ids.count(mask_id) != wanted:
            raise FillMaskError(f"{name}: the tokenizer ({info.source}) turned its {wanted} {mask} into "
                                f"{e.ids.count(mask_id)} mask token(s)")
        if len(e.ids) > max_length:
            raise FillMaskError(f"{name}: {len(e.ids)} tokens, the model takes at most {max_length}")
    return encodings


def predict(model, encodings, info, vocab_size: int, top_k: int, parallel, batch_size: int) -> list[list]:
    """For each encoding, for each [MASK] in order: (position, [(id, probability), ...] best first)."""
    import torch

    from pretrain.distributed.device import all_gather

    mask_id, pad_id = info.specials.mask_id, info.specials.pad_id
    results = []
    for start in range(0, len(encodings), batch_size):
        chunk = encodings[start:start + batch_size]
        positions = [[i for i, token in enumerate(e.ids) if token == mask_id] for e in chunk]
        length, masks = max(len(e.ids) for e in chunk), max(len(p) for p in positions)
        ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
        types = torch.zeros_like(ids)
        attention = torch.zeros_like(ids)
        where = torch.zeros((len(chunk), masks), dtype=torch.long)  # padding rows point at [CLS], ignored
        for row, (e, p) in enumerate(zip(chunk, positions)):
            ids[row, :len(e.ids)] = torch.tensor(e.ids)
            types[row, :len(e.ids)] = torch.tensor(e.type_ids)
            attention[row, :len(e.ids)] = 1
            where[row, :len(p)] = torch.tensor(p)
        with torch.no_grad():
            inputs = tuple(t.to(parallel.device) for t in (ids, types, attention, where))
            local, _ = model(inputs)  # [batch, masks, padded vocabulary / TP]: this rank's slice
            if parallel.tp_size > 1:
                local = torch.cat(all_gather(local, parallel.tp_group), dim=-1)
            probabilities = torch.softmax(local[..., :vocab_size].float(), dim=-1)  # padding rows dropped
            best = probabilities.topk(min(top_k, vocab_size), dim=-1)
        for row, p in enumerate(positions):
            results.append([(position, list(zip(best.indices[row, j].tolist(), best.values[row, j].tolist())))
                            for j, position in enumerate(p)])
    return results


def token_name(info, token_id: int) -> str:
    token = info.tokenizer.id_to_token(token_id)
    return token if token is not None else f"[id {token_id}]"  # beyond the tokenizer, inside the model's vocabulary


def token_text(info, token_id: int) -> str:
    """The prediction as transformers' fill-mask pipeline shows it (its token_str: the tokenizer's
    decoding of the one id): ' man' for byte-level BPE's 'Ġman', '##ing' for WordPiece's."""
    if info.tokenizer.id_to_token(token_id) is None:
        return token_name(info, token_id)
    return info.tokenizer.decode([token_id], skip_special_tokens=False)


def report(sentences, encodings, results, info, as_json: bool) -> list[str]:
    lines = []
    for (_, text), e, masks in zip(sentences, encodings, results):
        if as_json:
            lines.append(json.dumps({"sentence": text, "tokens": e.tokens, "masks": [
                {"mask": n, "position": position, "predictions": [
                    {"token": token_name(info, i), "token_str": token_text(info, i), "id": i, "probability": p}
                    for i, p in best]}
                for n, (position, best) in enumerate(masks, start=1)]}, ensure_ascii=False))
            continue
        lines.append(text)
        for n, (_, best) in enumerate(masks, start=1):
            lines.append(f"  {info.specials.token('mask')} #{n}: "
                         + " | ".join(f"{token_text(info, i)} {p:.3f}" for i, p in best))
    return lines


def run(args, parallel) -> list[str]:
    from pretrain.checkpoint.load import inference_model, read_any
    from pretrain.checkpoint.logical import check_layout

    sentences = read_sentences(args)
    missing = [name for name, text in sentences if not any(mask in text for mask in MASK_SPELLINGS)]
    if missing:  # before the checkpoint is read: the cheapest mistake to report
        raise FillMaskError(f"{missing[0]}: no {MASK} to fill" + (f" (and {len(missing) - 1} more sentence(s))"
                                                                   if len(missing) > 1 else ""))
    ckpt = read_any(args.checkpoint, with_optimizer=False)
    check_mlm_head(ckpt, args.checkpoint)
    check_layout(ckpt.config, parallel.tp_size, 1)
    info = load_tokenizer_for(ckpt, args.checkpoint, args.vocab_file)
    encodings = encode(sentences, info, ckpt.config.model.max_position_embeddings)
    model = inference_model(ckpt, parallel)
    results = predict(model, encodings, info, ckpt.config.model.vocab_size, args.top_k, parallel, args.batch_size)
    return report(sentences, encodings, results, info, args.json)


def main(argv=None) -> int:
    return run_command(parse_args, start, argv, name="fill_mask")


def start(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no "setting accelerator to CPU" warning
    predictions = sys.stdout
    # stdout carries the predictions (--json: nothing else): the libraries' chatter goes to stderr
    # (DeepSpeed's logger keeps the stream it found at import)
    with contextlib.redirect_stdout(sys.stderr):
        from pretrain.distributed.parallel import discover_launch_env

        launch = discover_launch_env()
        group = args.tp * args.cp
        if launch.world_size % group:
            if launch.rank != 0:
                return UsageError.exit_status  # rank 0 says why
            split = f"--tp {args.tp}" + (f" x --cp {args.cp}" if args.cp > 1 else "")
            raise UsageError(f"{split} needs a multiple of {group} processes, "
                             f"{launch.world_size} launched (launcher.sh --nproc-per-node {group} tool "
                             "tools/fill_mask.py ...)")

        def answer(parallel) -> None:
            lines = run(args, parallel)
            if parallel.rank == 0:
                print("\n".join(lines), file=predictions, flush=True)

        return run_distributed(answer, args.tp, launch=launch, context_parallel=args.cp)


if __name__ == "__main__":
    sys.exit(main())
