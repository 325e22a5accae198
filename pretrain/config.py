"""Typed configuration: dataclass sections loaded from YAML, dotted command-line overrides,
up-front validation with one line per problem, and the DeepSpeed JSON derived from it.

Usage (the trainer):

    cfg = load_config(args.config, args.overrides)   # key and type checks
    cfg.validate(world_size)                          # every rule, all problems in one error
    ds_config = build_deepspeed_config(cfg, world_size)

Our config is the single source of truth for batch sizes, precision, ZeRO stage, gradient
clipping, optimizer and LR schedule. A user DeepSpeed JSON (train.deepspeed_config) may add
DeepSpeed-only options; a value in it that contradicts ours is an error, never an override.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

import yaml

__all__ = [
    "PARAMETER_KINDS",
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "DataConfig",
    "TrainConfig",
    "Config",
    "load_config",
    "build_deepspeed_config",
    "deepspeed_settings",
]

# The kinds the model labels its parameters with; optimizer.no_weight_decay and
# optimizer.no_layer_adaptation entries must be among them.
PARAMETER_KINDS = ("weight", "bias", "layernorm", "embedding")

OPTIMIZERS = ("lamb", "adamw")
DECAYS = ("linear", "poly", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")
DATA_KINDS = ("synthetic", "indexed")
SEGMENT_PAIRS = ("nsp", "sop", "none")
MASKING_MODES = ("static", "dynamic")


class ConfigError(ValueError):
    """All configuration problems found, one per line (``.problems`` holds the list)."""

    def __init__(self, problems: str | Sequence[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    vocab_size: int = 30522  # tokenizer vocabulary (before padding)
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12
    ffn_hidden_size: int | None = None  # None -> 4 * hidden_size (see ffn_size)
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # token-type (segment) embeddings
    layernorm_epsilon: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02  # std of the normal weight initialisation
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this * tensor_parallel
    activation_checkpointing: bool = False  # recompute layer activations in backward

    @property
    def ffn_size(self) -> int:
        """The resolved feed-forward width."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """vocab_size rounded up so every tensor-parallel shard is a multiple of
        make_vocab_size_divisible_by (efficient GEMMs, equal shards)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    zero_stage: int = 0  # DeepSpeed ZeRO stage, 0..3
    # data parallel size is derived: world_size // (tensor_parallel * pipeline_parallel)


@dataclass
class OptimizerConfig:
    name: str = "lamb"  # "lamb" | "adamw"
    lr: float = 1e-3  # peak learning rate (reached at the end of warmup)
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    # parameter kinds (PARAMETER_KINDS) excluded from weight decay
    no_weight_decay: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    # parameter kinds whose LAMB trust ratio is fixed to 1
    no_layer_adaptation: list[str] = field(default_factory=lambda: ["bias", "layernorm"])
    max_trust_ratio: float | None = None  # optional clamp of the LAMB trust ratio
    grad_clip: float = 1.0  # global gradient-norm clipping; 0 disables


@dataclass
class SchedulerConfig:
    warmup_steps: int = 0  # linear warmup from 0
    decay: str = "linear"  # "linear" | "poly" | "constant"; from warmup end to train.train_steps
    power: float = 0.5  # exponent of "poly" decay
    min_lr: float = 0.0  # floor of the decayed learning rate


@dataclass
class DataConfig:
    kind: str = "synthetic"  # "synthetic" (no files; tests, demos) | "indexed" (preprocessed .bin/.idx)
    seq_length: int = 128
    max_predictions_per_seq: int = 20  # masked positions per sequence (padded to this)
    masked_lm_prob: float = 0.15
    num_samples: int = 100000  # synthetic dataset size
    seed: int = 1234  # data generation / shuffling / masking seed
    # indexed data (kind: indexed)
    paths: list[str] = field(default_factory=list)  # dataset prefixes: <prefix>.bin/.idx from tools/preprocess_data.py
    weights: list[float] = field(default_factory=list)  # blending weights, one per path; empty = equal
    vocab_file: str | None = None  # vocab.txt or tokenizer.json the data was preprocessed with
    split: str = "949,50,1"  # train,valid,test shares of each corpus's documents (Megatron's rule)
    segment_pairs: str = "nsp"  # "nsp" (BERT) | "sop" (ALBERT/Megatron sentence order) | "none" (one segment)
    short_seq_prob: float = 0.1  # share of samples cut to a random shorter target length
    whole_word_masking: bool = True  # mask a word's '##' pieces together
    max_ngram: int = 1  # 1 = BERT; n > 1 masks spans of up to n words, length drawn with p ~ 1/length
    masking: str = "static"  # "static" (a sample's masks fixed) | "dynamic" (redrawn every epoch)
    index_cache_dir: str | None = None  # where sample indices are cached; default <data dir>/index-cache
    num_workers: int = 2  # loader processes per rank preparing batches ahead of the trainer (0 = inline)


