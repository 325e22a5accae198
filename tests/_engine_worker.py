"""Rank entry point: what the optimizer holds right after the trainer built its DeepSpeed engine.

usage: python tests/_engine_worker.py OUT.json [PRECISION...]   (default: fp32 bf16; fp16 needs a GPU or fakegpu)
For each precision x ZeRO stage x optimizer: how many parameters already have optimizer state
(a step taken during construction) and the largest relative difference between the tensors the
optimizer steps (fp32 masters) and the model's own weights. Also the fp16 loss scale read from
DeepSpeed's FP16_UnfusedOptimizer, the wrapper fp16 gets at ZeRO-0.
"""
import json
import os
import sys
from types import SimpleNamespace

import torch

from _train_worker import TINY
from pretrain.distributed import internals
from pretrain.config import load_config
from pretrain.optim.layout import layout_for_deepspeed
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
from pretrain.training.trainer import Trainer


def model_values(param, segment):
    """The model's values that a master segment must equal (ZeRO-3: this rank's partition)."""
    if internals.is_zero3_param(param):
        return internals.zero3_partition(param).reshape(-1)[:segment.numel]
    return param.detach().reshape(-1)[segment.param_offset:segment.param_offset + segment.numel]


def inspect(engine) -> dict:
    layout = layout_for_deepspeed(engine)
    worst = 0.0
    for tensor, segments in layout.entries():
        flat = tensor.detach().reshape(-1)
        for seg in segments:
            master = flat[seg.start:seg.start + seg.numel].double()
            model = model_values(layout.params[seg.logical_index], seg).double()
            worst = max(worst, ((master - model).abs() / master.abs().clamp(min=1e-3)).max().item())
    return {"optimizer_states": len(engine.basic_optimizer.state), "max_relative_difference": worst,
            "wrapper": type(engine.optimizer).__name__,
            "model_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()})}


def fp16_loss_scale() -> dict:
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    weight = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    wrapper = FP16_UnfusedOptimizer(torch.optim.SGD([weight], lr=0.1), deepspeed=None, static_loss_scale=1024.0)
    return {"loss_scale": internals.loss_scale(SimpleNamespace(optimizer=wrapper)),
            "has_cur_scale": hasattr(wrapper, "cur_scale")}


def main():
    out_path, precisions = sys.argv[1], sys.argv[2:] or ["fp32", "bf16"]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)
    results = {"device": str(parallel.device)}
    for precision in precisions:
        for stage in (0, 1, 2, 3):
            if precision == "fp16" and stage == 0:
                continue  # refused (pretrain/config/precision.py)
            for optimizer in ("lamb", "adamw"):
                extra = ["train.deepspeed_config=tests/zero3-partition-everything.json"] if stage == 3 else []
                if precision == "bf16" and stage == 0:  # FP16_UnfusedOptimizer: fp32 accumulation needs ZeRO >= 1
                    extra.append("train.grad_accum_dtype=bf16")
                cfg = load_config(None, TINY + [f"train.precision={precision}", f"parallel.zero_stage={stage}",
                                                f"optimizer.name={optimizer}"] + extra)
                cfg.validate(world_size=parallel.world_size)
                trainer = Trainer(cfg, parallel)
                results[f"{precision}-zero{stage}-{optimizer}"] = inspect(trainer.engine)
                del trainer
    if "fp16" not in precisions:
        results["fp16"] = fp16_loss_scale()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
    shutdown_parallel()


if __name__ == "__main__":
    main()
