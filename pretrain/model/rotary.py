"""ModernBERT's rotary tables, with model.rope_scaling's types as transformers computes them
(modeling_rope_utils: _compute_linear_scaling_rope_parameters, _compute_dynamic_ntk_parameters,
_compute_yarn_parameters; ModernBertRotaryEmbedding multiplies cos and sin by the attention factor).

One difference by design: "dynamic" NTK grows the base with the longest sequence the forward sees.
transformers takes the batch's padded length (max position + 1) and keeps the largest seen so far
(state in the module); here it is the micro-batch's longest document (max position + 1, positions
restart at every document), with no state: the same micro-batch always gets the same tables, so a
recomputed forward and a resumed run compute what the first one did. The two agree whenever a
document fills its row.
"""
from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, max_position_embeddings: int,
                        position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32 on position_ids' device, attention factor) of one layer kind."""
    device = position_ids.device
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return 1.0 / (theta ** exponents), 1.0
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return 1.0 / (theta ** exponents) / factor, 1.0
    if rope_type == "dynamic":
        longest = torch.clamp(position_ids.max().float() + 1, min=float(max_position_embeddings))
        base = theta * ((factor * longest / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** exponents), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, factor, exponents)
    raise ValueError(f"unknown rope_type {rope_type!r}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, scaling: dict, factor: float, exponents: torch.Tensor):
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the original
    length are interpolated (divided by factor), those turning more than beta_fast times kept, a
    linear ramp between; cos and sin scaled by the attention factor (0.1 ln(factor) + 1 by default)."""
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device=exponents.device)
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    frequencies = theta ** exponents
    extrapolated = 1 - ramp  # the share of each dimension kept as trained
    inv_freq = (1.0 / (factor * frequencies)) * (1 - extrapolated) + (1.0 / frequencies) * extrapolated
    return inv_freq, float(attention_factor)


def rotary_tables(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                  scaling: dict | None = None, max_position_embeddings: int | None = None):
    """cos and sin [rows, seq, 1, head_dim] of the rotary angles at `position_ids` ([rows, seq]),
    computed in fp32 and rounded to `dtype`, as transformers' ModernBertRotaryEmbedding (token-major:
    they broadcast over the heads of [rows, seq, heads, head_dim]; fused.rotate applies them).
    `scaling`: one layer kind's model.rope_scaling spec; `max_position_embeddings`: what "dynamic"
    scales from."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, max_position_embeddings or 0,
                                                     position_ids)
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)
