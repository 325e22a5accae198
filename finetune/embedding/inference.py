"""Sentence embeddings of texts with a checkpoint, as sentence-transformers computes them: what
tools/embed.py and tools/mine_negatives.py run.

`SentenceEncoder.load` reads a native checkpoint (any layout) or a Hugging Face BERT/ModernBERT
directory, builds its encoder on this rank's device (its TP shard) and its tokenizer ([CLS] text
[SEP], cut at the length the checkpoint was trained at unless told another); a directory that is
a sentence-transformers model (our exports are) gives its own pooling and normalisation as the
defaults. `encode` runs texts in batches of similar length and pools the last layer's token states
(loss.py's `pool`), rows in input order.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from .loss import pool

# sentence-transformers' Pooling config key of each of our modes
_ST_POOLING_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}


def sentence_transformers_settings(path: str) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers directory (modules.json, 1_Pooling/config.json),
    None for any other checkpoint or a pooling we do not compute (max, weighted mean)."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    types = {module.get("type", "").rsplit(".", 1)[-1]: module for module in modules}
    if "Pooling" not in types:
        return None
    with open(os.path.join(path, types["Pooling"].get("path", ""), "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    modes = [mode for key, mode in _ST_POOLING_KEYS.items() if config.get(key)]
    others = [key for key, value in config.items() if key.startswith("pooling_mode_") and value
              and key not in _ST_POOLING_KEYS]
    if len(modes) != 1 or others:
        return None
    return modes[0], "Normalize" in types


def start_on_ranks(run, args) -> int:
    """A tool's body `run(args, parallel)` (returning its summary line) on every launched rank, the
    model split over --tp of them; rank 0 prints the line. The launch is checked first."""
    import os

    from pretrain.cli import run_distributed
    from pretrain.common.errors import UserError
    from pretrain.distributed.parallel import discover_launch_env

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no "setting accelerator to CPU" warning
    launch = discover_launch_env()
    if launch.world_size % args.tp:
        raise UserError(f"--tp {args.tp} needs a multiple of {args.tp} processes, {launch.world_size} launched")

    def answer(parallel) -> None:
        line = run(args, parallel)
        if parallel.rank == 0:
            print(line, flush=True)

    return run_distributed(answer, args.tp, launch=launch)


@dataclass
class SentenceEncoder:
    model: torch.nn.Module
    tokenizer: object  # tokenizers.Tokenizer: [CLS] text [SEP], cut at max_length, no padding
    pad_id: int
    max_length: int
    parallel: object

    @classmethod
    def load(cls, checkpoint: str, parallel, vocab_file: str | None = None, max_length: int | None = None):
        from pretrain.checkpoint.load import inference_model, read_any
        from pretrain.checkpoint.logical import check_layout
        from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer
        from pretrain.checkpoint.trained_length import export_length

        from ..inputs import fixed_length_tokenizer

        ckpt = read_any(checkpoint, with_optimizer=False)
        m = ckpt.config.model
        check_layout(ckpt.config, parallel.tp_size, 1)
        info = checkpoint_tokenizer(ckpt.vocab_dir, m.vocab_size, checkpoint, vocab_file)
        length = min(max_length or export_length(ckpt.trained_length, m.max_position_embeddings),
                     m.max_position_embeddings)
        tokenizer = fixed_length_tokenizer(info.tokenizer, length, info.specials)
        tokenizer.no_padding()  # each batch is padded to its own longest text
        return cls(inference_model(ckpt, parallel), tokenizer, info.specials.pad_id, length, parallel)

    def tokenize(self, texts: list[str]) -> tuple[list, int]:
        """The encodings of `texts` and how many were cut at max_length."""
        encodings = self.tokenizer.encode_batch(texts)
        return encodings, sum(1 for e in encodings if e.overflowing)

    def encode(self, encodings: list, pooling: str, normalize: bool, batch_size: int) -> np.ndarray:
        """[texts, hidden] float32 embeddings of tokenized texts, rows in input order."""
        from ..model import encoder_inputs

        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        result = None
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            length = max(len(encodings[i].ids) for i in chunk)
            ids = torch.full((len(chunk), length), self.pad_id, dtype=torch.long)
            types, attention = torch.zeros_like(ids), torch.zeros_like(ids)
            for row, i in enumerate(chunk):
                e = encodings[i]
                ids[row, :len(e.ids)] = torch.tensor(e.ids)
                types[row, :len(e.ids)] = torch.tensor(e.type_ids)
                attention[row, :len(e.ids)] = 1
            ids, types, attention = (t.to(self.parallel.device) for t in (ids, types, attention))
            with torch.no_grad():
                hidden, _ = self.model.encode(encoder_inputs(ids, types, attention))
                vectors = pool(hidden.float(), attention, pooling, normalize).cpu().numpy()
            if result is None:
                result = np.zeros((len(encodings), vectors.shape[1]), dtype=np.float32)
            result[chunk] = vectors
        return result
