"""The train section (batch sizes, steps, precision, seed, batch warmup) and the fp16 section (its loss
scaling), with the rules about their own fields."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import non_negative, one_of, positive
from .choices import PRECISIONS


@dataclass
class TrainConfig:
    """What is trained and how: batch, steps, precision."""

    global_batch_size: int = 256  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    train_steps: int = 1000  # optimizer steps
    seed: int = 42  # model init / dropout seed
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    # bf16 only: the dtype gradients are accumulated over micro-batches and reduced over data-parallel
    # ranks in. "fp32" keeps what Megatron-LM keeps (DeepSpeed does it at ZeRO >= 1); "bf16" halves
    # gradient memory and reduction traffic and rounds every addition to 8 significant bits
    grad_accum_dtype: str = "fp32"
    tf32: bool = True  # TF32 tensor cores for fp32 matrix products on GPUs (Ampere and later); no effect on CPU
    deepspeed_config: str | None = None  # path to a user DeepSpeed JSON adding DeepSpeed-only options
    # batch-size warmup (ModernBERT's): the global batch grows linearly in the tokens seen (samples x
    # data.seq_length) from batch_warmup_min_size to global_batch_size over this many tokens, in
    # multiples of batch_warmup_min_size (the same batches at every layout: it must be a multiple of
    # micro_batch_size x data parallel); 0 = no warmup
    batch_warmup_tokens: int = 0
    batch_warmup_min_size: int | None = None

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("global_batch_size", "micro_batch_size", "train_steps"):
            positive(p, f"train.{name}", getattr(self, name))
        non_negative(p, "train.batch_warmup_tokens", self.batch_warmup_tokens)
        if self.batch_warmup_tokens and self.batch_warmup_min_size is None:
            p.append("train.batch_warmup_tokens needs train.batch_warmup_min_size (the first batch, and the ramp's step)")
        if self.batch_warmup_min_size is not None:
            if not self.batch_warmup_tokens:
                p.append("train.batch_warmup_min_size is set without train.batch_warmup_tokens")
            if not 0 < self.batch_warmup_min_size < self.global_batch_size:
                p.append(f"train.batch_warmup_min_size ({self.batch_warmup_min_size}) must be in "
                         f"(0, train.global_batch_size ({self.global_batch_size}))")
        non_negative(p, "train.seed", self.seed)
        one_of(p, "train.precision", self.precision, PRECISIONS)
        return p


@dataclass
class Fp16Config:
    """Loss scaling for train.precision fp16 (ignored otherwise), as Megatron's --loss-scale,
    --initial-loss-scale, --loss-scale-window, --hysteresis and --min-loss-scale; written into the
    DeepSpeed JSON's fp16 block (a user JSON may not contradict them)."""

    loss_scale: float = 0.0  # 0 = dynamic scaling; > 0 = this static scale
    initial_scale_power: int = 16  # dynamic scaling starts at 2 ** this
    loss_scale_window: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_loss_scale: int = 1  # the scale never drops below this (an integer for DeepSpeed)

    def problems(self) -> list[str]:
        p: list[str] = []
        non_negative(p, "fp16.loss_scale", self.loss_scale)
        if not 0 <= self.initial_scale_power <= 64:
            p.append(f"fp16.initial_scale_power ({self.initial_scale_power}) must be in [0, 64]")
        for name in ("loss_scale_window", "hysteresis", "min_loss_scale"):
            positive(p, f"fp16.{name}", getattr(self, name))
        if self.min_loss_scale > 0 and self.loss_scale == 0 and 2.0 ** min(self.initial_scale_power, 64) < self.min_loss_scale:
            p.append(f"fp16.min_loss_scale ({self.min_loss_scale}) must be <= 2 ** fp16.initial_scale_power "
                     f"({2 ** self.initial_scale_power})")
        return p

    def deepspeed_block(self) -> dict[str, Any]:
        """DeepSpeed's names for the same settings (its fp16 block)."""
        return {"loss_scale": self.loss_scale, "initial_scale_power": self.initial_scale_power,
                "loss_scale_window": self.loss_scale_window, "hysteresis": self.hysteresis,
                "min_loss_scale": self.min_loss_scale}
