"""The DeepSpeed JSON derived from our config. Our config is the single source of truth for batch
sizes, precision, ZeRO stage and gradient clipping; a user DeepSpeed JSON (train.deepspeed_config)
may add DeepSpeed-only options, and a value in it that contradicts ours is an error, never an
override."""
from __future__ import annotations

import json
from typing import Any

from .precision import deepspeed_precision
from .schema import Config
from .typed_yaml import ConfigError, deep_merge


_MISSING = object()
_DS_STEPS_PER_PRINT = 2**31 - 1  # effectively never: the trainer does its own logging


def deepspeed_settings(global_batch_size: int, micro_batch_size: int, grad_accum_steps: int, grad_clip: float,
                       zero_stage: int, precision: str, loss_scaling: dict[str, Any] | None = None,
                       grad_accum_dtype: str = "fp32") -> dict[str, Any]:
    """The DeepSpeed config of the settings our configs own (batch sizes, clipping, ZeRO stage,
    precision with bf16's gradient dtype, fp16 loss scaling), as pretraining and fine-tuning both
    hand it to DeepSpeed."""
    ds: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        **deepspeed_precision(precision, grad_accum_dtype),
        "zero_allow_untested_optimizer": True,  # our LAMB/AdamW are client optimizers
        # Defaults a user JSON may change (DeepSpeed-only diagnostics with no counterpart here).
        "steps_per_print": _DS_STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        ds["fp16"].update(loss_scaling or {"loss_scale": 0})  # 0 = dynamic loss scaling
    return ds


def deepspeed_batch(cfg: Config, samples: int) -> int:
    """DeepSpeed's train_batch_size for a global batch of `samples`: one micro-batch per rank of
    its data group (context x data), the CP ranks of a group sharing theirs."""
    return samples * cfg.parallel.context_parallel


def build_deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed config dict derived from our config, with the user's DeepSpeed JSON
    (cfg.train.deepspeed_config) merged in. The user JSON may add DeepSpeed-only options;
    a key we own with a different value, or an `optimizer`/`scheduler` block, is a ConfigError."""
    t = cfg.train
    accum = cfg.grad_accum_steps(world_size)
    # DeepSpeed counts a micro-batch per rank of its data group, context x data: the CP ranks of a
    # group share theirs, so its batch is the global batch times the CP size
    ds = deepspeed_settings(deepspeed_batch(cfg, t.global_batch_size), t.micro_batch_size, accum, cfg.optimizer.clip(),
                            cfg.parallel.zero_stage, t.precision, cfg.fp16.deepspeed_block(), t.grad_accum_dtype)
    pipelined_shapes_vary = cfg.shapes_vary and cfg.parallel.pipeline_parallel > 1
    if pipelined_shapes_vary:
        # Packed micro-batches have as many rows as their samples fill, and a model computing real
        # tokens only as many tokens as are real: the pipeline engine then exchanges shapes per micro-batch
        # (dynamic_shape), but its TP-partitioned activations and gradients keep the first
        # micro-batch's shape for good (PipelineEngine's pipe_partition_*_meta_cache). Send them
        # whole between stages instead.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}

    if t.deepspeed_config is None:
        return ds
    src = t.deepspeed_config
    user = read_user_deepspeed_config(src)
    if "bfloat16" in user:  # DeepSpeed's old spelling; it reads "bf16" first, so ours would win silently
        raise ConfigError(f"{src}: use 'bf16' instead of the deprecated 'bfloat16' key")

    # Keys we own: (path in DeepSpeed JSON, our value as shown to the user, what to set instead).
    precision = f"train.precision={t.precision}"
    cp = cfg.parallel.context_parallel
    times_cp = f" x parallel.context_parallel={cp}" if cp > 1 else ""
    owned = [
        (("train_batch_size",), f"train.global_batch_size={t.global_batch_size}" + times_cp, "train.global_batch_size"),
        (("train_micro_batch_size_per_gpu",), f"train.micro_batch_size={t.micro_batch_size}",
         "train.micro_batch_size"),
        (("gradient_accumulation_steps",),
         f"{accum} (train.global_batch_size / (train.micro_batch_size x data parallel size))",
         "train.global_batch_size / train.micro_batch_size"),
        (("gradient_clipping",), f"optimizer.grad_clip={cfg.optimizer.clip()}", "optimizer.grad_clip"),
        (("zero_optimization", "stage"), f"parallel.zero_stage={cfg.parallel.zero_stage}", "parallel.zero_stage"),
        (("bf16", "enabled"), precision, "train.precision"),
        (("fp16", "enabled"), precision, "train.precision"),
        *[(("fp16", key), f"fp16.{key}={value}", f"fp16.{key}")
          for key, value in cfg.fp16.deepspeed_block().items() if t.precision == "fp16"],
        *[(path, f"train.grad_accum_dtype={t.grad_accum_dtype}", "train.grad_accum_dtype")
          for path in (("data_types", "grad_accum_dtype"), ("communication_data_type",)) if t.precision == "bf16"],
        (("zero_allow_untested_optimizer",), "the trainer's required true (LAMB/AdamW are client optimizers)",
         None),
        *[(("pipeline", key), "the trainer's (its micro-batches change shape: real tokens only, or packed rows; "
           "DeepSpeed's partitioned pipeline activations cannot)", None)
          for key in ("pipe_partitioned", "grad_partitioned") if pipelined_shapes_vary],
    ]
    problems: list[str] = []
    for block, ours in (("optimizer", "optimizer.*"), ("scheduler", "scheduler.*")):
        if block in user:
            problems.append(f"{src}: '{block}' block not allowed: LAMB/AdamW and the LR schedule are "
                            f"configured in our config, not in DeepSpeed JSON; set {ours} instead")
    for path, ours, instead in owned:
        node: Any = user
        for part in path:
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        ours_value = _get_path(ds, path)
        if node is not _MISSING and not _same_value(node, ours_value):
            fix = f"set {instead} instead" if instead else "remove it from the file"
            problems.append(f"{src}: {'.'.join(path)}={json.dumps(node)} contradicts {ours}; {fix}")
    for key, value in user.items():
        if isinstance(ds.get(key), dict) and not isinstance(value, dict):
            problems.append(f"{src}: '{key}' must be a JSON object, got {json.dumps(value)}")
    if problems:
        raise ConfigError(problems)
    return deep_merge(ds, user)


def read_user_deepspeed_config(src: str) -> dict:
    """train.deepspeed_config's JSON object, or a ConfigError naming the file."""
    try:
        with open(src, encoding="utf-8") as f:
            user = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"train.deepspeed_config: file not found: {src}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{src}: invalid JSON: {e}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{src}: top level must be a JSON object, got {type(user).__name__}")
    return user


def _same_value(a: Any, b: Any) -> bool:
    # 1 == 1.0 is fine (gradient_clipping), but JSON true is not the number 1
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _get_path(d: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        d = d[part]
    return d