@dataclass
class TrainConfig:
    global_batch_size: int = 256  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # samples per forward/backward on one rank
    train_steps: int = 1000  # optimizer steps
    seed: int = 42  # model init / dropout seed
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    log_interval: int = 10  # steps between log lines
    eval_interval: int = 0  # 0 = never
    eval_steps: int = 10  # batches per evaluation
    save_dir: str | None = None
    save_interval: int = 0  # 0 = only at end / on SIGTERM
    keep_last: int = 3  # checkpoints kept; 0 = keep all
    load_dir: str | None = None  # resume from the latest checkpoint here
    # start from another run's latest checkpoint (e.g. phase 2 from phase 1): its weights (and, with
    # init_optimizer_states, its optimizer moments), but step 0, new data position and LR schedule;
    # a checkpoint in load_dir takes precedence, so a restarted phase-2 run resumes itself
    init_from: str | None = None
    init_optimizer_states: bool = False
    tensorboard_dir: str | None = None
    deepspeed_config: str | None = None  # path to a user DeepSpeed JSON adding DeepSpeed-only options
    dist_timeout_minutes: float = 10.0  # collective timeout: a dead/hung rank makes the others exit
    exit_after_steps: int = 0  # stop (saving a checkpoint) after this many steps of this run; 0 = run to train_steps
    tf32: bool = True  # TF32 tensor cores for fp32 matrix products on GPUs (Ampere and later); no effect on CPU
    # steps between the ranks' agreement on a SIGTERM (one collective and host sync each time);
    # keep interval x step time well inside the scheduler's grace period (SLURM: KillWait, 30 s)
    stop_check_interval: int = 5


