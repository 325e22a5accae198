"""The pretraining config as the composition of its sections: `Config` (one field per section, the
rules that tie sections together in `validate`, the sizes derived from several), SECTIONS, the moved
keys of every section, and `load_config`. Each section's dataclass, with the rules about its own fields
(`problems()`) and the keys that moved into it, lives in the module of the part it configures:
model.py, parallel.py, optimizer.py, scheduler.py, data.py, train.py (with fp16), checkpoint.py,
reporting.py (eval and logging), resilience.py.

    cfg = load_config(args.config, args.overrides)   # key and type checks (typed_yaml.py)
    cfg.validate(world_size)                          # every rule, all problems in one error
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .checkpoint import MOVED_KEYS as CHECKPOINT_MOVED_KEYS, CheckpointConfig
from .choices import PRECISIONS
from .data import DataConfig
from .model import ModelConfig
from .optimizer import OptimizerConfig
from .parallel import ParallelConfig
from .precision import precision_problems
from .reporting import MOVED_KEYS as REPORTING_MOVED_KEYS, EvalConfig, LoggingConfig
from .resilience import MOVED_KEYS as RESILIENCE_MOVED_KEYS, ResilienceConfig
from .scheduler import SchedulerConfig
from .train import Fp16Config, TrainConfig
from .typed_yaml import ConfigError, check_tree, load_sections


# Section name -> dataclass, in the order sections are listed and validated.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
    "resilience": ResilienceConfig,
    "fp16": Fp16Config,
}

# Keys that lived in `train` until the sections mirrored the trainer's parts, by their new section
MOVED_KEYS: dict[str, str] = {**CHECKPOINT_MOVED_KEYS, **REPORTING_MOVED_KEYS, **RESILIENCE_MOVED_KEYS}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    fp16: Fp16Config = field(default_factory=Fp16Config)

    # -- derived sizes ----------------------------------------------------------------------

    @property
    def binary_head(self) -> bool:
        """Whether the model has the pooler and the next-sentence (or sentence-order) classifier:
        not with data.segment_pairs none, whose samples are single segments."""
        return self.data.segment_pairs != "none"

    @property
    def real_tokens_only(self) -> bool:
        """Whether the model computes each micro-batch's real tokens only (padding never reaches a
        layer): ModernBERT always, BERT outside context parallelism (whose column split is of rows)."""
        return self.model.modern or self.parallel.context_parallel == 1

    @property
    def shapes_vary(self) -> bool:
        """Whether the activations' shapes change between micro-batches: packed rows (as many as
        the samples fill) and a model computing real tokens only (as many as there are)."""
        return self.data.packing or self.real_tokens_only

    def data_parallel_size(self, world_size: int) -> int:
        problem = _world_size_problem(self, world_size)
        if problem:
            raise ConfigError(problem)
        return world_size // self.parallel.model_parallel

    def grad_accum_steps(self, world_size: int) -> int:
        dp = self.data_parallel_size(world_size)
        problem = _batch_problem(self, dp)
        if problem:
            raise ConfigError(problem)
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    # -- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON serialisable), e.g. to store in a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> "Config":
        """Build from a nested dict with the same key and type checks as a YAML file.
        Missing sections/fields take their defaults. Does not run validate()."""
        clean, problems = check_tree(d, source, SECTIONS, MOVED_KEYS)
        if problems:
            raise ConfigError(problems)
        return _build(clean)

    @classmethod
    def from_stored(cls, d: dict, source: str = "dict") -> "Config":
        """from_dict for a config a checkpoint stored: one saved before the keys moved out of
        `train` (MOVED_KEYS) has them moved to their sections first."""
        d = {section: dict(entries) if isinstance(entries, dict) else entries for section, entries in d.items()}
        for old, new in MOVED_KEYS.items():
            old_section, old_key = old.split(".")
            if isinstance(d.get(old_section), dict) and old_key in d[old_section]:
                new_section, new_key = new.split(".")
                d.setdefault(new_section, {})[new_key] = d[old_section].pop(old_key)
        return cls.from_dict(d, source)

    def _schedule_length_problems(self) -> list[str]:
        """The schedule's lengths against each other and the run: warmup within the run, the decay's
        start within [warmup, horizon), in the schedule's unit (token lengths with a fixed batch:
        samples x data.seq_length per step)."""
        from .token_clock import TokenClock

        s, t = self.scheduler, self.train
        unit = "tokens" if s.in_tokens else "steps"
        clock = TokenClock.of(self)
        lengths = s.lengths(t.train_steps, clock.tokens_before if s.in_tokens else int)
        warmup, horizon, start = lengths["warmup_steps"], lengths["decay_steps"], lengths["decay_start"]
        run = clock.tokens_before(t.train_steps) if s.in_tokens else t.train_steps
        horizon_name = (f"scheduler.decay_{unit}" if getattr(s, f"decay_{unit}") is not None
                        else "train.train_steps" if unit == "steps" else "the tokens of train.train_steps")
        warmup_name = (f"scheduler.warmup_{unit}" if s.warmup_fraction is None
                       else f"scheduler.warmup_fraction x {horizon_name}")
        p = []
        if warmup > run:
            run_name = f"the tokens of train.train_steps ({run})" if s.in_tokens else f"train.train_steps ({run})"
            p.append(f"{warmup_name} ({warmup}) must be <= {run_name}")
        elif start is not None and start < warmup:
            p.append(f"scheduler.decay_start_{unit} ({start}) must be >= {warmup_name} ({warmup})")
        elif s.decay != "constant" and horizon <= (warmup if start is None else start):
            first = warmup_name if start is None else f"scheduler.decay_start_{unit}"
            p.append(f"{horizon_name} ({horizon}) must exceed {first} ({warmup if start is None else start}) for "
                     f"scheduler.decay {s.decay}")
        return p

    # -- rules ------------------------------------------------------------------------------

    def validate(self, world_size: int | None = None) -> None:
        """Check every rule; raise one ConfigError listing all violations, one per line.
        Pass world_size once it is known to also check the parallel/batch arithmetic."""
        m, par, o, s, d, t = self.model, self.parallel, self.optimizer, self.scheduler, self.data, self.train
        p = m.problems() + par.problems() + self._model_split_problems()
        p += o.problems() + s.problems()
        clock_readable = t.global_batch_size > 0 and d.seq_length > 0 and (
            not t.batch_warmup_tokens or 0 < (t.batch_warmup_min_size or 0) < t.global_batch_size)
        if not s.problems() and clock_readable and t.train_steps > 0:
            p += self._schedule_length_problems()
        if s.min_lr > o.lr:
            p.append(f"scheduler.min_lr ({s.min_lr}) must be <= optimizer.lr ({o.lr})")
        p += d.problems()
        if m.modern and d.segment_pairs != "none":
            p.append(f"model.architecture modernbert has no next-sentence head: set data.segment_pairs none "
                     f"(not {d.segment_pairs})")
        if par.context_attention == "ring" and (not m.modern or m.attention_dropout > 0):
            p.append("parallel.context_attention ring is ModernBERT's global attention without dropout: "
                     f"set model.architecture modernbert and model.attention_dropout 0 (not {m.architecture}, "
                     f"{m.attention_dropout:g}), or context_attention allgather")
        if d.seq_length > m.max_position_embeddings:
            p.append(f"data.seq_length ({d.seq_length}) must be <= "
                     f"model.max_position_embeddings ({m.max_position_embeddings})")
        p += t.problems() + self.checkpoint.problems() + self.eval.problems() + self.logging.problems()
        p += self.resilience.problems() + self._batch_problems(world_size)
        r = self.resilience
        if r.spike_policy == "rollback" and not (self.checkpoint.save_dir and self.checkpoint.save_interval):
            p.append("resilience.spike_policy=rollback reloads the run's latest checkpoint: set checkpoint.save_dir and "
                     "checkpoint.save_interval")
        gbs = self.train.global_batch_size
        for first, count in (e for e in self.data.skip_samples if isinstance(e, list) and len(e) == 2):
            if gbs > 0 and (first % gbs or count % gbs):
                p.append(f"data.skip_samples [{first}, {count}]: whole global batches, multiples of "
                         f"train.global_batch_size ({gbs})")
        if r.exit_duration_minutes and not self.checkpoint.save_dir:
            p.append(f"resilience.exit_duration_minutes ({r.exit_duration_minutes:g}) needs checkpoint.save_dir: the "
                     "job saves a checkpoint before it exits, for the relaunch to resume")
        if t.precision in PRECISIONS and par.zero_stage in (0, 1, 2, 3):
            p += precision_problems(t.precision, t.grad_accum_dtype, par.zero_stage, par.pipeline_parallel)
        p += self.fp16.problems()
        if p:
            raise ConfigError(p)

    def _model_split_problems(self) -> list[str]:
        """How the model's shapes divide over tensor and pipeline parallelism."""
        m, par, p = self.model, self.parallel, []
        tp, pp = par.tensor_parallel, par.pipeline_parallel
        if tp >= 1 and m.num_attention_heads > 0 and m.num_attention_heads % tp:
            p.append(f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                     f"parallel.tensor_parallel ({tp})")
        if tp >= 1 and m.ffn_size > 0 and m.ffn_size % tp:
            p.append(f"model ffn size ({m.ffn_size}, from model.ffn_hidden_size or 4 x hidden_size) "
                     f"must be divisible by parallel.tensor_parallel ({tp})")
        if pp >= 1 and m.num_layers > 0 and m.num_layers % pp:
            p.append(f"model.num_layers ({m.num_layers}) must be divisible by "
                     f"parallel.pipeline_parallel ({pp})")
        return p

    def _batch_problems(self, world_size: int | None) -> list[str]:
        """G = micro x accumulation x data parallel (data parallel known with the world size)."""
        t, par = self.train, self.parallel
        if t.global_batch_size <= 0 or t.micro_batch_size <= 0 or min(par.tensor_parallel, par.pipeline_parallel,
                                                                         par.context_parallel) < 1:
            return []  # reported by the sections
        if world_size is None:
            if t.global_batch_size % t.micro_batch_size:
                return [f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                        f"train.micro_batch_size ({t.micro_batch_size})"]
            return []
        problem = _world_size_problem(self, world_size)
        if problem:
            return [problem]
        dp = world_size // par.model_parallel
        problems = [_batch_problem(self, dp)]
        if t.batch_warmup_min_size and t.batch_warmup_min_size % (t.micro_batch_size * dp):
            problems.append(f"train.batch_warmup_min_size ({t.batch_warmup_min_size}) must be a multiple of "
                            f"train.micro_batch_size x data parallel ({t.micro_batch_size} x {dp}): every batch of "
                            f"the warmup is whole micro-batches on every rank")
        return [problem for problem in problems if problem]


