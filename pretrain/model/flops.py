"""Matrix-product FLOPs of the model, the one place they are spelled: the trainer's model
FLOP/s and the planner's step times (pretrain/plan/step_time.py) both read them.

Training = forward + backward = 3 x forward. Per transformer layer and token, forward:
- BERT: Q, K, V and output projections 4 x 2h^2, MLP 2 x 2h*ffn, attention scores and context
  2 x 2*k*h over the k = s keys a query attends;
- ModernBERT: the same projections (Wqkv 3 x 2h^2, Wo 2h^2), GeGLU's Wi 2h*2ffn and Wo 2ffn*h;
  a windowed layer's query attends k = min(s, local_attention + 1) keys (the model's work: a
  kernel that computes more and masks it counts no more).
Heads: pooler + NSP per sequence (with the binary head); MLM transform and the vocabulary
projection at the masked positions only (sparse prediction).
"""
from __future__ import annotations


def layer_forward_flops(model_cfg, seq_length: int, layer_index: int = 0) -> float:
    """Transformer layer `layer_index`'s forward over one row of `seq_length` tokens."""
    h, f, s = model_cfg.hidden_size, model_cfg.ffn_size, seq_length
    mlp = 6 * h * f if model_cfg.modern else 4 * h * f
    return s * (8 * h * h + mlp) + attention_core_forward_flops(model_cfg, seq_length, layer_index)


def attention_core_forward_flops(model_cfg, seq_length: int, layer_index: int = 0) -> float:
    """The part of layer_forward_flops in the attention core (scores and context: what selective
    recomputation runs again)."""
    keys = seq_length
    if model_cfg.modern and not model_cfg.is_global_layer(layer_index):
        keys = min(seq_length, model_cfg.local_attention + 1)
    return 4.0 * seq_length * keys * model_cfg.hidden_size


def encoder_forward_flops(model_cfg, seq_length: int, layers: range | None = None) -> float:
    """The forward of `layers` (default: all) over one row."""
    layers = range(model_cfg.num_layers) if layers is None else layers
    return sum(layer_forward_flops(model_cfg, seq_length, i) for i in layers)


def pooler_forward_flops(model_cfg) -> float:
    """Pooler and next-sentence classifier, per sample."""
    h = model_cfg.hidden_size
    return 2 * h * h + 4 * h


def mlm_forward_flops(model_cfg, vocab_size: int) -> float:
    """MLM transform and vocabulary projection, per masked position (`vocab_size` columns)."""
    h = model_cfg.hidden_size
    return 2 * h * h + 2 * h * vocab_size


def encoder_flops_per_row(cfg) -> float:
    """Training FLOPs of the encoder for one row of seq_length tokens (a padded sample, or a
    packed row of several)."""
    return 3.0 * encoder_forward_flops(cfg.model, cfg.data.seq_length)


def head_flops_per_sample(cfg) -> float:
    """Training FLOPs of the heads, per sample however it is packed."""
    m = cfg.model
    pooler = pooler_forward_flops(m) if cfg.binary_head else 0.0
    return 3.0 * (pooler + cfg.data.max_predictions() * mlm_forward_flops(m, m.vocab_size))


def model_flops_per_sample(cfg) -> float:
    """Training FLOPs one sample needs (matmuls only). Recomputation for activation
    checkpointing is not counted (it is overhead, not model work)."""
    return encoder_flops_per_row(cfg) + head_flops_per_sample(cfg)


def document_training_flops(model_cfg, lengths, masked_tokens: int, vocab_size: int, binary_head: bool) -> float:
    """Training FLOPs of the real work of a batch whose documents (samples: what attends only
    itself, padded or packed) have `lengths` tokens and `masked_tokens` predictions in all: every
    layer over each document's tokens, its attention within the document (a global layer's query
    over the document's keys, a windowed one's over at most local_attention + 1 of them), the heads
    per sample and per masked token. Padding and cross-document pairs are no part of it, so
    this is what MFU divides whatever a side computes."""
    encoder = sum(encoder_forward_flops(model_cfg, int(n)) for n in lengths)
    pooler = pooler_forward_flops(model_cfg) * len(lengths) if binary_head else 0.0
    return 3.0 * (encoder + pooler + masked_tokens * mlm_forward_flops(model_cfg, vocab_size))
