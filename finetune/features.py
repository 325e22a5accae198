"""Feature extraction (the paper's feature-based approach, section 5.3): hidden states of chosen
layers for every token of every line of a text file, in google-research/bert's
extract_features.py JSON-lines format:

  {"linex_index": 0, "features": [{"token": "[CLS]", "layers": [{"index": -1, "values": [...]}, ...]}, ...]}

A line is one text, or two separated by " ||| " (a pair, as in the reference script). Layer -1 is
the last transformer layer; 0 is the embeddings' output.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from pretrain.checkpoint.format import CheckpointError
from pretrain.checkpoint.load import read_any
from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer
from pretrain.common.diskspace import disk_full_named
from pretrain.common.errors import UserError
from pretrain.model.rng import RngTracker, seed_streams
from pretrain.common.textfile import read_lines as read_text_lines

from .inputs import fixed_length_tokenizer
from .model import build_encoder, encoder_inputs, load_encoder


class FeatureError(UserError, ValueError):
    pass


def read_lines(path: str) -> list[str | tuple[str, str]]:
    lines = read_text_lines(path, FeatureError)
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise FeatureError(f"{path}:{number}: empty line (one text, or 'A ||| B', per line)")
        parts = line.split(" ||| ")
        if len(parts) > 2:
            raise FeatureError(f"{path}:{number}: more than one ' ||| ' separator")
        texts.append(tuple(parts) if len(parts) == 2 else parts[0])
    if not texts:
        raise FeatureError(f"{path}: empty file")
    return texts


@torch.no_grad()
def extract_features(checkpoint: str, input_file: str, output_file: str, layers: list[int], max_seq_length: int,
                     parallel, vocab_file: str | None = None, batch_size: int = 32) -> int:
    """Write the features of every line of input_file; returns the number of lines."""
    ckpt = read_any(checkpoint, with_optimizer=False)
    model_cfg = ckpt.config.model
    if any(not -model_cfg.num_layers - 1 <= layer <= model_cfg.num_layers for layer in layers):
        raise FeatureError(f"layers {layers}: the model has layers 0 (embeddings) to {model_cfg.num_layers} "
                           f"(or -1 to -{model_cfg.num_layers + 1})")
    try:
        info = checkpoint_tokenizer(ckpt.vocab_dir, model_cfg.vocab_size, checkpoint, vocab_file)
    except CheckpointError as e:
        raise FeatureError(str(e)) from None
    tokenizer = fixed_length_tokenizer(info.tokenizer, max_seq_length, info.specials)

    tracker = RngTracker(parallel.device)
    seed_streams(tracker, 0, parallel.tp_rank, 0, parallel.dp_rank)
    bert = build_encoder(model_cfg, parallel.tp_group, tracker)
    load_encoder(bert, ckpt.weights, model_cfg, parallel.tp_rank, parallel.tp_size)
    bert.to(parallel.device).eval()  # its inputs are made on the device below
    texts = read_lines(input_file)
    tmp = f"{output_file}.tmp{os.getpid()}"
    try:
        with disk_full_named(output_file, "the features"), open(tmp, "w", encoding="utf-8") as out:
            write_features(out, texts, tokenizer, bert, layers, batch_size, parallel.device)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):  # never opened
            os.remove(tmp)
        raise
    if parallel.rank == 0:
        os.replace(tmp, output_file)
    else:
        os.remove(tmp)
    return len(texts)


def write_features(out, texts, tokenizer, bert, layers: list[int], batch_size: int, device) -> None:
    """google-research/bert's JSON lines: every token with the values of each requested layer."""
    for start in range(0, len(texts), batch_size):
        encoded = tokenizer.encode_batch(texts[start:start + batch_size])
        ids = torch.tensor([e.ids for e in encoded], device=device)
        types = torch.tensor([e.type_ids for e in encoded], device=device)
        mask = torch.tensor([e.attention_mask for e in encoded], device=device)
        states = bert.hidden_states(encoder_inputs(ids, types, mask))
        for row, e in enumerate(encoded):
            features = []
            for position, token in enumerate(e.tokens):
                if not e.attention_mask[position]:
                    break
                features.append({"token": token, "layers": [
                    {"index": layer, "values": [round(v, 6) for v in states[layer][row, position].tolist()]}
                    for layer in layers]})
            out.write(json.dumps({"linex_index": start + row, "features": features}) + "\n")

