"""The longest sequence length a model's weights were trained at, every phase included: what an
export tells the tools that read a length (transformers' tokenizer_config.json `model_max_length`,
sentence-transformers' `max_seq_length`) instead of the positions the architecture could address
(a ModernBERT configured for 8,192 positions but trained on 128-token rows encodes a 273-token input
without a word otherwise).

A checkpoint keeps it in meta.json: the trainer's "trainer_state" (the run's data.seq_length and the
longest of the checkpoint it started from: a resume, a new phase, init_from), a converted checkpoint
at the top level (what its source said). A Hugging Face directory states it as its tokenizer's
`model_max_length` (or a sentence-transformers `max_seq_length`). Torch-free.
"""
from __future__ import annotations

import json
import os

KEY = "trained_seq_length"
# transformers writes int(1e30) as the model_max_length of a tokenizer that states none
_UNSTATED = 10 ** 9


def from_native_meta(meta: dict) -> int | None:
    """The length a native checkpoint's meta.json records; a checkpoint trained before the key
    existed: its own run's data.seq_length (earlier phases unknown); None when it says nothing."""
    state = meta.get("trainer_state") or {}
    for recorded in (state.get(KEY), meta.get(KEY)):
        if isinstance(recorded, int) and recorded > 0:
            return recorded
    if meta.get("consumed_samples"):  # trained here: its samples were data.seq_length long
        seq_length = ((meta.get("config") or {}).get("data") or {}).get("seq_length")
        return int(seq_length) if isinstance(seq_length, int) and seq_length > 0 else None
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def from_hf_dir(path: str) -> int | None:
    """The length a Hugging Face directory states (sentence-transformers' max_seq_length, else its
    tokenizer's model_max_length); None when it states none."""
    for file, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        value = _read_json(os.path.join(path, file)).get(key)
        if isinstance(value, (int, float)) and 0 < value < _UNSTATED:
            return int(value)
    return None


def longest(*lengths: int | None) -> int | None:
    known = [n for n in lengths if n]
    return max(known) if known else None


def export_length(trained: int | None, max_position_embeddings: int) -> int:
    """The length an export states: the trained one where known, never beyond the positions."""
    return min(trained, max_position_embeddings) if trained else max_position_embeddings