def _world_size_problem(cfg: Config, world_size: int) -> str | None:
    par = cfg.parallel
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    if world_size < 1 or tp < 1 or pp < 1 or cp < 1 or world_size % (tp * pp * cp):
        if cp == 1:
            return (f"world size ({world_size}) must be a positive multiple of parallel.tensor_parallel x "
                    f"parallel.pipeline_parallel ({tp} x {pp} = {tp * pp})")
        return (f"world size ({world_size}) must be a positive multiple of parallel.tensor_parallel x "
                f"parallel.pipeline_parallel x parallel.context_parallel ({tp} x {pp} x {cp} = {tp * pp * cp})")
    return None


def _batch_problem(cfg: Config, data_parallel: int) -> str | None:
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if m < 1 or g < 1 or g % (m * data_parallel):
        return (f"train.global_batch_size ({g}) must equal train.micro_batch_size ({m}) x gradient "
                f"accumulation x data_parallel ({data_parallel}), i.e. be a positive multiple of "
                f"{m * data_parallel}")
    return None


def _build(clean: dict[str, dict[str, Any]]) -> Config:
    return Config(**{name: cls(**clean.get(name, {})) for name, cls in SECTIONS.items()})


def load_config(path: str | None, overrides: Sequence[str] = (),
                inherit: Callable[[dict], dict] | None = None) -> Config:
    """Load a YAML config (with its `base:` files) and apply `section.field=value` overrides.

    Checks keys and types and reports every problem in one ConfigError. Rule checks are
    separate: call cfg.validate(world_size) once the world size is known.
    `base:` paths are relative to the file naming them; this file's values win over its bases.
    Override values are parsed as YAML (`checkpoint.save_dir=null`, `optimizer.no_weight_decay=[bias]`).
    `inherit` takes the {section: {key: value}} tree and returns it with the keys it leaves unset
    taken from elsewhere: a run's keys from its starting point are the layer above's business
    (pretrain/checkpoint/starting_point.py's load_run_config passes inherit_model_keys).
    """
    try:
        tree = load_sections(path, overrides, SECTIONS, MOVED_KEYS)
    except ConfigError as error:
        if error.checked_tree is not None:  # the rest of the file, for the rule checks (rule_problems)
            try:
                error.partial = _build(inherit(error.checked_tree) if inherit is not None else error.checked_tree)
            except (TypeError, ValueError):
                pass
        raise
    return _build(inherit(tree) if inherit is not None else tree)


def rule_problems(error: ConfigError, world_size: int | None) -> list[str]:
    """The rules broken by the keys of a config that load_config refused for others (an unknown key,
    a wrong type): the rest of the file checked too, so that one report names every problem."""
    if error.partial is None:
        return []
    try:
        error.partial.validate(world_size=world_size)
    except ConfigError as more:
        # a rule about a key that was refused would judge its default, not the value given
        refused = set(re.findall(r"\b[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*\b", " ".join(error.problems)))
        return [p for p in more.problems if p not in error.problems and not any(key in p for key in refused)]
    return []
