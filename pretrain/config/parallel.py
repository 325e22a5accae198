"""The parallel section: tensor, pipeline and context parallelism, ZeRO, with the rules about its own fields."""
from __future__ import annotations

from dataclasses import dataclass

CONTEXT_ATTENTION = ("allgather", "ring")


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0  # DeepSpeed ZeRO stage, 0..3
    # ranks that split each micro-batch's tokens (pretrain/model/context_parallel.py); they read
    # the same micro-batches, and gradients average (and ZeRO partitions) over context x data
    context_parallel: int = 1
    # how CP's global attention layers see every share's keys: "allgather" (gathered, each layer
    # keeps the row's keys and values) or "ring" (passed around the CP group, overlapped with the
    # attention; keeps only the rank's own; ModernBERT without attention dropout)
    context_attention: str = "allgather"
    # data parallel size is derived: world_size // (tensor_parallel * pipeline_parallel * context_parallel)

    @property
    def model_parallel(self) -> int:
        """Ranks per data-parallel replica of the work: tensor x pipeline x context."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.tensor_parallel < 1:
            p.append(f"parallel.tensor_parallel ({self.tensor_parallel}) must be >= 1")
        if self.pipeline_parallel < 1:
            p.append(f"parallel.pipeline_parallel ({self.pipeline_parallel}) must be >= 1")
        if self.context_parallel < 1:
            p.append(f"parallel.context_parallel ({self.context_parallel}) must be >= 1")
        if self.context_attention not in CONTEXT_ATTENTION:
            p.append(f"parallel.context_attention ({self.context_attention!r}) must be one of "
                     f"{', '.join(CONTEXT_ATTENTION)}")
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"parallel.zero_stage ({self.zero_stage}) must be one of 0, 1, 2, 3")
        # DeepSpeed's pipeline engine does not support gradient/parameter partitioning.
        if self.zero_stage in (2, 3) and self.pipeline_parallel > 1:
            p.append(f"parallel.zero_stage {self.zero_stage} cannot be combined with pipeline "
                     f"parallelism (pipeline_parallel={self.pipeline_parallel}); use zero_stage 0 or 1")
        return p
