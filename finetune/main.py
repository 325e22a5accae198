"""Command line: `python -m finetune TASK [--config FILE] [--feature-based] [section.key=value ...]`,
`python -m finetune embed ...` (contrastive training of an embedding model: finetune/embedding/main.py)
and `python -m finetune sweep ...` (finetune/sweep/runner.py).

TASK is a GLUE task (cola sst2 mrpc stsb qqp mnli qnli rte wnli), swag, squad, squad2 or conll2003. The config (default
configs/finetune/TASK.yaml when it exists) and the overrides are validated against the world
size before any process group starts. Started once per rank by a launcher (see launcher.sh);
a single process needs none. Exit status: 0 done, 1 bad input found after start, 2 bad config
(also: train.output_dir holds a previous run's outputs, unless train.overwrite_output_dir=true).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from pretrain.cli import accept_launcher_args, run_command, run_distributed

from .output_dir import agree_on_output_dir, one_node
from .tasks import TASK_NAMES  # torch-free: the tasks themselves are imported when one is asked for



def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    accept_launcher_args(parser)
    parser.add_argument("task", choices=TASK_NAMES)
    parser.add_argument("--config", help="YAML config (default: configs/finetune/TASK.yaml)")
    parser.add_argument("--feature-based", action="store_true",
                        help="token classification: train a BiLSTM on the frozen encoder's cached features "
                             "(the features section) instead of fine-tuning")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.init_from=ckpt/ train.epochs=2")
    # intermixed: overrides may follow --config, as in `python -m finetune mrpc --config F a.b=1`
    return parser.parse_intermixed_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sweep"]:  # python -m finetune sweep --config SWEEP.yaml [sweep.key=value ...]
        from .sweep.runner import main as sweep

        return sweep(argv[1:])
    if argv[:1] == ["embed"]:  # python -m finetune embed [--config EMBED.yaml] [section.key=value ...]
        from .embedding.main import main as embed

        return embed(argv[1:])
    return run_command(parse_args, start, argv)


def start(args: argparse.Namespace) -> int:
    from pretrain.config import ConfigError
    from pretrain.distributed.parallel import discover_launch_env
    from pretrain.resilience import launch_status

    from .config import TASK_CONFIGS, load_finetune_config, output_dir_problems, task_config
    from .tasks import TASKS

    launch = discover_launch_env()
    config = args.config or os.path.join(TASK_CONFIGS, f"{args.task}.yaml")
    try:
        cfg = load_finetune_config(args.config or task_config(args.task), [f"task.name={args.task}", *args.overrides])
        problems = []
        try:
            cfg.validate(launch.world_size, TASKS, feature_based=args.feature_based)
        except ConfigError as error:
            problems = error.problems
        if not args.feature_based and one_node(launch.world_size):
            # every rank reads the same train.output_dir: all refuse alike, before any rank started
            # (on several nodes, which may not share it, agree_on_output_dir decides after the rendezvous)
            problems += output_dir_problems(cfg)
        if problems:
            raise ConfigError(problems)
    except ConfigError as error:
        # every problem on its own line under one heading, before any rank started; the heading
        # names both sources, the problems their keys (a key the command line must give is no
        # fault of the task's YAML)
        print(f"invalid configuration ({config} + command line):\n{error}", file=sys.stderr)
        launch_status.failed(launch_status.own_rank(), str(error))  # launcher.sh: a restart would meet it again
        return 2

    if args.feature_based:
        from .feature_tagger import run
    else:
        from .finetuner import run

    def fine_tune(parallel) -> None:
        if not args.feature_based:
            agree_on_output_dir(cfg, parallel)
        summary = run(cfg, parallel)
        if not summary.get("best"):
            return  # the feature-based tagger trains on the logging rank only
        if parallel.rank == parallel.logging_rank:
            print(json.dumps({"task": summary["task"], "best": summary["best"]}, indent=2))

    return run_distributed(fine_tune, cfg.parallel.tensor_parallel, launch=launch)


if __name__ == "__main__":
    sys.exit(main())
