"""transformers' ModernBERT directories: the config.json keys (both spellings) and the two weights
whose row order differs from ours.

config.json: transformers 4.48+ writes `global_attn_every_n_layers`, `local_attention`,
`global_rope_theta` and `local_rope_theta`; transformers 5 writes `layer_types` and
`rope_parameters` instead, and fills a missing theta with 160,000 (global) or 10,000 (local). We
read either and write both, with both thetas always. Rotary scaling (model.rope_scaling) exists in
transformers 5's rope_parameters only (rope_type and its parameters per layer kind; a top-level
`rope_scaling` is read for both kinds): transformers 4.x ignores it.

Weights (pretrain/model/modernbert.py says why ours differ): transformers' Wqkv rows are [Q of all
heads; K; V], ours per head [q; k; v]; its Wi rows are [input; gate], ours interleave them
[input_0, gate_0, input_1, ...]. Everything else is stored as transformers stores it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import Config, ConfigError, rope_scaling
from .errors import CheckpointError

if TYPE_CHECKING:  # the config half of this module is read by the torch-free pre-start checks
    import torch

MODEL_TYPE = "modernbert"
PRETRAINING_ARCHITECTURES = ("ModernBertForMaskedLM", "ModernBertModel")
TASK_ARCHITECTURES = ("ModernBertForSequenceClassification", "ModernBertForMultipleChoice",
                      "ModernBertForQuestionAnswering", "ModernBertForTokenClassification")
# The heads each architecture's weights hold (format.HEADS names)
ARCHITECTURE_HEADS = {"ModernBertForMaskedLM": ("MLM head",), "ModernBertModel": (),
                      **{name: () for name in TASK_ARCHITECTURES}}

# our model.* key -> ModernBertConfig's key, with transformers' default where a config may omit it
KEYS = {"vocab_size": ("vocab_size", 50368), "hidden_size": ("hidden_size", 768),
        "num_layers": ("num_hidden_layers", 22), "num_attention_heads": ("num_attention_heads", 12),
        "ffn_hidden_size": ("intermediate_size", 1152), "max_position_embeddings": ("max_position_embeddings", 8192),
        "layernorm_epsilon": ("norm_eps", 1e-5), "init_std": ("initializer_range", 0.02),
        "attention_dropout": ("attention_dropout", 0.0), "norm_bias": ("norm_bias", False),
        "attention_bias": ("attention_bias", False), "mlp_bias": ("mlp_bias", False),
        "classifier_bias": ("classifier_bias", False), "classifier_pooling": ("classifier_pooling", "cls")}
DEFAULT_THETAS = {"full_attention": 160000.0, "sliding_attention": 10000.0}
# (key, the only value we compute): what else a config may say is refused
FIXED = (("hidden_activation", "gelu"), ("classifier_activation", "gelu"), ("decoder_bias", True),
         ("tie_word_embeddings", True), ("sparse_prediction", False))


def _global_every(hf: dict, problems: list[str]) -> int:
    layer_types = hf.get("layer_types")
    if layer_types is None:
        return int(hf.get("global_attn_every_n_layers", 3))
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        problems.append(f"layer_types {layer_types}: only full_attention and sliding_attention exist")
        return 3
    for every in range(1, len(layer_types) + 1):
        if all((t == "full_attention") == (i % every == 0) for i, t in enumerate(layer_types)):
            return every
    problems.append(f"layer_types {layer_types} is not 'full attention every n layers from layer 0', the only "
                    "pattern ModernBERT models use (and we build)")
    return 3


def _rope(hf: dict, problems: list[str]) -> tuple[float, float, dict | None]:
    """(global theta, local theta, model.rope_scaling) of a config.json: transformers 5's
    rope_parameters per layer kind, or the 4.x thetas; a top-level `rope_scaling` applies to both
    kinds (as transformers' ModernBertConfig reads it)."""
    rope = hf.get("rope_parameters") or {}
    thetas, scaling = {}, {}
    for layer_type, legacy, kind in (("full_attention", "global_rope_theta", "global"),
                                     ("sliding_attention", "local_rope_theta", "local")):
        params = {**(rope.get(layer_type) or {}), **(hf.get("rope_scaling") or {})}
        params.setdefault("rope_type", params.pop("type", "default"))
        thetas[layer_type] = float(params.pop("rope_theta", hf.get(legacy, DEFAULT_THETAS[layer_type])))
        if params["rope_type"] == "default":
            continue
        if params["rope_type"] == "yarn":  # transformers' standardize_rope_params and YaRN's factor
            params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
            if params.get("factor") is None:
                params["factor"] = hf.get("max_position_embeddings", 8192) / params["original_max_position_embeddings"]
        found = rope_scaling.problems(params, modern=True)
        problems += [line.replace("model.rope_scaling", f"rope_parameters.{layer_type}") for line in found]
        scaling[kind] = params
    if not scaling:
        return thetas["full_attention"], thetas["sliding_attention"], None
    if scaling.get("global") == scaling.get("local"):
        return thetas["full_attention"], thetas["sliding_attention"], scaling["global"]
    per_kind = {kind: scaling.get(kind) for kind in rope_scaling.KINDS}
    return thetas["full_attention"], thetas["sliding_attention"], per_kind


def config_from_modern_hf(hf: dict, source: str) -> Config:
    """The model a ModernBERT config.json describes, under our model.* names."""
    problems = [f"{key} is {hf[key]!r}; only {value!r} is supported" for key, value in FIXED
                if key in hf and hf[key] != value]
    model = {ours: hf.get(theirs, default) for ours, (theirs, default) in KEYS.items()}
    model.update(architecture="modernbert", global_attn_every_n_layers=_global_every(hf, problems))
    model["global_rope_theta"], model["local_rope_theta"], model["rope_scaling"] = _rope(hf, problems)
    if "local_attention" in hf or "sliding_window" not in hf:
        model["local_attention"] = int(hf.get("local_attention", 128))
    else:
        model["local_attention"] = 2 * int(hf["sliding_window"])
    embedding_dropout, mlp_dropout = hf.get("embedding_dropout", 0.0), hf.get("mlp_dropout", 0.0)
    if embedding_dropout != mlp_dropout:
        problems.append(f"embedding_dropout {embedding_dropout} and mlp_dropout {mlp_dropout} differ: our "
                        "model.hidden_dropout is both")
    model["hidden_dropout"] = mlp_dropout
    if problems:
        raise CheckpointError(f"{source}:\n  " + "\n  ".join(problems))
    try:
        return Config.from_dict({"model": model, "data": {"segment_pairs": "none"}}, source=source)
    except ConfigError as e:
        raise CheckpointError(f"{source}: config.json does not describe a model we can build:\n  "
                              + "\n  ".join(e.problems)) from None


def modern_hf_config(cfg: Config, architecture: str, special_ids: dict[str, int]) -> dict:
    """config.json of a ModernBERT model that transformers 4.48+ and 5 both read as we computed it.
    `special_ids`: the tokenizer's ids by role (pad, cls, sep, mask, ...)."""
    m = cfg.model
    layer_types = ["full_attention" if m.is_global_layer(i) else "sliding_attention" for i in range(m.num_layers)]
    config = {"architectures": [architecture], "model_type": MODEL_TYPE}
    config.update({theirs: getattr(m, ours) for ours, (theirs, _) in KEYS.items()})
    config.update({
        "hidden_activation": "gelu", "classifier_activation": "gelu", "initializer_cutoff_factor": 2.0,
        "embedding_dropout": m.hidden_dropout, "mlp_dropout": m.hidden_dropout, "classifier_dropout": 0.0,
        "decoder_bias": True, "tie_word_embeddings": True, "sparse_prediction": False,
        # transformers 4.x keys
        "global_attn_every_n_layers": m.global_attn_every_n_layers, "local_attention": m.local_attention,
        "global_rope_theta": m.global_rope_theta, "local_rope_theta": m.local_rope_theta,
        # transformers 5 keys
        "layer_types": layer_types,
        "rope_parameters": {"full_attention": _rope_parameters(m.global_rope_theta, m.rope_scaling_of(True)),
                            "sliding_attention": _rope_parameters(m.local_rope_theta, m.rope_scaling_of(False))},
        "torch_dtype": "float32",
    })
    for role in ("pad", "bos", "eos", "cls", "sep"):
        source = {"bos": "cls", "eos": "sep"}.get(role, role)
        if source in special_ids:
            config[f"{role}_token_id"] = special_ids[source]
    return config


def _rope_parameters(theta: float, scaling: dict | None) -> dict:
    """One layer kind's transformers 5 rope_parameters entry."""
    return {"rope_type": "default", "rope_theta": theta} if not scaling else {**scaling, "rope_theta": theta}


# ----------------------------------------------------------------------------- weights
def _is(name: str, suffix: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(suffix)


def to_native(name: str, tensor: torch.Tensor, cfg: Config) -> torch.Tensor:
    """transformers' row order -> ours (Wqkv per head, Wi interleaved)."""
    m = cfg.model
    if _is(name, "attn.Wqkv.weight") or _is(name, "attn.Wqkv.bias"):
        heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
        return tensor.reshape(3, heads, head_dim, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape).contiguous()
    if _is(name, "mlp.Wi.weight") or _is(name, "mlp.Wi.bias"):
        return tensor.reshape(2, m.ffn_size, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape).contiguous()
    return tensor


def to_hf(name: str, tensor: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Our row order -> transformers' (inverse of to_native)."""
    m = cfg.model
    if _is(name, "attn.Wqkv.weight") or _is(name, "attn.Wqkv.bias"):
        heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
        return tensor.reshape(heads, 3, head_dim, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape).contiguous()
    if _is(name, "mlp.Wi.weight") or _is(name, "mlp.Wi.bias"):
        return tensor.reshape(m.ffn_size, 2, *tensor.shape[1:]).transpose(0, 1).reshape(tensor.shape).contiguous()
    return tensor


def canonical(name: str) -> str:
    """Our spelling of a ModernBERT key: a bare ModernBertModel's have no `model.` prefix."""
    if name.startswith(("embeddings.", "layers.", "final_norm.")):
        return "model." + name
    return name
