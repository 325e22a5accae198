"""Typed configuration, one module per job:

- one module per part the sections configure, each with its dataclass, the rules about its own
  fields and the keys that moved into it: model.py, parallel.py, optimizer.py, scheduler.py, data.py,
  train.py (and fp16), checkpoint.py, reporting.py (eval, logging), resilience.py; checks.py holds
  the small rules they share;
- schema.py: their composition, `Config` with the rules that tie sections together; `load_config`;
- token_clock.py: the run's batch sequence in tokens (the schedule's lengths are checked with it);
- typed_yaml.py: the YAML loader for any set of dataclass sections (`base:` files, dotted
  overrides, key and type checks; fine-tuning's sections load through it too) and ConfigError;
- choices.py: the valid names of the choice fields (optimizers, decays, precisions, ...);
- deepspeed.py: the DeepSpeed JSON derived from a Config, with a user JSON merged in.

Usage (the trainer):

    cfg = load_config(args.config, args.overrides)   # key and type checks
    cfg.validate(world_size)                          # every rule, all problems in one error
    ds_config = build_deepspeed_config(cfg, world_size)

The names below are the package's API; the modules are where they live.
"""
from .choices import PARAMETER_KINDS
from .deepspeed import build_deepspeed_config, deepspeed_settings
from .schema import (Config, DataConfig, ModelConfig, OptimizerConfig, ParallelConfig, SchedulerConfig, TrainConfig,
                     load_config, rule_problems)
from .typed_yaml import ConfigError, load_sections

__all__ = ["PARAMETER_KINDS", "ConfigError", "ModelConfig", "ParallelConfig", "OptimizerConfig", "SchedulerConfig",
           "DataConfig", "TrainConfig", "Config", "load_config", "load_sections", "rule_problems",
           "build_deepspeed_config", "deepspeed_settings"]
