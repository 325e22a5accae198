"""The valid names of the config's choice fields, in one place: the config checks against them,
and the code that acts on a choice (optimizers, LR schedule, segment pairs) refuses anything else
with the same list."""
from __future__ import annotations

# The kinds the model labels its parameters with; optimizer.no_weight_decay and
# optimizer.no_layer_adaptation entries must be among them.
PARAMETER_KINDS = ("weight", "bias", "layernorm", "embedding")
OPTIMIZERS = ("lamb", "adamw", "stable_adamw")
DECAYS = ("linear", "poly", "cosine", "1-sqrt", "inverse_sqrt", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")
GRAD_ACCUM_DTYPES = ("fp32", "bf16")  # what bf16 gradients are accumulated and reduced in
DATA_KINDS = ("synthetic", "indexed")
SEGMENT_PAIRS = ("nsp", "sop", "none")
MASKING_MODES = ("static", "dynamic")
RECOMPUTE = ("none", "selective", "full")  # Megatron's --recompute-granularity, and none
SPIKE_POLICIES = ("off", "log", "skip", "rollback")  # resilience.spike_policy
# model.architecture: the 2018 BERT (post-LN, learned positions, token types, NSP head) or
# ModernBERT (pre-LN, rotary positions, GeGLU, alternating local/global attention, MLM only)
ARCHITECTURES = ("bert", "modernbert")
CLASSIFIER_POOLING = ("cls", "mean")  # model.classifier_pooling (ModernBERT sequence heads)
ATTENTION_KERNELS = ("auto", "varlen", "flex")  # model.attention_kernel (ModernBERT on CUDA)
COMPILE_CHOICES = ("auto", "true", "false")  # model.compile


def compile_enabled(setting: str, device_type: str) -> bool:
    """model.compile resolved for a device: "true", "false", or "auto" (on for CUDA, where the
    fused kernels pay; off on the CPU, whose eager path is tuned and where compiling costs more
    than a short run saves)."""
    if setting == "auto":
        return device_type == "cuda"
    return setting == "true"
