"""The layouts a planner weighs: tensor x pipeline x data parallelism, ZeRO stage, micro-batch,
recomputation and precision, each checked by the trainer's own config validation.

A layout is a set of config overrides on the user's config; whatever the trainer would refuse
(heads or layers that do not divide, ZeRO-2/3 with a pipeline, bf16 at ZeRO-0 with fp32
gradient accumulation, a global batch that does not divide) is left out with the trainer's own
reason, so the plan never proposes a run that cannot start.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from ..config import Config, ConfigError
from ..config.choices import PRECISIONS, RECOMPUTE

# micro-batches above this are not enumerated (the config's own is always included)
MAX_MICRO_BATCH = 128


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int
    recompute: str
    precision: str
    cp: int = 1  # context parallelism: the config's own (not enumerated)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def overrides(self) -> list[str]:
        """The config overrides that select this layout (as `python -m pretrain` takes them)."""
        return [f"parallel.tensor_parallel={self.tp}", f"parallel.pipeline_parallel={self.pp}",
                f"parallel.zero_stage={self.zero}", f"train.micro_batch_size={self.micro_batch}",
                f"model.recompute={self.recompute}", f"train.precision={self.precision}"] + \
            ([f"parallel.context_parallel={self.cp}"] if self.cp > 1 else [])

    def apply(self, cfg: Config) -> Config:
        """A copy of `cfg` with this layout's settings. The three sections it sets are copied, the
        others shared (a plan tries thousands of layouts; a deep copy each took most of its time)."""
        out = copy.copy(cfg)
        out.parallel, out.train, out.model = copy.copy(cfg.parallel), copy.copy(cfg.train), copy.copy(cfg.model)
        out.parallel.tensor_parallel, out.parallel.pipeline_parallel = self.tp, self.pp
        out.parallel.zero_stage, out.parallel.context_parallel = self.zero, self.cp
        out.train.micro_batch_size = self.micro_batch
        out.model.recompute = self.recompute
        out.train.precision = self.precision
        return out

    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp}" + (f" CP{self.cp}" if self.cp > 1 else "")


def layout_of(cfg: Config, world_size: int) -> Layout:
    """The layout a config runs at on `world_size` ranks."""
    par, t = cfg.parallel, cfg.train
    return Layout(par.tensor_parallel, par.pipeline_parallel, world_size // par.model_parallel,
                  par.zero_stage, t.micro_batch_size, cfg.model.recompute, t.precision, par.context_parallel)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes_only(cfg: Config) -> Config:
    """`cfg` with synthetic data: a plan needs the model's and the batch's shapes, not the corpus
    (its paths need not exist where the plan is made)."""
    out = copy.deepcopy(cfg)
    out.data.kind, out.data.paths, out.data.weights = "synthetic", [], []
    out.data.valid_paths, out.data.test_paths = [], []
    return out


def candidate_layouts(cfg: Config, gpus: int, gpus_per_node: int, precisions: Iterable[str] = PRECISIONS,
                      recompute: Iterable[str] = RECOMPUTE, zero_stages: Iterable[int] = (0, 1, 2, 3),
                      micro_batches: Iterable[int] | None = None) -> tuple[list[Layout], Counter]:
    """Every layout of `gpus` ranks the trainer accepts for `cfg`, and a count of the refused
    ones by the trainer's reason. Tensor parallelism stays inside a node (its all-reduces run in
    every layer); micro-batches are the powers of two dividing each rank's share of the global
    batch (up to MAX_MICRO_BATCH) and the config's own, unless `micro_batches` lists them. Context
    parallelism stays the config's (parallel.context_parallel)."""
    cfg = shapes_only(cfg)
    cp = cfg.parallel.context_parallel
    valid, refused = [], Counter()
    for tp in divisors(min(gpus, gpus_per_node)):
        if gpus_per_node % tp:
            continue
        for pp in divisors(gpus // tp):
            if (gpus // (tp * pp)) % cp:
                continue
            dp = gpus // (tp * pp * cp)
            share = cfg.train.global_batch_size // dp if cfg.train.global_batch_size % dp == 0 else 0
            sizes = sorted(set(micro_batches) if micro_batches is not None else
                           {m for m in (2 ** i for i in range(8)) if m <= MAX_MICRO_BATCH} | {cfg.train.micro_batch_size})
            for micro in sizes:
                if micro_batches is None and share and share % micro:
                    continue  # not a divisor: not enumerated (a given list is checked below)
                for zero in zero_stages:
                    for precision in precisions:
                        for mode in recompute:
                            layout = Layout(tp, pp, dp, zero, micro, mode, precision, cp)
                            try:
                                layout.apply(cfg).validate(world_size=gpus)
                            except ConfigError as error:
                                for problem in error.problems:
                                    refused[problem] += 1
                                continue
                            valid.append(layout)
    return valid, refused
