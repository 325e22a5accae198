"""What a run starts from, read before torch: the model.* keys of `checkpoint.init_from` (a native
checkpoint's meta.json or a Hugging Face directory's config.json), the problems with it, and the
heads it lacks.

Continued pretraining (BioBERT, SciBERT, an in-house encoder from a published BERT) needs the model's
shape exactly: every model.* key the config and the command line leave unset is taken from the
checkpoint (`load_run_config`: the config layer's load_config with `inherit_model_keys`), and a key
set to another value is refused by the pre-start check with both values, before any rank starts.

checkpoint.init_tiled grows a smaller ModernBERT into this run's larger one (tiling.py): the shape
keys (TILED_SHAPE_KEYS) are then the run's own, never inherited, and must be at least the
checkpoint's (`tiling_problems`); every other inherited key is taken or compared as above.
"""
from __future__ import annotations

import json
import os

from typing import Sequence

from ..config import Config, ConfigError, load_config
from ..data.preprocess.groups import expand_group_manifests
from ..data.samples.provider import vocab_size_from_tokenizer
from .errors import CheckpointError
from .filenames import CONFIG_JSON, LATEST, META
from .hf_config import ARCHITECTURE_HEADS, HF_MODEL_KEYS, config_from_hf, read_hf_config
from .phases import phase_model_keys
from .vocabulary import loaded_checkpoint

# The model.* keys a run takes from its init_from checkpoint: the architecture and shape, what the
# weights were trained to compute with (LayerNorm epsilon; ModernBERT's attention pattern, rotary
# bases and scaling, biases). Dropout and the initialisation range are the new run's choice.
INHERITED_KEYS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                  "max_position_embeddings", "type_vocab_size", "layernorm_epsilon", "global_attn_every_n_layers",
                  "local_attention", "global_rope_theta", "local_rope_theta", "rope_scaling", "norm_bias",
                  "attention_bias", "mlp_bias", "classifier_bias")
REPORTED_KEYS = tuple(dict.fromkeys(INHERITED_KEYS + tuple(HF_MODEL_KEYS)))
# checkpoint.init_tiled: the keys a tiled run grows (its own, at least the checkpoint's), and those the
# tiling needs equal (tiling.py copies each bias only where both models have it; the reference
# refuses another vocabulary)
TILED_SHAPE_KEYS = ("hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size")
TILED_EQUAL_KEYS = ("architecture", "vocab_size", "norm_bias", "attention_bias", "mlp_bias", "classifier_bias")
# What a head that starts from random weights means for the first steps of a continued pretraining.
UNTRAINED_HEAD_MEANING = {
    "MLM head": "the masked-LM loss starts near ln(vocabulary size) (10.3 for 30k tokens), not near the 1.5-2.5 "
                "of a trained head, and for the first few hundred steps the predictions are the corpus's most "
                "frequent tokens (',', '.', 'the') while the head learns; the encoder is pretrained, so the loss "
                "falls much faster than from scratch. A BertForPreTraining or BertForMaskedLM checkpoint keeps "
                "its trained head",
    "next-sentence head": "the next-sentence loss starts near ln 2 = 0.69 (chance); data.segment_pairs=none "
                          "trains without it",
}


def _is_hf_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_JSON)) and not os.path.exists(os.path.join(path, LATEST))


def _native_tag_dir(path: str) -> str:
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        return path
    with open(latest, encoding="utf-8") as f:
        return os.path.join(path, f.read().strip())


