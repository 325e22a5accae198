"""Where a fine-tuning run writes (train.output_dir), agreed by every rank before anything is written:
a directory holding a previous run's outputs is refused alike on every rank, or replaced with a
warning (train.overwrite_output_dir). Shared by `python -m finetune TASK` and `python -m finetune embed`."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def one_node(world_size: int, environ=None) -> bool:
    """Whether the launcher says every rank of the job runs on this node (so all see one train.output_dir):
    its ranks per node (rendezvous.py's variables; DeepSpeed's launcher: LOCAL_SIZE) are the world size."""
    from pretrain.distributed.rendezvous import LOCAL_SIZE_VARIABLES

    env = os.environ if environ is None else environ
    if world_size == 1:
        return True
    local = next((env[name] for name in (*LOCAL_SIZE_VARIABLES, "LOCAL_SIZE") if env.get(name, "").isdigit()), None)
    return local is not None and int(local) == world_size


def agree_on_output_dir(cfg, parallel) -> None:
    """After the rendezvous, before anything is read or written: the logging rank (the one rank that
    writes train.output_dir) looks there and every rank follows its verdict, so that all refuse alike
    (UsageError: one line, exit 2) even where nodes do not share the directory. With
    train.overwrite_output_dir the logging rank says what the run replaces."""
    from pretrain.common.errors import UsageError
    from pretrain.distributed.device import all_gather_object

    from .config import output_dir_problems, previous_outputs

    writer = parallel.rank == parallel.logging_rank
    view = (output_dir_problems(cfg), previous_outputs(cfg)) if writer else None
    problems, found = all_gather_object(view)[parallel.logging_rank]
    if problems:
        raise UsageError(problems[0])
    if found and writer:
        logger.warning(f"train.overwrite_output_dir: this run replaces the previous run's outputs in "
                       f"{cfg.train.output_dir} ({', '.join(found)})")
