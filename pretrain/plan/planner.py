"""Every layout of a config on N devices, its predicted memory per rank and step time, ranked.

    rows, refused = plan(cfg, gpus, budget, hardware)   # fitting layouts first, by predicted step time

The memory of a layout is its most loaded rank's (the pipeline stage with the most; with one
stage all ranks hold the same); a layout fits when that total stays within the budget (the
device's memory less a reserve for what torch's allocator does not see: the CUDA context,
NCCL's buffers, fragmentation).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..config.deepspeed import read_user_deepspeed_config
from .layouts import Layout, candidate_layouts, shapes_only
from .memory import MemoryPrediction, predict_memory, zero_settings
from .shapes import StageParams, stage_parameters
from .step_time import Hardware, StepTime, predict_step_time

GiB = 2**30


@dataclass(frozen=True)
class Budget:
    device_memory: int  # bytes
    reserve: int  # bytes kept for the CUDA context, NCCL, fragmentation

    @property
    def usable(self) -> int:
        return self.device_memory - self.reserve


@dataclass
class PlanRow:
    layout: Layout
    memory: MemoryPrediction  # the most loaded rank's
    stage: int  # which pipeline stage that is
    time: StepTime
    fits: bool
    why: str  # what does not fit, when it does not
    global_batch: int

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.time.total


# What no prediction models, for the plan to say so (docs/training.md, "Limits")
NOT_MODELLED = ("padding and data.packing (every micro-batch is predicted as full rows of data.seq_length)",
                "CPU offload (offload_optimizer, offload_param)",
                "evaluation, checkpoint saves and data loading (not in the step time)",
                "communication overlapped with compute (none assumed)")


def unmodelled(cfg: Config) -> list[str]:
    """What of this config the plan does not model (one line each; none for most configs)."""
    notes = []
    if cfg.real_tokens_only:
        family = "ModernBERT" if cfg.model.modern else "BERT (no context parallelism)"
        notes.append(f"{family} computes real tokens only: its memory and step time are predicted for full rows of "
                     "data.seq_length (an upper bound; the real share is the data's)")
    elif cfg.data.packing:
        notes.append("this config packs samples (data.packing=true): its memory and step time are predicted for "
                     "padded rows; GPUs also keep a [rows, 1, seq, seq] attention mask per layer")
    if cfg.train.deepspeed_config:
        zero = read_user_deepspeed_config(cfg.train.deepspeed_config).get("zero_optimization", {})
        offload = [key for key in ("offload_optimizer", "offload_param")
                   if isinstance(zero.get(key), dict) and zero[key].get("device", "none") != "none"]
        if offload:
            notes.append(f"{cfg.train.deepspeed_config} offloads to the CPU ({', '.join(offload)}): the plan counts "
                         "those states on the device")
    return notes


def why_not(memory: MemoryPrediction, budget: Budget) -> str:
    """What a layout that does not fit spends its memory on (its two largest items)."""
    items = sorted(((k, v) for k, v in memory.breakdown().items() if k != "device_peak"), key=lambda kv: -kv[1])
    largest = ", ".join(f"{name.replace('_', ' ')} {value / GiB:.1f}" for name, value in items[:2])
    return f"{memory.total / GiB:.1f} GiB > {budget.usable / GiB:.1f} GiB usable ({largest})"


def plan(cfg: Config, gpus: int, budget: Budget, hw: Hardware, device_type: str = "cuda",
         **choices) -> tuple[list[PlanRow], dict[str, int]]:
    """Rows for every valid layout (sorted: fitting ones by predicted step time, then the rest by
    step time) and the refused layouts counted by the trainer's reason. `choices` restrict the
    enumeration (candidate_layouts' precisions, recompute, zero_stages, micro_batches)."""
    cfg = shapes_only(cfg)
    layouts, refused = candidate_layouts(cfg, gpus, hw.gpus_per_node, **choices)
    zero_config = zero_settings(cfg)
    stage_cache: dict[tuple[int, int], list[StageParams]] = {}
    rows = []
    for layout in layouts:
        key = (layout.tp, layout.pp)
        if key not in stage_cache:
            stage_cache[key] = stage_parameters(cfg, layout.tp, layout.pp)
        stages = stage_cache[key]
        run_cfg = layout.apply(cfg)
        per_stage = [predict_memory(run_cfg, layout, stage, stages, device_type, zero_config=zero_config)
                     for stage in range(layout.pp)]
        worst = max(range(layout.pp), key=lambda s: per_stage[s].total)
        memory = per_stage[worst]
        time = predict_step_time(run_cfg, layout, hw, [s.numel for s in stages], memory.gradient_bytes_per_element)
        fits = memory.total <= budget.usable
        rows.append(PlanRow(layout, memory, worst, time, fits, "" if fits else why_not(memory, budget),
                            cfg.train.global_batch_size))
    rows.sort(key=lambda row: (not row.fits, row.time.total, row.memory.total))
    return rows, dict(refused)
