"""Rank entry point for tests/test_checkpoint_crashes.py: train the tiny model with the trainer's
log lines on stdout, and optionally die in the middle of writing a checkpoint.

usage: python tests/_crash_worker.py OUT.json OVERRIDE...
The overrides apply on top of tests' tiny config (tests/_train_worker.py TINY) and set the layout
(parallel.tensor_parallel / pipeline_parallel). The logging rank writes {"history": per-step
metrics, "params_norm": ...} to OUT.json when training returns.

CRASH_IN_SAVE=STEP:INDEX[:RANK]: in the save of STEP, the INDEX-th file (0-based) that rank RANK
(default: every rank) writes with torch.save (DeepSpeed's files, then our RNG file) gets only the
first half of its bytes, then that process kills itself with SIGKILL: what the OOM killer or a
lost node does mid-save.
"""
import io
import json
import os
import signal
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

import torch  # noqa: E402

from _train_worker import TINY  # noqa: E402
from pretrain.checkpoint.format import tag_for  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402
from pretrain.observability.console import configure_logging  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


def crash_inside_save(step: int, index: int) -> None:
    """Make this process die half-way through the index-th file torch.save writes in step's save."""
    original = torch.save
    written = []

    def save(obj, f, *args, **kwargs):
        # the tag directory's name starts with the step's tag, whatever suffix a save gives it
        if isinstance(f, (str, os.PathLike)) and os.path.basename(os.path.dirname(f)).startswith(tag_for(step)):
            if len(written) == index:
                buffer = io.BytesIO()
                original(obj, buffer)
                data = buffer.getvalue()
                with open(f, "wb") as out:
                    out.write(data[:len(data) // 2])
                print(f"crash worker: killed while writing {f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            written.append(f)
        return original(obj, f, *args, **kwargs)

    torch.save = save  # DeepSpeed's checkpoint engine and pretrain.checkpoint.exact call torch.save


def main():
    out_path, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, TINY + overrides)
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel,
                             timeout_minutes=cfg.resilience.dist_timeout_minutes)
    cfg.validate(world_size=parallel.world_size)
    crash = os.environ.get("CRASH_IN_SAVE")
    if crash:
        step, index, *rank = (int(v) for v in crash.split(":"))
        if not rank or rank[0] == parallel.rank:
            crash_inside_save(step, index)
    configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)  # as the program shows it
    trainer = Trainer(cfg, parallel)
    history = trainer.train()
    params_norm = trainer.params_norm()
    if parallel.rank == parallel.logging_rank:
        with open(out_path, "w") as f:
            json.dump({"history": history, "params_norm": params_norm}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
