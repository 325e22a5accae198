"""Command line: `python -m finetune TASK [--config FILE] [section.key=value ...]`.

TASK is a GLUE task (cola sst2 mrpc stsb qqp mnli qnli rte wnli) or swag. The config (default
configs/finetune/TASK.yaml when it exists) and the overrides are validated against the world
size before any process group starts. Started once per rank by a launcher (see launcher.sh);
a single process needs none. Exit status: 0 done, 1 bad input found after start, 2 bad config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from pretrain.config import ConfigError
from pretrain.cli import accept_launcher_args
from pretrain.quiet import hide_library_warnings

from .config import TASK_NAMES, load_finetune_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task", choices=TASK_NAMES)
    parser.add_argument("--config", help="YAML config (default: configs/finetune/TASK.yaml)")
    accept_launcher_args(parser)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.init_from=ckpt/ train.epochs=2")
    # intermixed: overrides may follow --config, as in `python -m finetune mrpc --config F a.b=1`
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    hide_library_warnings()
    args = parse_args(argv)
    from pretrain.parallel import discover_launch_env

    world_size = discover_launch_env().world_size
    config = args.config or os.path.join(REPO, "configs", "finetune", f"{args.task}.yaml")
    try:
        cfg = load_finetune_config(config if os.path.exists(config) or args.config else None,
                                   [f"task.name={args.task}", *args.overrides])
        cfg.validate(world_size)
    except ConfigError as error:
        print(f"invalid configuration ({config}):\n{error}", file=sys.stderr)
        return 2

    from pretrain.parallel import init_parallel, shutdown_parallel

    from .trainer import FinetuneError, run

    parallel = init_parallel(cfg.parallel.tensor_parallel, 1)
    try:
        summary = run(cfg, parallel)
    except FinetuneError as error:
        if parallel.rank == parallel.logging_rank:
            print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        shutdown_parallel()
    if parallel.rank == parallel.logging_rank:
        print(json.dumps({"task": summary["task"], "best": summary["best"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
