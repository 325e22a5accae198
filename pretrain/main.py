"""Command line: `python -m pretrain --config configs/bert-base.yaml [section.key=value ...]`.

Started once per rank by a launcher (torchrun, deepspeed, mpirun, srun; see launcher.sh).
The configuration is validated against the world size before any process group starts.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from .cli import accept_launcher_args, positive_int, run_command, run_distributed
from .checkpoint.starting_point import load_run_config
from .config import ConfigError, rule_problems
from .resilience import launch_status

logger = logging.getLogger(__name__)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    accept_launcher_args(parser)
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config for --world-size (or the launcher's) and exit")
    parser.add_argument("--world-size", type=positive_int, default=None, help="with --check-config: ranks the job will have")
    parser.add_argument("--restartable", action="store_true",
                        help="with --check-config: the launcher restarts failed runs, so they must resume "
                             "(checkpoint.save_dir and checkpoint.load_dir set)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=4")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(parse_args, start, argv)


def start(args: argparse.Namespace) -> int:
    if not args.check_config and launch_status.own_rank() == 0:  # within a second of the launch, not after the imports
        logger.info("starting: loading torch, DeepSpeed and megatron-core, then the process groups, the model and "
                    "the data (the first launch after an install takes longest)")
    if args.world_size:
        world_size = args.world_size
    else:
        from .distributed.parallel import discover_launch_env  # torch and DeepSpeed: not for the launcher's check

        world_size = discover_launch_env().world_size
    try:
        try:
            cfg = load_run_config(args.config, args.overrides)  # the keys init_from's checkpoint gives
        except ConfigError as error:  # an unknown key or a wrong type: the rules the rest breaks as well
            raise ConfigError(error.problems + rule_problems(error, world_size)) from None
        # every rule the file breaks, and every missing file, in one report: not one round per kind
        problems = []
        try:
            cfg.validate(world_size=world_size)
        except ConfigError as error:
            problems += error.problems
        if cfg.train.precision == "fp16" and not args.check_config:
            import torch

            if not torch.cuda.is_available():
                problems.append("train.precision=fp16 needs a GPU (DeepSpeed has no fp16 on CPU); use bf16 or fp32")
        from .checkpoint.data_sequence import data_sequence_problems
        from .checkpoint.series import save_dir_problems
        from .checkpoint.starting_point import starting_point_problems
        from .checkpoint.vocabulary import vocabulary_problems
        from .data.samples.provider import data_file_problems
        from .observability.trackers import tracker_problems

        problems += starting_point_problems(cfg) + save_dir_problems(cfg) + tracker_problems(cfg)
        problems += data_file_problems(cfg) + vocabulary_problems(cfg) + data_sequence_problems(cfg)
        if args.restartable and not (cfg.checkpoint.save_dir and cfg.checkpoint.load_dir):
            problems.append("launcher.sh --max-restarts: a restart resumes from checkpoint.load_dir's latest checkpoint; "
                            "set checkpoint.save_dir and checkpoint.load_dir (usually the same directory)")
        if problems:
            raise ConfigError(problems)
    except ConfigError as error:
        # every problem of the file on its own line under one heading, before any rank started
        print(f"invalid configuration ({args.config}):\n{error}", file=sys.stderr)
        return 2
    if args.check_config:
        from .checkpoint.starting_point import untrained_head_notes

        print(f"{args.config}: valid for {world_size} rank(s)")
        for note in untrained_head_notes(cfg):
            print(f"note: {note}")
        return 0

    from .cli import INTERRUPTED
    from .training.trainer import Trainer

    def train(parallel) -> int:
        trainer = Trainer(cfg, parallel)
        try:
            trainer.train()
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut this line short
            print(f"rank {parallel.rank}: interrupted at step {trainer.step} (SIGINT); "
                  f"{last_checkpoint(cfg.checkpoint.save_dir)}", file=sys.stderr, flush=True)
            return INTERRUPTED
        if trainer.stopped:
            launch_status.stopped(parallel.rank, trainer.stopped)
        return 0

    p, r = cfg.parallel, cfg.resilience
    return run_distributed(train, p.tensor_parallel, p.pipeline_parallel, r.dist_timeout_minutes,
                           rendezvous_timeout_minutes=r.rendezvous_timeout_minutes, context_parallel=p.context_parallel)


def last_checkpoint(save_dir: str | None) -> str:
    """What an interrupted run leaves to resume from, in words."""
    if not save_dir:
        return "nothing saved (no checkpoint.save_dir)"
    try:
        with open(os.path.join(save_dir, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        return f"no checkpoint in {save_dir} yet"
    return f"the last complete checkpoint is {os.path.join(save_dir, tag)}"


if __name__ == "__main__":
    sys.exit(main())
