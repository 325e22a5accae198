"""Does a resume continue the checkpoint's sample sequence? Checked before any rank starts
(torch-free: `python -m pretrain` and launcher.sh's --check-config run it) and again by the
checkpointer when the run loads the checkpoint.

Sample i of a run is a function of the data settings below only (pretrain/data/samples/), so a
resume with the same settings continues exactly where the checkpoint stopped. A resume with, say,
another data.seq_length would read "sample 320" of a different sequence: some samples seen twice,
others never, where the docs promise an exact continuation. Such a resume is refused, naming the
keys; a new phase starts from the checkpoint with checkpoint.init_from, and
checkpoint.accept_new_data resumes (weights, optimizer, step, LR schedule) with the new settings'
sequence started over from its first sample.
"""
from __future__ import annotations

import json
import os

from ..config import Config, ConfigError, DataConfig
from .filenames import META
from .vocabulary import loaded_checkpoint

# The data.* keys that define the training sample sequence. Not among them: where files are read
# from (a corpus is named by its file name, so a moved data directory still resumes), the vocabulary
# file (checked by content, vocabulary.py), loader workers and caches, packing (the same samples per
# step, placed in fewer rows) and the validation / test corpora (evaluation only).
SEQUENCE_KEYS = ("kind", "paths", "weights", "weights_unit", "sampling_temperature", "sampling_alpha", "split", "seq_length", "max_predictions_per_seq", "masked_lm_prob",
                 "mask_token_share", "random_token_share",
                 "segment_pairs", "short_seq_prob", "whole_word_masking", "max_ngram", "masking", "seed")
SYNTHETIC_KEYS = ("num_samples", "synthetic_min_fraction")  # the synthetic corpus's own shape


def _corpus_names(paths: list[str]) -> list[str]:
    return [os.path.basename(os.path.normpath(path)) for path in paths]


def _comparable(data: DataConfig, key: str):
    value = getattr(data, key)
    if key == "paths":
        return _corpus_names(value)
    if key == "weights":  # shares: empty = equal, and [2, 2] = [1, 1] (to rounding: [0.1, 0.2] = [1, 2])
        weights = value or [1.0] * len(data.paths)
        return [round(w / sum(weights), 12) for w in weights]
    return value


def data_sequence_changes(saved: DataConfig, ours: DataConfig) -> list[str]:
    """'data.key: checkpoint X, run Y' for every sequence-defining setting that differs."""
    keys = SEQUENCE_KEYS + (SYNTHETIC_KEYS if ours.kind == saved.kind == "synthetic" else ())
    changes = []
    for key in keys:
        if key == "max_predictions_per_seq":
            # the masked-position budget: unset on both sides it follows keys compared here anyway;
            # set on either side (an older checkpoint's default 20 included), the budgets are compared
            explicit = saved.max_predictions_per_seq is not None or ours.max_predictions_per_seq is not None
            if explicit and saved.max_predictions() != ours.max_predictions():
                changes.append(f"data.{key}: checkpoint {saved.max_predictions()}, run {ours.max_predictions()}")
        elif _comparable(saved, key) != _comparable(ours, key):
            changes.append(f"data.{key}: checkpoint {getattr(saved, key)}, run {getattr(ours, key)}")
    return changes


def saved_data_config(tag_dir: str) -> DataConfig | None:
    """The data settings a checkpoint was trained with (its meta.json); None when it has read no
    sample (a conversion from Hugging Face: no sequence to continue) or when meta.json is unreadable
    (the resume reports that itself, naming the file)."""
    try:
        with open(os.path.join(tag_dir, META), encoding="utf-8") as f:
            meta = json.load(f)
        return Config.from_stored(meta["config"]).data if meta.get("consumed_samples") != 0 else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ConfigError):
        return None


def resumed_data_changes(cfg: Config) -> list[str]:
    """The changes between the data settings of the checkpoint this run resumes (its own latest in
    checkpoint.load_dir) and the run's; [] for a run that does not resume (from scratch, or
    checkpoint.init_from: a new run, whose sequence starts at its first sample anyway)."""
    found = loaded_checkpoint(cfg)
    if found is None or found[0] != "resumes":
        return []
    saved = saved_data_config(found[1])
    return [] if saved is None else data_sequence_changes(saved, cfg.data)


def data_sequence_problems(cfg: Config) -> list[str]:
    """One line when the run would resume a checkpoint into another sample sequence (unless
    checkpoint.accept_new_data)."""
    changes = resumed_data_changes(cfg)
    if not changes or cfg.checkpoint.accept_new_data:
        return []
    return [f"checkpoint.load_dir {cfg.checkpoint.load_dir}: its latest checkpoint was trained on another sample "
            f"sequence ({'; '.join(changes)}); a resume continues the checkpoint's sequence exactly, so set these "
            "keys back, start a new phase from it with checkpoint.init_from (and a new checkpoint.save_dir), or "
            "set checkpoint.accept_new_data=true to resume with the new sequence started over from its first sample"]