# Section name -> dataclass, in the order sections are listed and validated.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "data": DataConfig,
    "train": TrainConfig,
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # -- derived sizes ----------------------------------------------------------------------

    def data_parallel_size(self, world_size: int) -> int:
        problem = _world_size_problem(self, world_size)
        if problem:
            raise ConfigError(problem)
        return world_size // (self.parallel.tensor_parallel * self.parallel.pipeline_parallel)

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
        clean, problems = _check_tree(d, source)
        if problems:
            raise ConfigError(problems)
        return _build(clean)

    # -- rules ------------------------------------------------------------------------------

    def validate(self, world_size: int | None = None) -> None:
        """Check every rule; raise one ConfigError listing all violations, one per line.
        Pass world_size once it is known to also check the parallel/batch arithmetic."""
        p: list[str] = []
        m, par, o, s, d, t = self.model, self.parallel, self.optimizer, self.scheduler, self.data, self.train

        # model
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings", "type_vocab_size", "make_vocab_size_divisible_by",
                     "layernorm_epsilon", "init_std"):
            _positive(p, f"model.{name}", getattr(m, name))
        if m.ffn_hidden_size is not None:
            _positive(p, "model.ffn_hidden_size", m.ffn_hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(m, name)
            if not 0.0 <= value < 1.0:
                p.append(f"model.{name} ({value}) must be in [0, 1)")
        if m.hidden_size > 0 and m.num_attention_heads > 0 and m.hidden_size % m.num_attention_heads:
            p.append(f"model.hidden_size ({m.hidden_size}) must be divisible by "
                     f"model.num_attention_heads ({m.num_attention_heads})")

        # parallel (and how the model splits over it)
        tp_ok = par.tensor_parallel >= 1
        pp_ok = par.pipeline_parallel >= 1
        if not tp_ok:
            p.append(f"parallel.tensor_parallel ({par.tensor_parallel}) must be >= 1")
        if not pp_ok:
            p.append(f"parallel.pipeline_parallel ({par.pipeline_parallel}) must be >= 1")
        if par.zero_stage not in (0, 1, 2, 3):
            p.append(f"parallel.zero_stage ({par.zero_stage}) must be one of 0, 1, 2, 3")
        if tp_ok and m.num_attention_heads > 0 and m.num_attention_heads % par.tensor_parallel:
            p.append(f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                     f"parallel.tensor_parallel ({par.tensor_parallel})")
        if tp_ok and m.ffn_size > 0 and m.ffn_size % par.tensor_parallel:
            p.append(f"model ffn size ({m.ffn_size}, from model.ffn_hidden_size or 4 x hidden_size) "
                     f"must be divisible by parallel.tensor_parallel ({par.tensor_parallel})")
        if pp_ok and m.num_layers > 0 and m.num_layers % par.pipeline_parallel:
            p.append(f"model.num_layers ({m.num_layers}) must be divisible by "
                     f"parallel.pipeline_parallel ({par.pipeline_parallel})")
        # DeepSpeed's pipeline engine does not support gradient/parameter partitioning.
        if par.zero_stage in (2, 3) and par.pipeline_parallel > 1:
            p.append(f"parallel.zero_stage {par.zero_stage} cannot be combined with pipeline "
                     f"parallelism (pipeline_parallel={par.pipeline_parallel}); use zero_stage 0 or 1")

        # optimizer
        _one_of(p, "optimizer.name", o.name, OPTIMIZERS)
        _positive(p, "optimizer.lr", o.lr)
        for name in ("beta1", "beta2"):
            value = getattr(o, name)
            if not 0.0 <= value < 1.0:
                p.append(f"optimizer.{name} ({value}) must be in [0, 1)")
        _positive(p, "optimizer.eps", o.eps)
        _non_negative(p, "optimizer.weight_decay", o.weight_decay)
        _non_negative(p, "optimizer.grad_clip", o.grad_clip)
        if o.max_trust_ratio is not None:
            _positive(p, "optimizer.max_trust_ratio", o.max_trust_ratio)
        for name in ("no_weight_decay", "no_layer_adaptation"):
            for kind in getattr(o, name):
                if kind not in PARAMETER_KINDS:
                    p.append(f"optimizer.{name} entry {kind!r} is not a parameter kind; "
                             f"valid kinds: {', '.join(PARAMETER_KINDS)}")

        # scheduler
        _one_of(p, "scheduler.decay", s.decay, DECAYS)
        _non_negative(p, "scheduler.warmup_steps", s.warmup_steps)
        if s.warmup_steps > t.train_steps:
            p.append(f"scheduler.warmup_steps ({s.warmup_steps}) must be <= train.train_steps ({t.train_steps})")
        _positive(p, "scheduler.power", s.power)
        _non_negative(p, "scheduler.min_lr", s.min_lr)
        if s.min_lr > o.lr:
            p.append(f"scheduler.min_lr ({s.min_lr}) must be <= optimizer.lr ({o.lr})")

        # data
        _one_of(p, "data.kind", d.kind, DATA_KINDS)
        _positive(p, "data.seq_length", d.seq_length)
        if d.seq_length > m.max_position_embeddings:
            p.append(f"data.seq_length ({d.seq_length}) must be <= "
                     f"model.max_position_embeddings ({m.max_position_embeddings})")
        _positive(p, "data.max_predictions_per_seq", d.max_predictions_per_seq)
        if d.max_predictions_per_seq > d.seq_length:
            p.append(f"data.max_predictions_per_seq ({d.max_predictions_per_seq}) must be <= "
                     f"data.seq_length ({d.seq_length})")
        if not 0.0 < d.masked_lm_prob <= 1.0:
            p.append(f"data.masked_lm_prob ({d.masked_lm_prob}) must be in (0, 1]")
        _positive(p, "data.num_samples", d.num_samples)
        _non_negative(p, "data.seed", d.seed)  # numpy seeds must be >= 0
        _one_of(p, "data.segment_pairs", d.segment_pairs, SEGMENT_PAIRS)
        _one_of(p, "data.masking", d.masking, MASKING_MODES)
        if not 0.0 <= d.short_seq_prob <= 1.0:
            p.append(f"data.short_seq_prob ({d.short_seq_prob}) must be in [0, 1]")
        _positive(p, "data.max_ngram", d.max_ngram)
        _non_negative(p, "data.num_workers", d.num_workers)
        if d.kind == "indexed":
            if not d.paths:
                p.append("data.paths must list at least one dataset prefix when data.kind is indexed")
            if not d.vocab_file:
                p.append("data.vocab_file is required when data.kind is indexed")
            if d.weights and len(d.weights) != len(d.paths):
                p.append(f"data.weights has {len(d.weights)} entries for {len(d.paths)} data.paths")
            if any(not w > 0 for w in d.weights):
                p.append(f"data.weights ({d.weights}) must all be > 0")
            split = d.split.split(",")
            try:
                shares = [float(x) for x in split]
            except ValueError:
                shares = []
            if not 1 <= len(shares) <= 3 or min(shares) < 0 or sum(shares) <= 0:
                p.append(f"data.split ({d.split!r}) must be up to three comma-separated non-negative shares "
                         "with a positive sum, e.g. '949,50,1'")
            if d.segment_pairs != "none" and d.seq_length < 4:
                p.append(f"data.seq_length ({d.seq_length}) must be >= 4 for segment pairs")

        # train
        for name in ("global_batch_size", "micro_batch_size", "train_steps", "log_interval",
                     "eval_steps", "dist_timeout_minutes", "stop_check_interval"):
            _positive(p, f"train.{name}", getattr(t, name))
        for name in ("seed", "eval_interval", "save_interval", "keep_last", "exit_after_steps"):
            _non_negative(p, f"train.{name}", getattr(t, name))
        _one_of(p, "train.precision", t.precision, PRECISIONS)

        # batch arithmetic: G = micro x accumulation x data parallel
        if t.global_batch_size > 0 and t.micro_batch_size > 0 and tp_ok and pp_ok:
            if world_size is None:
                if t.global_batch_size % t.micro_batch_size:
                    p.append(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                             f"train.micro_batch_size ({t.micro_batch_size})")
            else:
                problem = _world_size_problem(self, world_size)
                if problem:
                    p.append(problem)
                else:
                    dp = world_size // (par.tensor_parallel * par.pipeline_parallel)
                    problem = _batch_problem(self, dp)
                    if problem:
                        p.append(problem)

        if p:
            raise ConfigError(p)


def _positive(problems: list[str], name: str, value: float) -> None:
    if not value > 0:
        problems.append(f"{name} ({value}) must be > 0")


def _non_negative(problems: list[str], name: str, value: float) -> None:
    if not value >= 0:
        problems.append(f"{name} ({value}) must be >= 0")


def _one_of(problems: list[str], name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        problems.append(f"{name} ({value!r}) must be one of: {', '.join(allowed)}")


def _world_size_problem(cfg: Config, world_size: int) -> str | None:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size < 1 or tp < 1 or pp < 1 or world_size % (tp * pp):
        return (f"world size ({world_size}) must be a positive multiple of parallel.tensor_parallel x "
                f"parallel.pipeline_parallel ({tp} x {pp} = {tp * pp})")
    return None


def _batch_problem(cfg: Config, data_parallel: int) -> str | None:
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if m < 1 or g < 1 or g % (m * data_parallel):
        return (f"train.global_batch_size ({g}) must equal train.micro_batch_size ({m}) x gradient "
                f"accumulation x data_parallel ({data_parallel}), i.e. be a positive multiple of "
                f"{m * data_parallel}")
    return None


# --------------------------------------------------------------------------------------------
# Key and type checking
# --------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float: PyYAML follows YAML 1.1, where a float
    needs a dot (`1.0e-3`), so `optimizer.lr=1e-3` would otherwise be the string '1e-3'."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _field_types(sections: dict[str, type]) -> dict[str, dict[str, Any]]:
    return {name: typing.get_type_hints(cls) for name, cls in sections.items()}


class _WrongType(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """value checked against type annotation tp (int is accepted for float; bool is not int)."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _coerce(value, inner)
    if origin is list:
        if not isinstance(value, list):
            raise _WrongType
        (item,) = typing.get_args(tp)
        return [_coerce(v, item) for v in value]
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise _WrongType


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else tp.__name__


def _value_desc(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _check_tree(d: Any, source: str, sections: dict[str, type] = SECTIONS) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check a {section: {field: value}} tree: unknown sections/keys and value types.
    Returns the known, type-converted entries and the problems (one line each)."""
    field_types = _field_types(sections)
    if not isinstance(d, dict):
        return {}, [f"{source}: expected a mapping of sections, got {_value_desc(d)}"]
    clean: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for section, entries in d.items():
        if section not in sections:
            problems.append(f"{source}: unknown section {section!r}; valid sections: {', '.join(sections)}")
            continue
        if entries is None:  # a section with every line commented out
            entries = {}
        if not isinstance(entries, dict):
            problems.append(f"{source}: section {section!r} must be a mapping, got {_value_desc(entries)}")
            continue
        fields = field_types[section]
        clean[section] = {}
        for key, value in entries.items():
            if key not in fields:
                problems.append(f"{source}: unknown key '{section}.{key}'; valid keys in {section!r}: "
                                f"{', '.join(fields)}")
                continue
            try:
                clean[section][key] = _coerce(value, fields[key])
            except _WrongType:
                problems.append(f"{source}: {section}.{key} must be {_type_name(fields[key])}, "
                                f"got {_value_desc(value)}")
    return clean, problems


def _build(clean: dict[str, dict[str, Any]]) -> Config:
    return Config(**{name: cls(**clean.get(name, {})) for name, cls in SECTIONS.items()})


def _deep_merge(base: dict, top: dict) -> dict:
    """top merged over base: nested dicts merge, anything else (including lists) replaces."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = _yaml_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {_value_desc(data)}")
    return data


def _load_tree(path: str, stack: tuple[str, ...], problems: list[str], sections: dict[str, type]) -> dict:
    """The file's checked contents merged over its (recursively loaded) bases."""
    real = os.path.realpath(path)
    if real in stack:
        raise ConfigError(f"{path}: 'base' inheritance cycle")
    data = _read_yaml(path)
    bases = data.pop("base", None)
    if bases is None:
        bases = []
    elif isinstance(bases, str):
        bases = [bases]
    elif not (isinstance(bases, list) and all(isinstance(b, str) for b in bases)):
        raise ConfigError(f"{path}: 'base' must be a path or a list of paths, got {_value_desc(bases)}")
    merged: dict = {}
    for base in bases:  # later bases win over earlier ones
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
        merged = _deep_merge(merged, _load_tree(base_path, stack + (real,), problems, sections))
    clean, file_problems = _check_tree(data, path, sections)
    problems.extend(file_problems)
    return _deep_merge(merged, clean)


def _parse_overrides(overrides: Sequence[str], problems: list[str], sections: dict[str, type]) -> dict:
    source = "command line"
    tree: dict[str, dict[str, Any]] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or len(parts) != 2 or not all(parts):
            problems.append(f"{source}: malformed override {item!r}; expected section.field=value")
            continue
        try:
            value = _yaml_load(text)
        except yaml.YAMLError as e:
            problems.append(f"{source}: override {item!r}: value is not valid YAML: {e}")
            continue
        section, name = parts
        tree.setdefault(section, {})[name] = value  # later overrides win
    clean, check_problems = _check_tree(tree, source, sections)
    problems.extend(check_problems)
    return clean


def load_config(path: str | None, overrides: Sequence[str] = ()) -> Config:
    """Load a YAML config (with its `base:` files) and apply `section.field=value` overrides.

    Checks keys and types and reports every problem in one ConfigError. Rule checks are
    separate: call cfg.validate(world_size) once the world size is known.
    `base:` paths are relative to the file naming them; this file's values win over its bases.
    Override values are parsed as YAML (`train.save_dir=null`, `optimizer.no_weight_decay=[bias]`).
    """
    return _build(load_sections(path, overrides, SECTIONS))


def load_sections(path: str | None, overrides: Sequence[str], sections: dict[str, type]) -> dict[str, dict[str, Any]]:
    """The checked {section: {field: value}} tree of a YAML file (+ bases) and overrides, for any
    set of dataclass sections (load_config's rules; fine-tuning has sections of its own)."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.field=value' strings, not one string")
    problems: list[str] = []
    tree = _load_tree(path, (), problems, sections) if path is not None else {}
    tree = _deep_merge(tree, _parse_overrides(overrides, problems, sections))
    if problems:
        raise ConfigError(problems)
    return tree


# --------------------------------------------------------------------------------------------
# DeepSpeed
# --------------------------------------------------------------------------------------------

_MISSING = object()
_DS_STEPS_PER_PRINT = 2**31 - 1  # effectively never: the trainer does its own logging


def deepspeed_settings(global_batch_size: int, micro_batch_size: int, grad_accum_steps: int, grad_clip: float,
                       zero_stage: int, precision: str) -> dict[str, Any]:
    """The DeepSpeed config of the settings our configs own (batch sizes, clipping, ZeRO stage,
    precision), as pretraining and fine-tuning both hand it to DeepSpeed."""
    ds: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,  # our LAMB/AdamW are client optimizers
        # Defaults a user JSON may change (DeepSpeed-only diagnostics with no counterpart here).
        "steps_per_print": _DS_STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        ds["fp16"]["loss_scale"] = 0  # 0 = dynamic loss scaling
    return ds


def build_deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed config dict derived from our config, with the user's DeepSpeed JSON
    (cfg.train.deepspeed_config) merged in. The user JSON may add DeepSpeed-only options;
    a key we own with a different value, or an `optimizer`/`scheduler` block, is a ConfigError."""
    t = cfg.train
    accum = cfg.grad_accum_steps(world_size)
    ds = deepspeed_settings(t.global_batch_size, t.micro_batch_size, accum, cfg.optimizer.grad_clip,
                            cfg.parallel.zero_stage, t.precision)

    if t.deepspeed_config is None:
        return ds
    src = t.deepspeed_config
    try:
        with open(src, encoding="utf-8") as f:
            user = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"train.deepspeed_config: file not found: {src}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{src}: invalid JSON: {e}") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{src}: top level must be a JSON object, got {type(user).__name__}")
    if "bfloat16" in user:  # DeepSpeed's old spelling; it reads "bf16" first, so ours would win silently
        raise ConfigError(f"{src}: use 'bf16' instead of the deprecated 'bfloat16' key")

    # Keys we own: (path in DeepSpeed JSON, our value as shown to the user, what to set instead).
    precision = f"train.precision={t.precision}"
    owned = [
        (("train_batch_size",), f"train.global_batch_size={t.global_batch_size}", "train.global_batch_size"),
        (("train_micro_batch_size_per_gpu",), f"train.micro_batch_size={t.micro_batch_size}",
         "train.micro_batch_size"),
        (("gradient_accumulation_steps",),
         f"{accum} (train.global_batch_size / (train.micro_batch_size x data parallel size))",
         "train.global_batch_size / train.micro_batch_size"),
        (("gradient_clipping",), f"optimizer.grad_clip={cfg.optimizer.grad_clip}", "optimizer.grad_clip"),
        (("zero_optimization", "stage"), f"parallel.zero_stage={cfg.parallel.zero_stage}", "parallel.zero_stage"),
        (("bf16", "enabled"), precision, "train.precision"),
        (("fp16", "enabled"), precision, "train.precision"),
        (("zero_allow_untested_optimizer",), "the trainer's required true (LAMB/AdamW are client optimizers)",
         None),
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
    return _deep_merge(ds, user)


def _same_value(a: Any, b: Any) -> bool:
    # 1 == 1.0 is fine (gradient_clipping), but JSON true is not the number 1
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _get_path(d: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        d = d[part]
    return d
