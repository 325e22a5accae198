"""Rank entry point of the precision x ZeRO x layout matrix (tests/test_precision_matrix.py).

usage: python tests/_matrix_worker.py OUT.json CONFIG_JSON...
CONFIG_JSON: {"world": LABEL, "tp": TP, "pp": PP, "name": ..., "overrides": [...], "runs": [RUN...]}
on top of the tests' tiny config. One job runs every world it is given, one after the other: the
process group stays, the TP/PP/DP groups are built anew for each world (init_parallel), so a device
starts its processes once. Each RUN is one of
- "straight": a NaN loss at step 3 (skipped, training goes on), checkpoints after steps 2 and 4,
  a NaN loss at step 5 and infinite gradients (the loss finite) at step 6 with
  resilience.max_consecutive_skips=2: the run stops at step 6 naming loss and gradients (fp16: its loss
  scale, 2**8, is its minimum from the start, where an overflow is divergence); then an
  evaluation of the weights it stopped with (step 4's);
- "resumed": the straight run's step-2 checkpoint resumed in a fresh trainer, the same steps 3-6
  and evaluation (exact resume: equal to the straight run's);
- "overflow": fp16 only, infinite gradients at steps 2-3 with the loss scale above its minimum:
  loss-scale overflows, skipped and never stopping the run (max_consecutive_skips=1);
- "accumulation": the first step's accumulated gradient, as the optimizer receives it, against
  the sum of the micro-batch gradients taken in float64 (what fp32 accumulation keeps).
The logging rank writes, per config and run: the per-step metrics, what became of each step, the
parameter norm after each, the evaluation, the error that stopped the run, and what proves the
configuration took effect on every rank (wrapper, parameter and gradient dtypes, devices, sizes).
"""
import gc
import json
import os
import sys

import torch

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from _guard_worker import build  # noqa: E402
from _train_worker import TINY, finish, where_it_ran  # noqa: E402
from pretrain.distributed import device, internals  # noqa: E402
from pretrain.model.fused import compile_counters  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402

BASE = ["train.train_steps=8", "scheduler.warmup_steps=4", "eval.steps=2", "data.num_workers=0",
        "logging.interval=1", "resilience.max_consecutive_skips=2"]
# a NaN loss at steps 3 and 5, a NaN gradient of one parameter (PARAMETER) with a finite loss at step 6
STRAIGHT = [{"poison": "loss", "steps": [3, 5]}, {"poison": "parameter", "steps": [6]}]
# ModernBERT's configurations (model.architecture=modernbert) poison its layer-1 attention output
# projection instead: row-parallel like BERT's, on rank 1 of DP2, TP2 and PP2 alike
MODERN_PARAMETER = "model.layers.1.attn.Wo.weight"
# fp16 (ignored otherwise): a dynamic loss scale of 2**8 that is already its minimum
AT_MIN_SCALE = ["fp16.initial_scale_power=8", "fp16.min_loss_scale=256"]


def what_took_effect(trainer, parallel) -> dict:
    """This rank's view, from DeepSpeed and megatron-core themselves."""
    from megatron.core import parallel_state as ps

    engine = trainer.engine
    accumulation, communication = internals.gradient_dtypes(engine)
    return {"rank": parallel.rank, "wrapper": type(engine.optimizer).__name__,
            "parameter_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "grad_accumulation": str(accumulation), "grad_communication": str(communication),
            "tp": ps.get_tensor_model_parallel_world_size(), "dp": engine.dp_world_size,
            "pp": engine.num_stages if trainer.pipelined else 1, **where_it_ran(trainer, parallel),
            # optimizer.fused: our LAMB's compiled direction
            "optimizer_fused": bool(getattr(internals.client_optimizer(engine), "fused", False)),
            # bf16 ZeRO-0: the wrapper's step replaced by internals.multi_tensor_bf16_step
            "multi_tensor_step": getattr(vars(engine.optimizer).get("step"), "__name__", "") == "multi_tensor_step"}


def train(cfg, parallel, poisons=(), rank=0) -> dict:
    cfg.validate(world_size=parallel.world_size)
    gc.collect()  # the previous run's engine: its buffers would count in this run's device memory
    trainer = build(cfg, parallel, [dict(run_poison, rank=rank) for run_poison in poisons])
    norms, outcomes, sources = [], [], []

    def measure(step):  # after each step, on every rank
        norms.append(trainer.params_norm())
        outcomes.append(step.outcome.label if step.outcome.skipped else "")
        sources.append([source._asdict() for source in step.outcome.sources])

    result = {"norms": norms, "outcomes": outcomes, "sources": sources, "took_effect": device.all_gather_object(what_took_effect(trainer, parallel))}
    try:
        trainer.train(after_step=measure)
    except Exception as error:  # the run controls' own error is what the stop looks at
        result["error"] = [type(error).__name__, str(error)]
    result["history"] = trainer.history  # each step's metrics, also those before an error
    result["memory"] = trainer.first_step_memory  # every rank's measured and planned bytes (step 1)
    result["evaluation"] = trainer.evaluate()  # the weights the run ended with
    result["skipped_steps"] = trainer.steps_skipped
    result["compiled_graphs"] = compile_counters()["unique_graphs"]  # torch.compile's graphs so far
    return result


