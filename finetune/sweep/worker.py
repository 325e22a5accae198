"""One slot of a sweep: a process group that takes trials from the sweep's queue and runs them one
after another, in-process.

`python -m finetune.sweep.worker QUEUE_FILE SLOT ATTEMPT`, started by the runner (runner.py) as one
process, or under torch.distributed.run for a slot of several ranks. QUEUE_FILE (JSON) lists the
trials still to run, each {"id", "task", "directory", "overrides", "record": {...}}, in the sweep's
order, and the claims directory the slots share: a worker takes the next trial by creating its claim
file (`<claims>/<position>`, holding "SLOT ATTEMPT", linked into place: one link wins), so that
every trial is taken by one slot, and a slot that finishes early takes more. On several ranks rank
0 claims and tells the others. The process group, the imports and model.init_from (read once per distinct path) serve
every trial; each trial gets its own config (validated as `python -m finetune` validates it), engine
and output directory.

A trial that fails (a bad config value, bad data, any exception) is recorded as failed with its
one-line error (trial.json, written by the logging rank after the trial's outputs) and the worker goes
on with the next; a trial that finished is recorded as done. Its log lines go to <directory>/trial.log
(the logging rank's information, every rank's warnings) beside the worker's own output. Every rank
meets the same config and data, so every rank decides alike; a rank that dies ends the group, and
the runner records that trial as failed and starts a new worker for the rest.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import traceback
from contextlib import contextmanager

logger = logging.getLogger("finetune.sweep.worker")  # not __name__: run as __main__

HPARAMS_RUN = "hparams"  # the subfolder of a trial's TensorBoard folder holding its HParams summary


@contextmanager
def trial_log(path: str, parallel):
    """The library's log records of one trial also into `path` (appended: a rerun follows the run it
    replaces), from the logging rank; other ranks' warnings stay on their own output."""
    handler = None
    if parallel.rank == parallel.logging_rank:
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in ("pretrain", "finetune"):
            logging.getLogger(name).addHandler(handler)
    try:
        yield
    finally:
        if handler is not None:
            for name in ("pretrain", "finetune"):
                logging.getLogger(name).removeHandler(handler)
            handler.close()


def one_line(error: BaseException) -> str:
    """A trial's error in one line: a UserError's (or a ConfigError's first problem) message as it is,
    anything else with its type."""
    from pretrain.common.errors import UserError
    from pretrain.config import ConfigError

    if isinstance(error, ConfigError):
        problems = getattr(error, "problems", None) or [str(error)]
        text = f"invalid configuration: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    elif isinstance(error, UserError):
        text = str(error)
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split()) or type(error).__name__


def write_hparams(tensorboard_dir: str, point: dict, seed: int, metrics: dict[str, float], score: float) -> None:
    """The trial's hyperparameters and dev metrics for TensorBoard's HParams view (the grid compared
    across trials), in <tensorboard_dir>/hparams."""
    from torch.utils.tensorboard import SummaryWriter

    hparams = {key: (value if isinstance(value, (int, float, str, bool)) else json.dumps(value))
               for key, value in point.items()}
    hparams["train.seed"] = seed
    with SummaryWriter(tensorboard_dir) as writer:
        writer.add_hparams(hparams, {"hparam/dev_score": score, **{f"hparam/{k}": v for k, v in metrics.items()}},
                           run_name=HPARAMS_RUN)


def run_trial(entry: dict, parallel, checkpoints: dict) -> tuple[str, str | None]:
    """(status, one-line error) of one trial, run in this process group."""
    from finetune.config import load_finetune_config, task_config
    from finetune.finetuner import read_init_from, run
    from finetune.sweep.selection import SelectionError, official_score
    from finetune.tasks import TASKS
    from pretrain.config import ConfigError

    task = entry["task"]
    cfg = load_finetune_config(task_config(task), [f"task.name={task}", *entry["overrides"]])
    cfg.validate(parallel.world_size, TASKS)
    if cfg.parallel.tensor_parallel != parallel.tp_size:  # the runner starts the groups from sweep.overrides
        raise ConfigError(f"parallel.tensor_parallel ({cfg.parallel.tensor_parallel}) differs from the sweep's "
                          f"process groups (TP {parallel.tp_size}): set it in sweep.overrides only")
    path = cfg.model.init_from
    if path not in checkpoints:  # once per process and path
        checkpoints[path] = read_init_from(path)
        logger.info(f"read {path}: kept for this worker's other trials")
    summary = run(cfg, parallel, checkpoints[path])
    if parallel.rank == parallel.logging_rank and cfg.train.tensorboard_dir:
        metrics = summary["best"]["metrics"]
        try:
            score = official_score(task, metrics)
        except SelectionError as error:  # the run finished: the table at the end names what is missing
            logger.warning(f"trial {entry['id']}: {error}")
            score = float("nan")
        write_hparams(cfg.train.tensorboard_dir, entry["record"]["point"], entry["record"]["seed"], metrics, score)
    return "done", None


def claim_trial(claims_dir: str, position: int, slot: int, attempt: int, parallel) -> bool:
    """Whether this slot takes the queue's trial at `position`: rank 0 creates its claim file unless
    another slot did, and every rank of the slot learns the answer."""
    from pretrain.distributed.device import all_gather_object

    taken = False
    if parallel.rank == 0:  # the claim appears whole or not at all: written aside, then linked
        draft = os.path.join(claims_dir, f".{position}.{slot}.{attempt}")
        with open(draft, "w", encoding="utf-8") as f:
            f.write(f"{slot} {attempt}\n")
        try:
            os.link(draft, os.path.join(claims_dir, str(position)))
            taken = True
        except FileExistsError:
            pass
        finally:
            os.remove(draft)
    return all_gather_object(taken)[0]


def run_slot(queue: dict, slot: int, attempt: int, parallel) -> None:
    from finetune.sweep.trials import TrialRecord, write_trial_record

    checkpoints: dict = {}
    for position, entry in enumerate(queue["trials"]):
        if not claim_trial(queue["claims"], position, slot, attempt, parallel):
            continue
        started = time.perf_counter()
        with trial_log(f"{entry['directory']}/trial.log", parallel):
            logger.info(f"trial {entry['id']}: starting ({parallel.world_size} rank(s))")
            try:
                status, error = run_trial(entry, parallel, checkpoints)
            except Exception as exc:  # noqa: BLE001 (a failed trial is recorded, and the sweep goes on)
                status, error = "failed", one_line(exc)
                logger.warning(f"trial {entry['id']} failed: {error}")
                logger.info("".join(traceback.format_exception(exc)))
            gc.collect()
        if parallel.rank == parallel.logging_rank:
            record = TrialRecord(**{**entry["record"], "status": status, "error": error,
                                    "seconds": round(time.perf_counter() - started, 3)})
            write_trial_record(entry["directory"], record)
            print(f"trial {entry['id']}: {status}" + (f": {error}" if error else ""), flush=True)


def main(argv=None) -> int:
    from pretrain.cli import run_distributed
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    argv = sys.argv[1:] if argv is None else argv
    queue_file, slot, attempt = argv[0], int(argv[1]), int(argv[2])
    with open(queue_file, encoding="utf-8") as f:
        queue = json.load(f)
    return run_distributed(lambda parallel: run_slot(queue, slot, attempt, parallel), queue["tensor_parallel"])


if __name__ == "__main__":
    sys.exit(main())
