"""Command line: `python -m pretrain --config configs/bert-base.yaml [section.key=value ...]`.

Started once per rank by a launcher (torchrun, deepspeed, mpirun, srun; see launcher.sh).
The configuration is validated against the world size before any process group starts.
"""
from __future__ import annotations

import argparse
import sys

from .config import ConfigError, load_config
from .cli import accept_launcher_args
from .parallel import discover_launch_env
from .quiet import hide_library_warnings


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config for --world-size (or the launcher's) and exit")
    parser.add_argument("--world-size", type=int, default=None, help="with --check-config: ranks the job will have")
    accept_launcher_args(parser)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=4")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    hide_library_warnings()
    args = parse_args(argv)
    world_size = args.world_size or discover_launch_env().world_size
    try:
        cfg = load_config(args.config, args.overrides)
        cfg.validate(world_size=world_size)
        if cfg.train.precision == "fp16" and not args.check_config:
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("train.precision=fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use bf16 or fp32")
        from .data.provider import data_file_problems

        problems = data_file_problems(cfg)
        if problems:
            raise ConfigError(problems)
    except ConfigError as error:
        print(f"invalid configuration ({args.config}):\n{error}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"{args.config}: valid for {world_size} rank(s)")
        return 0

    from .checkpoint.format import CheckpointError
    from .data.indexed import DataError
    from .data.wordpiece import VocabError
    from .parallel import init_parallel, shutdown_parallel
    from .training import Trainer

    parallel = init_parallel(cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel,
                             cfg.train.dist_timeout_minutes)
    try:
        Trainer(cfg, parallel).train()
    except (DataError, VocabError, CheckpointError) as error:
        # Bad input found after start-up (every rank finds the same): one clear line, no traceback.
        if parallel.rank == parallel.logging_rank:
            print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        shutdown_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
