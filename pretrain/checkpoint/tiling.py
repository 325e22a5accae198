"""Grow a smaller ModernBERT into a larger one by tiling its weights "from the middle"
(checkpoint.init_tiled): how ModernBERT-large was initialised from ModernBERT-base.

The reference is AnswerDotAI/ModernBERT, src/bert_layers/initialization.py (`tile_weight` with
TileMode.tile_weights_from_middle, `tile_fused_qkv`, `tile_fused_glu`) applied to a whole model by
src/bert_layers/model.py (`init_model_from_pretrained`, `init_mlm_model_from_pretrained`), commit
8c57a0f01c12c4953ead53d398a36f81a4ba9e38. Ported here on whole logical tensors in transformers'
ModernBertForMaskedLM naming and row order, so the result loads into any layout (load.py shards it):

* a tensor is tiled "from the middle": the small one is placed at the centre of the larger shape
  (offset (new - old) // 2 along each dimension) and repeated periodically outwards in both
  directions, i.e. large[k] = small[(k - offset) mod old] along each dimension;
* fused tensors are tiled per part: Wqkv (and its bias) as [Q; K; V] thirds, the GeGLU's Wi (and
  its bias) as [input; gate] halves. Our stored orders (per-head [q; k; v], interleaved
  input/gate: modernbert_hf.py) are converted to transformers' before tiling and back after;
* layer j of the large model takes layer round(j * small_layers / large_layers) of the small one
  (Python's round, halves to even): base's 22 layers into large's 28 give
  [0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 8, 9, 9, 10, 11, 12, 13, 13, 14, 15, 16, 16, 17, 18, 19, 20, 20, 21];
* tiled: the token embedding (the tied decoder with it), the embedding norm, each layer's
  attn_norm, Wqkv, Wo, mlp_norm, Wi, Wo, the MLM head's dense and norm, the decoder bias;
* as the reference leaves them, at their initial values (LayerNorm weight 1, bias 0): the final
  norm (model.final_norm, which init_model_from_pretrained does not tile), and the attn_norm of a
  large layer whose source is the small layer 0 (which has none: transformers' layer 0 has an
  identity there).

What cannot be tiled is refused before any rank starts (starting_point.tiling_problems): another
architecture or vocabulary, a hidden size not larger (the reference's tile_embedding refuses it),
fewer layers or a narrower MLP, differing biases, more layers than the mapping reaches (about 2x).
The reference does not need equal head dimensions (Q, K and V are tiled as row blocks), nor do we.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..config import Config
from . import modernbert_hf
from .errors import CheckpointError
from .logical import LogicalCheckpoint
from .starting_point import REPORTED_KEYS, tiling_problems

_EMBEDDING = "model.embeddings.tok_embeddings.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# parts of each fused tensor along its rows, in transformers' order
_FUSED = {"attn.Wqkv": 3, "mlp.Wi": 2}


def layer_mapping(small_layers: int, large_layers: int) -> list[int]:
    """The small model's layer each layer of the large one takes (init_model_from_pretrained)."""
    return [round(i * small_layers / large_layers) for i in range(large_layers)]


