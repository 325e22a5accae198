"""Matrix-product FLOPs of the model, the one place they are spelled: the trainer's model
FLOP/s and the planner's step times (pretrain/plan/step_time.py) both read them.

Training = forward + backward = 3 x forward. Per transformer layer and token, forward: Q, K, V
and output projections 4 x 2h^2, MLP 2 x 2h*ffn, attention scores and context 2 x 2*s*h. Heads:
pooler + NSP per sequence; MLM transform and the vocabulary projection at the masked positions
only (sparse prediction).
"""
from __future__ import annotations


def layer_forward_flops(model_cfg, seq_length: int) -> float:
    """One transformer layer's forward over one row of `seq_length` tokens."""
    h, f, s = model_cfg.hidden_size, model_cfg.ffn_size, seq_length
    return s * (8 * h * h + 4 * h * f) + attention_core_forward_flops(model_cfg, seq_length)


def attention_core_forward_flops(model_cfg, seq_length: int) -> float:
    """The part of layer_forward_flops in the attention core (scores and context: what selective
    recomputation runs again)."""
    return 4.0 * seq_length * seq_length * model_cfg.hidden_size


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
    return 3.0 * cfg.model.num_layers * layer_forward_flops(cfg.model, cfg.data.seq_length)


def head_flops_per_sample(cfg) -> float:
    """Training FLOPs of the heads, per sample however it is packed."""
    m = cfg.model
    return 3.0 * (pooler_forward_flops(m) + cfg.data.max_predictions_per_seq * mlm_forward_flops(m, m.vocab_size))


def model_flops_per_sample(cfg) -> float:
    """Training FLOPs one sample needs (matmuls only). Recomputation for activation
    checkpointing is not counted (it is overhead, not model work)."""
    return encoder_flops_per_row(cfg) + head_flops_per_sample(cfg)