def read_model_keys(path: str) -> tuple[dict, str, list[str]]:
    """(model.* keys, the file they come from, the pretraining heads it lacks) of a native
    checkpoint (a save_dir or one iter_* directory) or a Hugging Face BERT directory."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    if _is_hf_directory(path):
        hf, architecture = read_hf_config(path)
        source = os.path.join(path, CONFIG_JSON)
        # a config.json naming no architecture: the weights tell (hf.read_hf), not checked here
        lacks = [head for head in UNTRAINED_HEAD_MEANING if head not in ARCHITECTURE_HEADS[architecture]] \
            if architecture else []
        model = config_from_hf(hf, source).model  # checked and typed; transformers' defaults where absent
        return {key: getattr(model, key) for key in REPORTED_KEYS}, source, lacks
    try:
        source = os.path.join(_native_tag_dir(path), META)
        with open(source, encoding="utf-8") as f:
            meta = json.load(f)
        model = Config.from_stored(meta["config"], source=source).model
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path} is neither a checkpoint of this trainer nor a Hugging Face directory "
                              f"({CONFIG_JSON}): cannot read its {META} ({type(e).__name__}: {e})") from None
    lacks = [head for head in meta.get("initialised_heads", []) if head in UNTRAINED_HEAD_MEANING]
    if not meta.get("model_shape", {}).get("binary_head", True) and "next-sentence head" not in lacks:
        lacks.append("next-sentence head")
    return {key: getattr(model, key) for key in REPORTED_KEYS}, source, lacks


def inherit_model_keys(tree: dict) -> dict:
    """The {section: {key: value}} tree with every model.* key of INHERITED_KEYS it leaves unset
    taken from checkpoint.init_from (when it names a readable checkpoint; the pre-start check
    reports one that is not)."""
    init_from = tree.get("checkpoint", {}).get("init_from")
    if not init_from:
        return tree
    try:
        theirs, _, _ = read_model_keys(init_from)
    except CheckpointError:
        return tree
    given = tree.get("model", {})
    tiled = tree.get("checkpoint", {}).get("init_tiled") is True
    inherited = {key: theirs[key] for key in INHERITED_KEYS if key in theirs and key not in given
                 and not (tiled and key in TILED_SHAPE_KEYS)}
    return {**tree, "model": {**given, **inherited}}


def load_run_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """A run's config: the YAML and the overrides (pretrain.config.load_config), with every model.*
    key they leave unset taken from checkpoint.init_from (inherit_model_keys), and model.vocab_size
    null from data.vocab_file's tokenizer (vocab_size_from_tokenizer), and a corpus-group manifest in
    data.paths replaced by its datasets (expand_group_manifests)."""
    return load_config(path, overrides, inherit=lambda tree: expand_group_manifests(
        vocab_size_from_tokenizer(inherit_model_keys(tree))))


def starting_point_problems(cfg: Config) -> list[str]:
    """checkpoint.init_from missing or unreadable, or a model.* key of the run that differs from the
    checkpoint it loads (init_from's, or the latest in checkpoint.load_dir when it resumes)."""
    t = cfg.checkpoint
    if t.init_from and not os.path.exists(t.init_from):
        return [f"checkpoint.init_from {t.init_from} does not exist"]
    found = loaded_checkpoint(cfg)
    if found is None:
        return []
    how, path = found
    if how == "resumes":
        key_name, path = "checkpoint.load_dir", t.load_dir
    else:
        key_name, path = "checkpoint.init_from", t.init_from
    try:
        theirs, source, _ = read_model_keys(path)
    except CheckpointError as e:
        return [f"{key_name}: {e}"] if how != "resumes" else []  # a resume names a damaged checkpoint itself
    ours = cfg.model
    free = ("layernorm_epsilon",) + (phase_model_keys(cfg) if how != "resumes" else ())  # a new phase's rope, context
    tiles = t.init_tiled and how != "resumes"
    if tiles:
        free += TILED_SHAPE_KEYS + TILED_EQUAL_KEYS  # tiling_problems says what is wrong with these
    problems = [f"checkpoint.init_tiled: {p}" for p in tiling_problems(theirs, _keys_of(ours))] if tiles else []
    differ = [key for key in INHERITED_KEYS if key in theirs and key not in free
              and _resolved(ours, key) != _resolved_value(theirs, key)]
    if not differ:
        return problems
    listed = "; ".join(f"model.{key}: run {_resolved(ours, key)}, checkpoint {_resolved_value(theirs, key)}"
                       for key in differ)
    remedy = ("remove these keys from the config and the command line to take the checkpoint's shape"
              if how != "resumes" else "resume with the checkpoint's shape")
    return problems + [f"{key_name} {path} does not fit this run's model ({source}): {listed}; {remedy}"]


def _keys_of(model) -> dict:
    return {key: getattr(model, key) for key in REPORTED_KEYS}


def tiling_problems(small: dict, large: dict) -> list[str]:
    """Why a ModernBERT of the model.* keys `small` cannot be tiled into one of `large` (both as
    read_model_keys gives them), one line per key; [] when it can. The rules are those of ModernBERT's
    tile_weights_from_middle (tiling.py): the same vocabulary, a strictly wider hidden size (its
    tile_embedding refuses an equal one), nothing smaller, and at most 2x the layers (its mapping
    round(i * small / large) would name a layer the small model lacks)."""
    odd = [f"{whose} is {keys['architecture']}" for whose, keys in (("the checkpoint's", small), ("this run's", large))
           if keys["architecture"] != "modernbert"]
    if odd:
        return [f"model.architecture: tiling grows ModernBERT models only; {' and '.join(odd)}"]
    p = [f"model.{key}: the checkpoint's is {small[key]!r}, this run's {large[key]!r}; tiling needs them equal"
         for key in TILED_EQUAL_KEYS if small[key] != large[key]]
    if large["hidden_size"] <= small["hidden_size"]:
        p.append(f"model.hidden_size: this run's {large['hidden_size']} must be larger than the checkpoint's "
                 f"{small['hidden_size']} (tiling grows the hidden size, as ModernBERT's tile_embedding requires)")
    for key in ("num_layers", "ffn_hidden_size"):
        theirs, ours = _resolved_value(small, key), _resolved_value(large, key)
        if ours < theirs:
            p.append(f"model.{key}: this run's {ours} is smaller than the checkpoint's {theirs}; tiling only grows")
    n, m = small["num_layers"], large["num_layers"]
    if m >= n and m and max(round(i * n / m) for i in range(m)) >= n:
        p.append(f"model.num_layers: {n} -> {m} layers: ModernBERT's layer mapping round(i * {n} / {m}) names layer "
                 f"{round((m - 1) * n / m)}, which the checkpoint lacks; tile to at most {2 * n - (n % 2 == 0)} layers")
    return p


def _resolved(model, key: str):
    return model.ffn_size if key == "ffn_hidden_size" else getattr(model, key)


def _resolved_value(keys: dict, key: str):
    if key == "ffn_hidden_size" and keys.get(key) is None:
        return 4 * keys["hidden_size"]  # unset: 4 x hidden, as ModelConfig.ffn_size
    return keys[key]


def untrained_head_notes(cfg: Config) -> list[str]:
    """One line per pretraining head the init_from checkpoint lacks (it starts from random weights),
    saying what that means for the first steps; [] when the run resumes its own checkpoint."""
    found = loaded_checkpoint(cfg)
    if found is None or found[0] == "resumes":
        return []
    try:
        _, source, lacks = read_model_keys(cfg.checkpoint.init_from)
    except CheckpointError:
        return []
    if not cfg.binary_head and "next-sentence head" in lacks:
        lacks = [head for head in lacks if head != "next-sentence head"]
    return [f"checkpoint.init_from {cfg.checkpoint.init_from} has no {head} (from {source}): it starts from random "
            f"weights; {UNTRAINED_HEAD_MEANING[head]}" for head in lacks]
