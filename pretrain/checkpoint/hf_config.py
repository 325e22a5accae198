"""A Hugging Face BERT directory's config.json, read without torch (hf.py reads the weights): what
it must say for us to build it, its architecture and heads, and the model.* keys it implies. The
pre-start checks (starting_point.py) read it before any rank starts.
"""
from __future__ import annotations

import json
import os

from ..config import Config, ConfigError
from .errors import CheckpointError
from .filenames import CONFIG_JSON, LATEST, META
from . import modernbert_hf

BERT_PRETRAINING_ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel")
PRETRAINING_ARCHITECTURES = BERT_PRETRAINING_ARCHITECTURES + modernbert_hf.PRETRAINING_ARCHITECTURES
BERT_ARCHITECTURES = BERT_PRETRAINING_ARCHITECTURES + ("BertForSequenceClassification", "BertForMultipleChoice",
                                                       "BertForQuestionAnswering", "BertForTokenClassification")
ARCHITECTURES = BERT_ARCHITECTURES + modernbert_hf.PRETRAINING_ARCHITECTURES + modernbert_hf.TASK_ARCHITECTURES
MODEL_TYPES = {"bert": BERT_ARCHITECTURES,
               modernbert_hf.MODEL_TYPE: modernbert_hf.PRETRAINING_ARCHITECTURES + modernbert_hf.TASK_ARCHITECTURES}

# The heads each architecture's weights hold (format.HEADS names); the others are initialised.
ARCHITECTURE_HEADS = {
    "BertForPreTraining": ("pooler", "next-sentence head", "MLM head"),
    "BertForMaskedLM": ("MLM head",),
    "BertModel": (),  # its pooler is optional (add_pooling_layer=False leaves it out)
    "BertForSequenceClassification": ("pooler",),
    "BertForMultipleChoice": ("pooler",),
    "BertForQuestionAnswering": (),
    "BertForTokenClassification": (),  # no pooler (transformers builds it with add_pooling_layer=False)
    **modernbert_hf.ARCHITECTURE_HEADS,
}

# Our model.* key -> config.json's key; the optional ones default as transformers' BertConfig does.
HF_MODEL_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                 "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                 "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
                 "layernorm_epsilon": "layer_norm_eps", "hidden_dropout": "hidden_dropout_prob",
                 "attention_dropout": "attention_probs_dropout_prob", "init_std": "initializer_range"}
OPTIONAL_HF_KEYS = ("layer_norm_eps", "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range",
                    "type_vocab_size")


def read_hf_config(path: str) -> tuple[dict, str | None]:
    """(config.json, its architecture or None when it names none) of a Hugging Face BERT or
    ModernBERT directory, checked for what we can build."""
    config_path = os.path.join(path, CONFIG_JSON)
    if not os.path.exists(config_path):
        native = any(os.path.exists(os.path.join(path, f)) for f in (LATEST, META))
        raise CheckpointError(f"{config_path} is missing: {path} is not a Hugging Face model directory"
                              + (" (it is a native checkpoint)" if native else ""))
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot read ({e})") from None
    problems = []
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        problems.append(f"model_type is {model_type!r}, not one of {', '.join(repr(t) for t in MODEL_TYPES)}")
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else None  # None: inferred from the tensors
    supported = MODEL_TYPES.get(model_type, ARCHITECTURES)
    if architecture is not None and architecture not in supported:
        problems.append(f"unknown architecture {architecture!r} (architectures: {architectures}); "
                        f"supported: {', '.join(supported)}")
    if model_type == modernbert_hf.MODEL_TYPE:
        if problems:
            raise CheckpointError(f"{config_path}:\n  " + "\n  ".join(problems))
        return hf, architecture or "ModernBertForMaskedLM"
    if hf.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act {hf.get('hidden_act')!r}: only 'gelu' (erf) is supported")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {hf.get('position_embedding_type')!r}: only 'absolute' is supported")
    if problems:
        raise CheckpointError(f"{config_path}:\n  " + "\n  ".join(problems))
    return hf, architecture


def config_from_hf(hf: dict, source: str) -> Config:
    """The model config.json describes (its keys under our model.* names, checked and typed)."""
    if hf.get("model_type") == modernbert_hf.MODEL_TYPE:
        return modernbert_hf.config_from_modern_hf(hf, source)
    missing = [theirs for theirs in HF_MODEL_KEYS.values() if theirs not in hf and theirs not in OPTIONAL_HF_KEYS]
    if missing:
        raise CheckpointError(f"{source}: config.json lacks {', '.join(missing)}")
    model = {ours: hf[theirs] for ours, theirs in HF_MODEL_KEYS.items() if theirs in hf}
    try:
        cfg = Config.from_dict({"model": model}, source=source)
    except ConfigError as e:
        raise CheckpointError(f"{source}: config.json does not describe a model we can build:\n  "
                              + "\n  ".join(e.problems)) from None
    return cfg