def tile_from_middle_tensor(small: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`small` (1-D or 2-D) tiled from the middle into `shape` (tile_weight's
    tile_weights_from_middle, vectorised: large[k] = small[(k - offset) mod old] along each dim)."""
    if small.dim() not in (1, 2) or len(shape) != small.dim():
        raise ValueError(f"cannot tile a tensor of shape {tuple(small.shape)} into {tuple(shape)}")
    result = small
    for dim, (old, new) in enumerate(zip(small.shape, shape)):
        if new < old:
            raise ValueError(f"cannot tile a tensor of shape {tuple(small.shape)} into the smaller {tuple(shape)}")
        index = (torch.arange(new) - (new - old) // 2) % old
        result = result.index_select(dim, index)
    return result.clone()


def _tile_fused(small: torch.Tensor, shape: tuple[int, ...], parts: int) -> torch.Tensor:
    """tile_fused_qkv (parts 3) / tile_fused_glu (parts 2): each row block tiled on its own."""
    part_shape = (shape[0] // parts, *shape[1:])
    return torch.cat([tile_from_middle_tensor(chunk, part_shape) for chunk in small.chunk(parts, dim=0)], dim=0)


def model_keys(model) -> dict:
    """The model.* keys tiling_problems reads, of a ModelConfig."""
    return {key: getattr(model, key) for key in REPORTED_KEYS}


def expected_shapes(m) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ModernBertForMaskedLM of ModelConfig `m`, by transformers name (the decoder
    weight left out: tied to the token embedding)."""
    h, f, v = m.hidden_size, m.ffn_size, m.vocab_size
    shapes = {_EMBEDDING: (v, h)}
    norms = ["model.embeddings.norm", "model.final_norm", "head.norm"]
    for i in range(m.num_layers):
        layer = f"model.layers.{i}."
        norms += ([layer + "attn_norm"] if i else []) + [layer + "mlp_norm"]
        for name, shape, bias in (("attn.Wqkv", (3 * h, h), m.attention_bias), ("attn.Wo", (h, h), m.attention_bias),
                                  ("mlp.Wi", (2 * f, h), m.mlp_bias), ("mlp.Wo", (h, f), m.mlp_bias)):
            shapes[layer + name + ".weight"] = shape
            if bias:
                shapes[layer + name + ".bias"] = shape[:1]
    for norm in norms:
        shapes[norm + ".weight"] = (h,)
        if m.norm_bias:
            shapes[norm + ".bias"] = (h,)
    shapes["head.dense.weight"] = (h, h)
    if m.classifier_bias:
        shapes["head.dense.bias"] = (h,)
    shapes["decoder.bias"] = (v,)
    return shapes


def _fused_parts(name: str) -> int | None:
    found = _LAYER.match(name)
    return next((parts for prefix, parts in _FUSED.items() if found and found[2].startswith(prefix + ".")), None)


def _source(name: str, mapping: list[int]) -> str | None:
    """The small model's tensor the large one's `name` is tiled from; None: left at its initial value."""
    if name.startswith("model.final_norm."):
        return None  # not tiled by init_model_from_pretrained
    found = _LAYER.match(name)
    if not found:
        return name
    source = mapping[int(found[1])]
    if source == 0 and found[2].startswith("attn_norm."):
        return None  # the small layer 0 has no attn_norm (an identity): the reference's tile_norm returns
    return f"model.layers.{source}.{found[2]}"


def tile_from_middle(small: dict[str, torch.Tensor], small_config, large_config) -> dict[str, torch.Tensor]:
    """The whole larger ModernBertForMaskedLM state dict (transformers naming and row order) tiled
    from the middle from the smaller one's. The configs: our ModelConfig, or transformers'
    ModernBertConfig. A `decoder.weight` in `small` (transformers' tied copy) is tiled too."""
    small_m, large_m = _model_config(small_config), _model_config(large_config)
    problems = tiling_problems(model_keys(small_m), model_keys(large_m))
    if problems:
        raise CheckpointError("cannot tile this ModernBERT into the larger one:\n  " + "\n  ".join(problems))
    small_shapes, shapes = expected_shapes(small_m), expected_shapes(large_m)
    if "decoder.weight" in small:  # transformers' state dict holds the tied decoder too
        small_shapes["decoder.weight"], shapes["decoder.weight"] = small_shapes[_EMBEDDING], shapes[_EMBEDDING]
    for name, tensor in small.items():
        if name not in small_shapes:
            raise CheckpointError(f"{name}: not a tensor of a ModernBertForMaskedLM of the smaller model's config")
        if tuple(tensor.shape) != small_shapes[name]:
            raise CheckpointError(f"{name}: shape {tuple(tensor.shape)}, the smaller model's config says "
                                  f"{small_shapes[name]}")
    missing = sorted(set(small_shapes) - set(small))
    if missing:
        raise CheckpointError(f"the smaller model lacks {len(missing)} tensor(s): {', '.join(missing)}")
    mapping = layer_mapping(small_m.num_layers, large_m.num_layers)
    large = {}
    for name, shape in shapes.items():
        source = _source(name, mapping)
        if source is None:
            large[name] = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
            continue
        tensor = small[source].detach().to(torch.float32)
        parts = _fused_parts(name)
        large[name] = _tile_fused(tensor, shape, parts) if parts else tile_from_middle_tensor(tensor, shape)
    return large


def _model_config(config):
    """Our ModelConfig from itself, a whole Config, or a transformers ModernBertConfig."""
    if isinstance(config, Config):
        return config.model
    if hasattr(config, "to_dict") and hasattr(config, "num_hidden_layers"):
        return modernbert_hf.config_from_modern_hf(config.to_dict(), type(config).__name__).model
    return config


def describe(m) -> str:
    return (f"hidden {m.hidden_size}, {m.num_layers} layers, {m.num_attention_heads} heads, "
            f"intermediate {m.ffn_size}")


def tile_checkpoint(ckpt: LogicalCheckpoint, cfg: Config) -> LogicalCheckpoint:
    """`ckpt` (a smaller ModernBERT, our row orders) tiled into the model of `cfg`, as a logical
    checkpoint of that model at step 0 without optimizer state (our row orders)."""
    small_cfg = ckpt.config
    hf = {name: modernbert_hf.to_hf(name, tensor, small_cfg) for name, tensor in ckpt.weights.items()}
    tiled = tile_from_middle(hf, small_cfg.model, cfg.model)
    weights = {name: modernbert_hf.to_native(name, tensor, cfg) for name, tensor in tiled.items()}
    config = Config.from_dict(cfg.to_dict())
    return dataclasses.replace(
        ckpt, config=config, weights=weights, moments=None, optimizer_step=0, step=0, consumed_samples=0,
        scheduler_steps=0, extra={},
        notes=ckpt.notes + [f"layer j of {cfg.model.num_layers} takes the smaller model's layer "
                            f"{layer_mapping(small_cfg.model.num_layers, cfg.model.num_layers)}[j]; the final "
                            "norm starts at 1 (ModernBERT's tiling leaves it untiled)"])


def init_tiled(engine, model, path: str, cfg: Config, parallel) -> str:
    """checkpoint.init_tiled: load the smaller ModernBERT at `path` (native of any layout, or a
    transformers directory), tile it into this run's model, and copy each rank's part in (weights
    only). Returns what was loaded, for the start-up log."""
    from .load import load_into_engine, read_any

    ckpt = read_any(path, with_optimizer=False)
    problems = tiling_problems(model_keys(ckpt.config.model), model_keys(cfg.model))
    if problems:
        raise CheckpointError(f"checkpoint.init_tiled: {path} cannot be tiled into this run's model:\n  "
                              + "\n  ".join(problems))
    tiled = tile_checkpoint(ckpt, cfg)
    load_into_engine(engine, model, tiled, cfg, parallel, with_optimizer=False, with_schedule=False)
    return (f"{ckpt.source} (its step {ckpt.step}), tiled from the middle: {describe(ckpt.config.model)} -> "
            f"{describe(cfg.model)}" + "".join(f"\n  {n}" for n in tiled.notes))
