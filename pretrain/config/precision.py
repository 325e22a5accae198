"""Which precision x ZeRO stage x pipeline combinations run, and how bf16 gradients are kept: the
rules pretraining and fine-tuning share, and the DeepSpeed settings they turn into.

bf16 gradients are accumulated over micro-batches and reduced over data-parallel ranks in fp32 by
default (`train.grad_accum_dtype`), as Megatron-LM does: a bf16 sum of 8-32 micro-batch gradients
keeps 8 significant bits of each addition. DeepSpeed implements that only in its ZeRO optimizers
(BF16_Optimizer at ZeRO-1, DeepSpeedZeroOptimizer at ZeRO-2, ZeRO-3); at ZeRO-0 its engine raises
NotImplementedError ("unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=
torch.float32", deepspeed/runtime/engine.py _do_optimizer_sanity_check), so that combination is
refused here with the two ways out.
"""
from __future__ import annotations

from typing import Any

from .choices import GRAD_ACCUM_DTYPES


def precision_problems(precision: str, grad_accum_dtype: str, zero_stage: int, pipeline_parallel: int = 1) -> list[str]:
    """The combinations DeepSpeed cannot run, one line each (empty when this one runs)."""
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        return [f"train.grad_accum_dtype ({grad_accum_dtype!r}) must be one of: {', '.join(GRAD_ACCUM_DTYPES)}"]
    if precision == "fp16" and zero_stage == 0:
        # deepspeed/runtime/engine.py backward() scales the loss only for ZeRO optimizers, while
        # FP16_UnfusedOptimizer.step() divides the gradients by the loss scale all the same
        return ["train.precision fp16 at parallel.zero_stage 0: DeepSpeed 0.19's fp16 ZeRO-0 optimizer divides the "
                "gradients by the loss scale although its engine never scaled the loss, so every update would see "
                "the gradient divided by 2**fp16.initial_scale_power; set parallel.zero_stage=1 (the weights and "
                "gradients of ZeRO-0, the optimizer state partitioned over data-parallel ranks)"]
    if precision != "bf16":
        if grad_accum_dtype != "fp32":
            return [f"train.grad_accum_dtype {grad_accum_dtype} is for train.precision bf16 (this run is "
                    f"{precision}: fp32 gradients are fp32, fp16's are DeepSpeed's loss-scaled fp16)"]
        return []
    if zero_stage == 0 and grad_accum_dtype == "fp32":
        return ["train.precision bf16 at parallel.zero_stage 0: DeepSpeed accumulates and reduces bf16 gradients "
                "in fp32 (train.grad_accum_dtype fp32, the default) only in its ZeRO optimizers; set "
                "parallel.zero_stage=1 (the weights and gradients of ZeRO-0, the optimizer state partitioned "
                "over data-parallel ranks) or train.grad_accum_dtype=bf16"]
    if zero_stage == 0 and pipeline_parallel > 1:
        # deepspeed/runtime/engine.py _load_checkpoint hands BF16_Optimizer.load_state_dict the one
        # optimizer dict of a ZeRO-0 checkpoint, where it expects ZeRO's per-rank list (KeyError: 0)
        return [f"train.precision bf16 with pipeline parallelism ({pipeline_parallel} stages) at parallel.zero_stage 0: "
                "DeepSpeed's bf16 pipeline optimizer cannot resume its own ZeRO-0 checkpoints; set "
                "parallel.zero_stage=1 (the same memory at one data-parallel rank, less at more)"]
    return []


def deepspeed_precision(precision: str, grad_accum_dtype: str = "fp32") -> dict[str, Any]:
    """The DeepSpeed keys of a precision: the bf16/fp16 switches, and for bf16 the dtype gradients
    are accumulated in (`data_types.grad_accum_dtype`) and reduced in (`communication_data_type`;
    DeepSpeed's default for bf16 is bf16 even when it accumulates in fp32)."""
    ds: dict[str, Any] = {"bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16"}}
    if precision == "bf16":
        ds["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
        ds["communication_data_type"] = grad_accum_dtype
    return ds
