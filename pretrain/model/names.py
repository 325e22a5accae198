"""How the model's parameters are named: the one table from each layer's parameters to the
Hugging Face BertForPreTraining names, and the order of the layers in `stage_specs`.

Checkpoint files (pretrain/checkpoint/format.py), optimizer groups, initialisation and the
Hugging Face conversion all build on this table; nothing else may spell these names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import nn

from ..distributed.internals import tp_partition_dim
from .layers import (TIED_EMBEDDING_KEY, EmbeddingTail, MlmHead, MlmOutputBias, PretrainingHeads,  # noqa: F401
                     TransformerLayer, WordEmbedding)  # (TIED_EMBEDDING_KEY re-exported)
from .modernbert import DecoderBias, EmbeddingNorm, ModernLayer, ModernMlmHead, TokenEmbedding



class ParamName(NamedTuple):
    """A parameter's Hugging Face name ("{i}": the transformer layer index), the kind that
    weight-decay / layer-adaptation exclusions refer to, and the dimension tensor parallelism
    cuts it along (None: replicated)."""

    hf_name: str
    kind: str
    partition_dim: int | None


HF_NAME_TABLE: dict[type[nn.Module], dict[str, ParamName]] = {
    WordEmbedding: {
        "embedding.weight": ParamName("bert.embeddings.word_embeddings.weight", "embedding", 0),
    },
    EmbeddingTail: {
        "position_embeddings.weight": ParamName("bert.embeddings.position_embeddings.weight", "embedding", None),
        "token_type_embeddings.weight": ParamName("bert.embeddings.token_type_embeddings.weight", "embedding", None),
        "layernorm.weight": ParamName("bert.embeddings.LayerNorm.weight", "layernorm", None),
        "layernorm.bias": ParamName("bert.embeddings.LayerNorm.bias", "layernorm", None),
    },
    TransformerLayer: {
        "query.weight": ParamName("bert.encoder.layer.{i}.attention.self.query.weight", "weight", 0),
        "query.bias": ParamName("bert.encoder.layer.{i}.attention.self.query.bias", "bias", 0),
        "key.weight": ParamName("bert.encoder.layer.{i}.attention.self.key.weight", "weight", 0),
        "key.bias": ParamName("bert.encoder.layer.{i}.attention.self.key.bias", "bias", 0),
        "value.weight": ParamName("bert.encoder.layer.{i}.attention.self.value.weight", "weight", 0),
        "value.bias": ParamName("bert.encoder.layer.{i}.attention.self.value.bias", "bias", 0),
        "attention_output.weight": ParamName("bert.encoder.layer.{i}.attention.output.dense.weight", "weight", 1),
        "attention_output.bias": ParamName("bert.encoder.layer.{i}.attention.output.dense.bias", "bias", None),
        "attention_layernorm.weight": ParamName("bert.encoder.layer.{i}.attention.output.LayerNorm.weight", "layernorm", None),
        "attention_layernorm.bias": ParamName("bert.encoder.layer.{i}.attention.output.LayerNorm.bias", "layernorm", None),
        "intermediate.weight": ParamName("bert.encoder.layer.{i}.intermediate.dense.weight", "weight", 0),
        "intermediate.bias": ParamName("bert.encoder.layer.{i}.intermediate.dense.bias", "bias", 0),
        "output.weight": ParamName("bert.encoder.layer.{i}.output.dense.weight", "weight", 1),
        "output.bias": ParamName("bert.encoder.layer.{i}.output.dense.bias", "bias", None),
        "output_layernorm.weight": ParamName("bert.encoder.layer.{i}.output.LayerNorm.weight", "layernorm", None),
        "output_layernorm.bias": ParamName("bert.encoder.layer.{i}.output.LayerNorm.bias", "layernorm", None),
    },
    PretrainingHeads: {
        "pooler.weight": ParamName("bert.pooler.dense.weight", "weight", None),
        "pooler.bias": ParamName("bert.pooler.dense.bias", "bias", None),
        "nsp.weight": ParamName("cls.seq_relationship.weight", "weight", None),
        "nsp.bias": ParamName("cls.seq_relationship.bias", "bias", None),
        "mlm_dense.weight": ParamName("cls.predictions.transform.dense.weight", "weight", None),
        "mlm_dense.bias": ParamName("cls.predictions.transform.dense.bias", "bias", None),
        "mlm_layernorm.weight": ParamName("cls.predictions.transform.LayerNorm.weight", "layernorm", None),
        "mlm_layernorm.bias": ParamName("cls.predictions.transform.LayerNorm.bias", "layernorm", None),
    },
    MlmOutputBias: {
        "bias": ParamName("cls.predictions.bias", "bias", 0),
    },
}
# ModernBERT: transformers' ModernBertForMaskedLM names. Optional biases (norm_bias, attention_bias,
# mlp_bias, classifier_bias) are listed; a model built without them has no such parameters. Wqkv and
# Wi are stored in the TP-friendly row orders modernbert.py describes, not transformers'.
_MODERN_LAYER = "model.layers.{i}."
HF_NAME_TABLE.update({
    TokenEmbedding: {
        "embedding.weight": ParamName("model.embeddings.tok_embeddings.weight", "embedding", 0),
    },
    EmbeddingNorm: {
        "norm.weight": ParamName("model.embeddings.norm.weight", "layernorm", None),
        "norm.bias": ParamName("model.embeddings.norm.bias", "layernorm", None),
    },
    ModernLayer: {
        "attn_norm.weight": ParamName(_MODERN_LAYER + "attn_norm.weight", "layernorm", None),
        "attn_norm.bias": ParamName(_MODERN_LAYER + "attn_norm.bias", "layernorm", None),
        "attn_qkv.weight": ParamName(_MODERN_LAYER + "attn.Wqkv.weight", "weight", 0),
        "attn_qkv.bias": ParamName(_MODERN_LAYER + "attn.Wqkv.bias", "bias", 0),
        "attn_out.weight": ParamName(_MODERN_LAYER + "attn.Wo.weight", "weight", 1),
        "attn_out.bias": ParamName(_MODERN_LAYER + "attn.Wo.bias", "bias", None),
        "mlp_norm.weight": ParamName(_MODERN_LAYER + "mlp_norm.weight", "layernorm", None),
        "mlp_norm.bias": ParamName(_MODERN_LAYER + "mlp_norm.bias", "layernorm", None),
        "mlp_in.weight": ParamName(_MODERN_LAYER + "mlp.Wi.weight", "weight", 0),
        "mlp_in.bias": ParamName(_MODERN_LAYER + "mlp.Wi.bias", "bias", 0),
        "mlp_out.weight": ParamName(_MODERN_LAYER + "mlp.Wo.weight", "weight", 1),
        "mlp_out.bias": ParamName(_MODERN_LAYER + "mlp.Wo.bias", "bias", None),
    },
    ModernMlmHead: {
        "final_norm.weight": ParamName("model.final_norm.weight", "layernorm", None),
        "final_norm.bias": ParamName("model.final_norm.bias", "layernorm", None),
        "dense.weight": ParamName("head.dense.weight", "weight", None),
        "dense.bias": ParamName("head.dense.bias", "bias", None),
        "norm.weight": ParamName("head.norm.weight", "layernorm", None),
        "norm.bias": ParamName("head.norm.bias", "layernorm", None),
    },
    DecoderBias: {
        "bias": ParamName("decoder.bias", "bias", 0),
    },
})
HF_NAME_TABLE[MlmHead] = {local: entry for local, entry in HF_NAME_TABLE[PretrainingHeads].items()
                          if local.startswith("mlm_")}
WORD_EMBEDDINGS = HF_NAME_TABLE[WordEmbedding]["embedding.weight"].hf_name
MLM_BIAS = HF_NAME_TABLE[MlmOutputBias]["bias"].hf_name
MODERN_EMBEDDINGS = HF_NAME_TABLE[TokenEmbedding]["embedding.weight"].hf_name
MODERN_DECODER_BIAS = HF_NAME_TABLE[DecoderBias]["bias"].hf_name
# Tensors indexed by vocabulary id along their first dimension (padded to the padded vocabulary)
VOCAB_ROWS = frozenset({WORD_EMBEDDINGS, MLM_BIAS, MODERN_EMBEDDINGS, MODERN_DECODER_BIAS})
EMBEDDING_NAMES = frozenset({WORD_EMBEDDINGS, MODERN_EMBEDDINGS})


@dataclass
class LogicalParam:
    """A local parameter (possibly a TP shard) and the whole parameter it belongs to."""

    hf_name: str
    kind: str
    param: nn.Parameter
    tp_partition_dim: int | None  # None: replicated over TP


def logical_parameters(model: nn.Module) -> list[LogicalParam]:
    """Every parameter of the model with its Hugging Face name, each shared one once."""
    found, seen = [], set()
    for module in model.modules():
        table = HF_NAME_TABLE.get(type(module))
        if table is None:
            continue
        for local_name, param in module.named_parameters():
            if id(param) in seen:
                continue
            if local_name not in table:
                raise KeyError(f"{type(module).__name__}.{local_name} has no entry in HF_NAME_TABLE")
            seen.add(id(param))
            entry = table[local_name]
            if tp_partition_dim(param) != entry.partition_dim:
                raise KeyError(f"{type(module).__name__}.{local_name}: HF_NAME_TABLE says partition dim "
                               f"{entry.partition_dim}, the layer says {tp_partition_dim(param)}")
            found.append(LogicalParam(entry.hf_name.format(i=getattr(module, "layer_index", "")), entry.kind, param,
                                      entry.partition_dim))
    owned = {id(p) for p in model.parameters()}
    if owned != seen:
        raise KeyError("model has parameters outside HF_NAME_TABLE's modules")
    return found


def spec_modules(model_cfg, binary_head: bool = True) -> list[tuple[type[nn.Module], int | None]]:
    """(layer class, transformer layer index) of each entry of `stage_specs`, in order: what the
    checkpoint files of each module structure are named after (checkpoint.format.checkpoint_param_names).
    The word embedding appears twice: the input lookup and the tied MLM decoder. Without the binary
    head the heads' entry is MlmHead (same position, no pooler or next-sentence classifier).
    ModernBERT's list has the same positions (it never has the binary head)."""
    n = model_cfg.num_layers
    if model_cfg.modern:
        return [(TokenEmbedding, None), (EmbeddingNorm, None), *[(ModernLayer, i) for i in range(n)],
                (ModernMlmHead, None), (TokenEmbedding, None), (DecoderBias, None)]
    heads = PretrainingHeads if binary_head else MlmHead
    return [(WordEmbedding, None), (EmbeddingTail, None), *[(TransformerLayer, i) for i in range(n)],
            (heads, None), (WordEmbedding, None), (MlmOutputBias, None)]


def module_parameters(module_class: type[nn.Module], model_cfg, layer: int | None) -> list[str]:
    """The local parameter names a module of this class has under `model_cfg`, in the module's
    order (HF_NAME_TABLE lists ModernBERT's optional biases, which a model may lack)."""
    if not model_cfg.modern:
        return list(HF_NAME_TABLE[module_class])
    present = {"norm": model_cfg.norm_bias, "attn": model_cfg.attention_bias, "mlp": model_cfg.mlp_bias,
               "dense": model_cfg.classifier_bias}
    names = []
    for local in HF_NAME_TABLE[module_class]:
        if module_class is ModernLayer and layer == 0 and local.startswith("attn_norm."):
            continue  # transformers' layer 0 has no attn_norm
        if local.endswith(".bias") and module_class is not DecoderBias:
            prefix = local.split(".")[0]
            kind = "norm" if prefix.endswith("norm") else prefix.split("_")[0]
            if not present[kind]:
                continue
        names.append(local)
    return names
