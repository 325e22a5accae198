"""A training phase started from the previous phase's checkpoint (checkpoint.new_phase): what the
new phase changes, said at start-up, and how many tokens the run had seen before it.

A phase is `checkpoint.init_from: <the previous phase's checkpoint>` with `checkpoint.new_phase:
true`: weights and optimizer states (moments, step counts) at any layout, and everything else new:
step 0, the phase's own LR schedule, batch warmup and sample sequence (ModernBERT's
`restart_override`). Besides the settings a resume may change, a phase may change what the
weights do not fix: the rotary bases and scaling and, for ModernBERT (no position table), the context length
(PHASE_MODEL_KEYS), as its context extension does. Relaunching a phase resumes its own checkpoint
in checkpoint.load_dir, as any init_from run.
"""
from __future__ import annotations

import os

from ..config import Config, ConfigError
from .errors import CheckpointError

# model.* keys a new phase may set apart from its checkpoint's (the weights do not depend on them)
PHASE_MODEL_KEYS = ("global_rope_theta", "local_rope_theta", "rope_scaling", "max_position_embeddings")
# the sections whose changes the start-up line lists (the others name files, logging and the like)
OVERRIDDEN_SECTIONS = ("model", "optimizer", "scheduler", "train", "data")
# keys that differ between phases without being a setting of the training (where files lie)
NOT_SETTINGS = {"data": ("paths", "valid_paths", "test_paths", "vocab_file", "index_cache_dir", "num_workers")}


def phase_model_keys(cfg: Config) -> tuple[str, ...]:
    """The model.* keys this run may set apart from its init_from checkpoint's: a new phase, or
    weights alone (a Hugging Face directory; a context extension of the published ModernBERT-base
    starts there), may change what the weights do not fix."""
    if not cfg.checkpoint.init_from:
        return ()
    return PHASE_MODEL_KEYS if cfg.model.modern else PHASE_MODEL_KEYS[:3]


def previous_phase(cfg: Config) -> tuple[str, Config, dict]:
    """(tag directory, config, meta.json) of the checkpoint a new phase starts from."""
    from .load import native_meta  # torch's import: not for the pre-start checks that read this module

    path = cfg.checkpoint.init_from
    found = native_meta(path) if path and os.path.exists(path) else None
    if found is None:
        raise CheckpointError(f"checkpoint.new_phase: checkpoint.init_from {path} is not a checkpoint of this "
                              "trainer (a new phase continues its optimizer states; a Hugging Face directory has none)")
    tag_dir, meta = found
    try:
        return tag_dir, Config.from_stored(meta["config"], f"{tag_dir}/meta.json"), meta
    except ConfigError as e:
        raise CheckpointError(f"checkpoint.new_phase: {tag_dir}/meta.json: {e}") from None


def overrides(previous: Config, ours: Config) -> list[str]:
    """'section.key: previous -> ours' for every training setting the new phase changes."""
    theirs, mine = previous.to_dict(), ours.to_dict()
    # settings compared as resolved (unset: what the run derives)
    theirs["data"]["max_predictions_per_seq"] = previous.data.max_predictions()
    mine["data"]["max_predictions_per_seq"] = ours.data.max_predictions()
    changed = []
    for section in OVERRIDDEN_SECTIONS:
        skip = NOT_SETTINGS.get(section, ())
        for key, value in mine[section].items():
            if key not in skip and key in theirs[section] and theirs[section][key] != value:
                changed.append(f"{section}.{key} {theirs[section][key]} -> {value}")
    return changed


def tokens_seen(meta: dict, config: Config) -> int:
    """The tokens a checkpoint's run had trained on, its earlier phases included."""
    state = meta.get("trainer_state") or {}
    if "tokens_seen" in state:
        return int(state["tokens_seen"])
    return int(meta.get("consumed_samples", 0)) * config.data.seq_length  # saved before the count was kept
