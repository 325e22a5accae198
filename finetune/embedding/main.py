"""Command line: `python -m finetune embed [--config FILE] [section.key=value ...]`.

Contrastive training of an embedding model from a pretrained encoder (trainer.py). The config
(default configs/finetune/embed.yaml) and the overrides are validated against the world size
before any process group starts; started once per rank by a launcher (launcher.sh), a single
process needs none. Exit status: 0 done, 1 bad input found after start, 2 bad config (also:
train.output_dir holds a previous run's outputs, unless train.overwrite_output_dir=true).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from pretrain.cli import accept_launcher_args, run_command, run_distributed

from ..config import TASK_CONFIGS, output_dir_problems
from ..output_dir import agree_on_output_dir, one_node

DEFAULT_CONFIG = os.path.join(TASK_CONFIGS, "embed.yaml")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m finetune embed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    accept_launcher_args(parser)
    # the repository's defaults file; an installed package without the repository runs on the sections' defaults (the same)
    parser.add_argument("--config", default=DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None,
                        help="YAML config (default: configs/finetune/embed.yaml)")
    parser.add_argument("overrides", nargs="*",
                        help="dotted overrides, e.g. model.init_from=ckpt/ data.train_files=[pairs.jsonl]")
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    return run_command(parse_args, start, sys.argv[1:] if argv is None else list(argv))


def start(args: argparse.Namespace) -> int:
    from pretrain.config import ConfigError
    from pretrain.distributed.parallel import discover_launch_env
    from pretrain.resilience import launch_status

    from .config import load_embed_config

    launch = discover_launch_env()
    try:
        cfg = load_embed_config(args.config, args.overrides)
        problems = []
        try:
            cfg.validate(launch.world_size)
        except ConfigError as error:
            problems = error.problems
        if one_node(launch.world_size):  # every rank sees the same train.output_dir: all refuse alike
            problems += output_dir_problems(cfg)
        if problems:
            raise ConfigError(problems)
    except ConfigError as error:
        print(f"invalid configuration ({args.config or 'defaults'} + command line):\n{error}", file=sys.stderr)
        launch_status.failed(launch_status.own_rank(), str(error))
        return 2

    def train(parallel) -> None:
        from .trainer import run

        agree_on_output_dir(cfg, parallel)
        summary = run(cfg, parallel)
        if parallel.rank == parallel.logging_rank:
            print(json.dumps({"task": "embed", "best": summary["best"]}, indent=2))

    return run_distributed(train, cfg.parallel.tensor_parallel, launch=launch)
