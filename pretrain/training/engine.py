"""The DeepSpeed engine: the one construction sequence pretraining and fine-tuning share, and
pretraining's model, optimizer and guard built into it.

The sequence (`initialize_engine`) is order-sensitive, which is why it lives once:
1. the client optimizer's step is wrapped (the non-finite guard's veto, then ZeRO-0's exact
   clipping right before an update it lets through) before DeepSpeed builds its engine, because
   the LR scheduler DeepSpeed creates wraps whatever `optimizer.step` is then;
2. `deepspeed.initialize` runs under `no_optimizer_steps`: the fp16/bf16 wrappers step once at
   construction, which must not move a weight;
3. where DeepSpeed's own clipping is not exact over TP shards (ZeRO-0), ours replaces it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import deepspeed
import torch

from ..config import Config, build_deepspeed_config
from ..config.choices import compile_enabled
from ..distributed import device, internals
from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss, build_model, init_weights
from ..model.context_split import ContextGroup
from ..model.fused import check_can_compile
from ..model.names import logical_parameters
from ..model.rng import RngTracker
from ..optim import Lamb, StableAdamW, build_optimizer, layout_for_deepspeed, make_lr_scheduler
from ..optim.groups import optimizer_param_groups
from ..optim.guard import NonFiniteGuard, wrap_optimizer_step
from ..optim.norms import counted_once, exact_clipping_for
from ..optim.run_schedule import resolved_schedule, schedule_clock

logger = logging.getLogger(__name__)

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_device(cfg: Config, parallel: Parallel) -> None:
    """The device's math settings (train.tf32), and a refusal of a precision it cannot run; says
    where the run is."""
    device.configure_math(parallel.device, cfg.train.tf32)
    unsupported = device.precision_problem(parallel.device, cfg.train.precision)
    if unsupported:
        raise device.DeviceError(unsupported)
    logger.info(f"{device.describe(parallel)}, ZeRO-{cfg.parallel.zero_stage}, {cfg.train.precision}")


def initialize_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict, parallel: Parallel, *,
                      lr_scheduler: Callable, counted: list, grad_clip: float, mpu,
                      step_is_bad: Callable[[], bool] = lambda: False) -> tuple[object, bool]:
    """`deepspeed.initialize` with our step wrapper and exact clipping. `counted`: the parameters a
    whole-model gradient norm counts on this rank (each logical parameter once). Returns the
    engine and whether the trainer (not DeepSpeed) clips."""
    clipping = None  # ZeRO-0: our clipping, run inside the optimizer's step

    def before_update():
        if clipping is not None:
            internals.report_grad_norm(engine, clipping())

    with internals.no_optimizer_steps(optimizer):  # the fp16/bf16 wrappers step once at construction
        wrap_optimizer_step(optimizer, step_is_bad, before_update)  # inside no_optimizer_steps' own
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                               config=ds_config, mpu=mpu)
    clipping = exact_clipping_for(engine, counted, parallel, grad_clip)
    if clipping is not None:  # bf16 ZeRO-0: DeepSpeed's per-tensor wrapper step in multi-tensor kernels
        internals.multi_tensor_bf16_step(engine)
    return engine, clipping is not None


@dataclass
class PretrainingEngine:
    engine: object  # DeepSpeedEngine, or PipelineEngine with PP > 1
    model: torch.nn.Module
    guard: NonFiniteGuard
    ds_config: dict
    exact_clipping: bool  # the trainer clips (ZeRO-0), not DeepSpeed


def build_pretraining_engine(cfg: Config, parallel: Parallel, tracker: RngTracker,
                             loss_fn: PretrainingLoss) -> PretrainingEngine:
    """The model (partitioned at construction under ZeRO-3), its optimizer, LR schedule and
    non-finite guard, under DeepSpeed."""
    par, pipelined = parallel, parallel.pp_size > 1
    ds_config = build_deepspeed_config(cfg, par.world_size)
    padded_vocab = cfg.model.padded_vocab_size(par.tp_size)

    def make_model():
        model = build_model(cfg.model, padded_vocab, torch.float32, tracker, par.tp_group,
                            pipeline_topology=par.topology if pipelined else None, loss_fn=loss_fn,
                            binary_head=cfg.binary_head, shapes_vary=cfg.shapes_vary,
                            context=ContextGroup(par.cp_rank, par.cp_size, par.cp_group,
                                                         ring=cfg.parallel.context_attention == "ring"))
        init_weights(model, cfg.model, cfg.train.seed, par.tp_rank, par.tp_size)
        return model

    if cfg.parallel.zero_stage == 3:
        # Partition at construction, over the (context x) data-parallel group only: without it
        # shards of different TP ranks would be mixed and the loss silently wrong.
        with deepspeed.zero.Init(data_parallel_group=par.dp_cp_group, config_dict_or_path=ds_config, mpu=par.mpu,
                                 remote_device=None, pin_memory=False):
            model = make_model()
    else:
        model = make_model()

    o = cfg.optimizer
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "lamb":
        hyper["max_trust_ratio"] = o.max_trust_ratio
        hyper["fused"] = compile_enabled(o.fused, par.device.type)
        if hyper["fused"]:
            check_can_compile(par.device.type, "optimizer.fused")
    if o.name == "stable_adamw":
        hyper.update(decouple_lr=o.decouple_lr, max_lr=o.max_lr, kahan_sum=o.kahan_sum)
    optimizer = build_optimizer(o.name, optimizer_param_groups(model, o), **hyper)
    # Our non-finite check runs in every precision and ZeRO stage (DeepSpeed's wrappers add
    # their own, except at ZeRO-0 fp32); resilience.skip_nonfinite_steps decides whether it vetoes.
    guard = NonFiniteGuard(par.device, loss_fn.all_finite, veto=cfg.resilience.skip_nonfinite_steps, rank=par.rank)
    guard.watch((lp.hf_name, lp.param) for lp in logical_parameters(model))

    def scheduler(opt):
        return make_lr_scheduler(opt, hold=lambda: bool(guard.skipped()), clock=schedule_clock(cfg),
                                 **resolved_schedule(cfg))

    engine, exact = initialize_engine(
        model, optimizer, ds_config, par, lr_scheduler=scheduler, grad_clip=o.clip(),
        counted=[lp.param for lp in counted_once(model, par)], step_is_bad=guard.step_is_bad,
        mpu=None if pipelined else par.mpu)  # the pipeline engine takes its grid from the topology
    if par.dp_cp_size == 1 and cfg.parallel.zero_stage == 0 and not pipelined:
        internals.skip_backward_allreduce(engine)
    if cfg.train.precision == "fp16":
        internals.let_loss_scaler_reach_minimum(engine)
    if isinstance(optimizer, (Lamb, StableAdamW)):  # per-parameter terms over whole logical parameters
        optimizer.set_layout(layout_for_deepspeed(engine, par.tp_group if par.tp_size > 1 else None,
                                                  par.dp_cp_group if par.dp_cp_size > 1 else None, par.device))
    accumulation, reduction = internals.gradient_dtypes(engine)
    logger.info(f"optimizer {o.name} under DeepSpeed's {type(engine.optimizer).__name__}; "
                f"gradients accumulated in {_dtype_name(accumulation)}, reduced in {_dtype_name(reduction)}, "
                + o.clipping_words() + ((" exactly by the trainer" if exact else " by DeepSpeed") if o.clip() > 0 else ""))
    if o.name == "lamb" and optimizer.fused:
        logger.info(f"optimizer.fused {o.fused}: LAMB's Adam direction runs as one compiled kernel per tensor; "
                    "the first step compiles it")
    if compile_enabled(cfg.model.compile, par.device.type):
        logger.info(f"model.compile {cfg.model.compile}: the first step compiles the fused kernels (torch.compile), "
                    "which takes a minute or more before its line; the steps after reuse them")
    return PretrainingEngine(engine, model, guard, ds_config, exact)


def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in PRECISION_DTYPES.items() if d == dtype), str(dtype))