def accumulation_error(cfg, parallel) -> dict:
    """Step 1's gradient as the client optimizer receives it (fp32, after accumulation and the
    data-parallel reduction) against the float64 sum of every micro-batch's gradient of every rank,
    each logical parameter compared whole: ||received - exact|| / ||exact||."""
    from pretrain.optim.layout import layout_for_deepspeed

    cfg.validate(world_size=parallel.world_size)
    trainer = Trainer(cfg, parallel)
    exact = {}  # parameter id -> float64 sum of its micro-batch gradients on this rank

    def add(param):
        def hook(grad):
            key = id(param)
            exact[key] = exact.get(key, 0) + grad.detach().double()
        return hook

    params = list(trainer.model.parameters())
    for param in params:
        param.register_hook(add(param))
    layout = layout_for_deepspeed(trainer.engine)
    received = {}

    def capture(optimizer, args, kwargs):  # the gradients the optimizer is about to apply
        # ZeRO-1/2 step one param group at a time, each with its partition's .grad just set
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.grad is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                for seg in layout.segments_for(tensor):
                    param = layout.params[seg.logical_index] if layout.params else tensor
                    piece = tensor.grad.reshape(-1).narrow(0, seg.start, seg.numel).double()
                    received.setdefault(id(param), []).append((seg.param_offset, piece))

    seen = set()
    internals.client_optimizer(trainer.engine).register_step_pre_hook(capture)
    trainer.train()
    diff_sq = exact_sq = torch.zeros((), dtype=torch.float64, device=parallel.device)
    for param in params:
        if id(param) not in exact:
            continue
        total = device.all_reduce(exact[id(param)].clone(), group=parallel.dp_group) / parallel.dp_size
        flat = total.reshape(-1)
        for offset, piece in received.get(id(param), []):
            diff_sq = diff_sq + (piece - flat.narrow(0, offset, piece.numel())).pow(2).sum()
            exact_sq = exact_sq + flat.narrow(0, offset, piece.numel()).pow(2).sum()
    diff_sq, exact_sq = device.all_reduce(torch.stack([diff_sq, exact_sq])).tolist()
    return {"relative_error": (diff_sq / exact_sq) ** 0.5,
            "took_effect": device.all_gather_object(what_took_effect(trainer, parallel))}


def main():
    out_path, configs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    scratch = os.path.dirname(os.path.abspath(out_path))
    results, parallel, world = {}, None, None
    for config in configs:
        if (config["world"], config["tp"], config["pp"]) != world:
            world = config["world"], config["tp"], config["pp"]
            parallel = init_parallel(launch, config["tp"], config["pp"], timeout_minutes=3)
        label, name = config["world"], config["name"]
        layout = [f"parallel.tensor_parallel={config['tp']}", f"parallel.pipeline_parallel={config['pp']}"]
        overrides = TINY + layout + BASE + config["overrides"]
        last = parallel.world_size - 1  # a rank of the last stage: it computes the loss
        ckpt = os.path.join(scratch, f"ckpt-{label}-{name}")
        done = {}
        straight = STRAIGHT
        if "model.architecture=modernbert" in config["overrides"]:
            straight = [STRAIGHT[0], {**STRAIGHT[1], "parameter": MODERN_PARAMETER}]
        for run in config["runs"]:
            if run == "straight":
                cfg = load_config(None, overrides + [f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2",
                                                     "checkpoint.keep_last=0", *AT_MIN_SCALE])
                done[run] = train(cfg, parallel, straight, last)
            elif run == "resumed":
                # resume from the step-2 checkpoint, not the latest (step 4): every rank points
                # `latest` there itself before reading it (atomic replace, the same content)
                temp = os.path.join(ckpt, f"latest.tmp{parallel.rank}")
                with open(temp, "w") as f:
                    f.write("iter_0000002")
                os.replace(temp, os.path.join(ckpt, "latest"))
                cfg = load_config(None, overrides + [f"checkpoint.load_dir={ckpt}", *AT_MIN_SCALE])
                done[run] = train(cfg, parallel, straight, last)
            elif run == "overflow":
                cfg = load_config(None, overrides + ["resilience.max_consecutive_skips=1", "train.train_steps=4",
                                                     "scheduler.warmup_steps=2", "fp16.initial_scale_power=8"])
                done[run] = train(cfg, parallel, [{"poison": "gradients", "steps": [2, 3]}], last)
            elif run == "accumulation":
                cfg = load_config(None, overrides + ["train.train_steps=1", "scheduler.warmup_steps=0", "optimizer.grad_clip=0"])
                done[run] = accumulation_error(cfg, parallel)
            else:
                raise ValueError(f"unknown run {run!r}")
        # the logging rank's view (the last pipeline stage's: it has the losses), kept by every rank
        results.setdefault(label, {})[name] = device.all_gather_object(done)[parallel.logging_rank]
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
