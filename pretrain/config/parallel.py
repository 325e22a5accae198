"""The parallel section: tensor and pipeline parallelism, ZeRO, with the rules about its own fields."""
from __future__ import annotations

from dataclasses import dataclass



@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0  # DeepSpeed ZeRO stage, 0..3
    # data parallel size is derived: world_size // (tensor_parallel * pipeline_parallel)

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.tensor_parallel < 1:
            p.append(f"parallel.tensor_parallel ({self.tensor_parallel}) must be >= 1")
        if self.pipeline_parallel < 1:
            p.append(f"parallel.pipeline_parallel ({self.pipeline_parallel}) must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            p.append(f"parallel.zero_stage ({self.zero_stage}) must be one of 0, 1, 2, 3")
        # DeepSpeed's pipeline engine does not support gradient/parameter partitioning.
        if self.zero_stage in (2, 3) and self.pipeline_parallel > 1:
            p.append(f"parallel.zero_stage {self.zero_stage} cannot be combined with pipeline "
                     f"parallelism (pipeline_parallel={self.pipeline_parallel}); use zero_stage 0 or 1")
        return p
