"""`python -m finetune sweep --config SWEEP.yaml [sweep.key=value ...]`: the BERT paper's fine-tuning
protocol in one command (spec.py: tasks x grid x random restarts; selection.py; table.py; bundle.py).

The runner starts `parallel_trials` slots, each a worker process group of `ranks_per_trial` ranks
(worker.py) that runs its share of the trials one after another in-process: on GPUs each slot has
its own devices (CUDA_VISIBLE_DEVICES), on the CPU the cores are shared out (OMP_NUM_THREADS). The
trials still to run are dealt to the slots in order, round robin, so a sweep is reproducible.

Relaunching the same command goes on where a killed sweep stopped: a trial with a trial.json (done or
failed) is not run again and its files are not touched; a trial without one reruns from scratch. The
directory's sweep.json (manifest.py) refuses a relaunch whose fixed settings changed, and a first
launch into a directory that holds other files.
SIGTERM or Ctrl-C stops the workers and exits 143 / 130 with the count of finished trials. A worker
that dies records its current trial as failed and a new one takes the slot's remaining trials. At the
end: results.md / .csv / .json (Table 1's layout), glue_submission.zip when the selected runs predicted
GLUE's test files, the selected SQuAD and SWAG predictions, and every trial in TensorBoard's HParams
view under <output_dir>/tensorboard.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

from pretrain.distributed.ports import free_port as _free_port

from .manifest import claim
from .spec import SweepSpec, load_sweep_spec
from .trials import Trial, expand, read_records, record_for, write_trial_record

logger = logging.getLogger(__name__)

SLOTS_DIR = ".slots"  # the slot files the workers read, under output_dir
POLL_SECONDS = 0.5


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m finetune sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the sweep's YAML (section `sweep`)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sweep.restarts=5 sweep.grid=paper")
    return parser.parse_args(argv)




def visible_gpus(environ) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none on a CPU machine)."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed or [str(i) for i in range(torch.cuda.device_count())]


def slot_environments(spec: SweepSpec, environ) -> list[dict[str, str]]:
    """The environment of each slot: its GPUs, or its share of the CPU's cores. A ValueError when
    the GPUs cannot hold that many slots."""
    ranks, gpus = spec.ranks_per_trial, visible_gpus(environ)
    if gpus:
        slots = spec.parallel_trials or max(1, len(gpus) // ranks)
        if slots * ranks > len(gpus):
            raise ValueError(f"sweep.parallel_trials ({slots}) x sweep.ranks_per_trial ({ranks}) needs {slots * ranks} "
                             f"GPUs; this node has {len(gpus)} ({','.join(gpus)})")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[k * ranks:(k + 1) * ranks])} for k in range(slots)]
    slots = spec.parallel_trials or 1
    threads = max(1, (os.cpu_count() or 1) // (slots * ranks))
    return [{"OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""} for _ in range(slots)]


def trial_entry(spec: SweepSpec, trial: Trial) -> dict:
    """What a worker needs of a trial: its overrides (the sweep's own keys last: its directory, its
    TensorBoard folder under the sweep's, replacing what an interrupted attempt left there)."""
    out = trial.output_dir(spec)
    overrides = ["train.progress=false", f"task.cache_dir={json.dumps(os.path.join(spec.output_dir, 'cache'))}",
                 *trial.overrides(spec), "train.overwrite_output_dir=true",
                 f"train.tensorboard_dir={json.dumps(os.path.join(spec.output_dir, 'tensorboard', trial.directory))}"]
    record = record_for(trial, "done").to_json()
    return {"id": trial.id, "task": trial.task, "directory": out, "overrides": overrides, "record": record}


class Slot:
    """One worker process group and the trials it was given."""

    def __init__(self, index: int, spec: SweepSpec, env: dict[str, str], trials: list[Trial]):
        self.index, self.spec, self.env, self.trials = index, spec, env, trials
        self.process: subprocess.Popen | None = None
        self.attempt = 0
        self.log_path = os.path.join(spec.output_dir, "logs", f"slot-{index}.log")

    def unfinished(self) -> list[Trial]:
        return [t for t, r in read_records(self.spec, self.trials) if r is None]

    def start(self, trials: list[Trial]) -> None:
        self.attempt += 1
        slot_file = os.path.join(self.spec.output_dir, SLOTS_DIR, f"slot-{self.index}-{self.attempt}.json")
        os.makedirs(os.path.dirname(slot_file), exist_ok=True)
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        for trial in trials:
            os.makedirs(trial.output_dir(self.spec), exist_ok=True)
        tensor_parallel = _tensor_parallel(self.spec)
        with open(slot_file, "w", encoding="utf-8") as f:
            json.dump({"tensor_parallel": tensor_parallel,
                       "trials": [trial_entry(self.spec, t) for t in trials]}, f, indent=1)
        port, ranks = _free_port(), self.spec.ranks_per_trial
        env = dict(os.environ, **self.env, PYTHONUNBUFFERED="1")
        if ranks == 1:
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = [sys.executable, "-m", "finetune.sweep.worker", slot_file]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                       "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "finetune.sweep.worker", slot_file]
        log = open(self.log_path, "a", encoding="utf-8")
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_end_with_the_runner)
        log.close()
        logger.info(f"slot {self.index}: {len(trials)} trial(s) on {ranks} rank(s) "
                    f"({', '.join(f'{k}={v}' for k, v in self.env.items() if v)}); log {self.log_path}")

    def poll(self) -> bool:
        """Whether the slot is done (its worker ended and every trial it had is recorded)."""
        if self.process is None or self.process.poll() is None:
            return self.process is None
        status, left = self.process.returncode, self.unfinished()
        self.process = None
        if not left:
            return True
        died_on = left[0]  # trials run in order: the first unrecorded one is the one it was running
        error = f"the worker of slot {self.index} exited with status {status} during this trial (see {self.log_path})"
        write_trial_record(died_on.output_dir(self.spec), record_for(died_on, "failed", error))
        logger.warning(f"trial {died_on.id}: failed: {error}")
        if left[1:]:
            self.start(left[1:])
            return False
        return True

    def stop(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def wait(self, seconds: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(seconds)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _end_with_the_runner() -> None:
    """In a worker, before it starts: SIGTERM when the runner ends, however it ends (SIGKILL, the OOM
    killer), so that no worker goes on writing into a sweep a relaunch runs again (Linux: prctl
    PR_SET_PDEATHSIG; torch.distributed.run passes it on to its ranks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _tensor_parallel(spec: SweepSpec) -> int:
    """parallel.tensor_parallel as the sweep's overrides set it (the workers' process groups)."""
    value = 1
    for item in spec.overrides:
        key, _, text = item.partition("=")
        if key.strip() == "parallel.tensor_parallel":
            value = int(text)
    return value


def refuse_invalid(spec: SweepSpec, trials: list[Trial]) -> list[Trial]:
    """The trials whose config is valid, as `python -m finetune` checks it at the slots' world size;
    the others are recorded as failed here, with their config's first problem, and never started."""
    from pretrain.config import ConfigError

    from ..config import load_finetune_config
    from ..main import task_config
    from .worker import one_line

    valid = []
    for trial in trials:
        try:
            overrides = trial_entry(spec, trial)["overrides"]
            load_finetune_config(task_config(trial.task), [f"task.name={trial.task}", *overrides]).validate(
                spec.ranks_per_trial)
        except ConfigError as error:
            write_trial_record(trial.output_dir(spec), record_for(trial, "failed", one_line(error)))
            logger.warning(f"trial {trial.id}: failed: {one_line(error)}")
            continue
        valid.append(trial)
    return valid


def run_sweep(spec: SweepSpec, environ=os.environ) -> dict:
    """Run what is left of the sweep, then select, tabulate and bundle. {"finished", "planned",
    "interrupted": signal name or None, "selections"}."""
    from .bundle import write_bundle
    from .selection import select_all
    from .table import markdown, write_results

    claim(spec)  # before anything is written: a foreign or changed directory is refused
    trials = expand(spec)
    left = refuse_invalid(spec, [t for t, r in read_records(spec, trials) if r is None])
    envs = slot_environments(spec, environ)
    logger.info(f"sweep {spec.output_dir}: {len(trials)} trials ({len(trials) - len(left)} finished before), "
                f"{len(envs)} slot(s) of {spec.ranks_per_trial} rank(s)")
    slots = [Slot(k, spec, env, left[k::len(envs)]) for k, env in enumerate(envs)]
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for slot in slots:
            if slot.trials:
                slot.start(slot.trials)
        running = [slot for slot in slots if slot.trials]
        while running and stop["signal"] is None:
            time.sleep(POLL_SECONDS)
            running = [slot for slot in running if not slot.poll()]
        if stop["signal"] is not None:
            for slot in slots:
                slot.stop(signal.SIGTERM)
            for slot in slots:
                slot.wait(30)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    records = [r for _, r in read_records(spec, trials)]
    finished = sum(r is not None for r in records)
    name = signal.Signals(stop["signal"]).name if stop["signal"] is not None else None
    planned = {task: sum(t.task == task for t in trials) for task in spec.tasks}
    selections = select_all(spec.tasks, records, planned)
    write_results(selections, spec.output_dir)
    bundle = write_bundle(selections, spec.output_dir)
    print(markdown(selections))
    if bundle.zip_path:
        logger.info(f"GLUE submission: {bundle.zip_path} ({len(bundle.included)} files"
                    + (f"; not predicted: {', '.join(bundle.missing)}" if bundle.missing else "") + ")")
    for problem in bundle.problems:
        logger.warning(problem)
    return {"finished": finished, "planned": len(trials), "interrupted": name, "selections": selections}


def main(argv=None) -> int:
    from pretrain.cli import configure_logging
    from pretrain.config import ConfigError

    configure_logging()
    args = parse_args(argv)
    try:
        spec = load_sweep_spec(args.config, args.overrides)
        expand(spec)
    except ConfigError as error:
        print(f"invalid sweep configuration ({args.config or 'command line'}):\n{error}", file=sys.stderr)
        return 2
    try:
        outcome = run_sweep(spec)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if outcome["interrupted"]:
        print(f"sweep: stopped by {outcome['interrupted']}: {outcome['finished']} of {outcome['planned']} trials "
              f"finished; run the same command again to go on with the rest", file=sys.stderr)
        return 130 if outcome["interrupted"] == "SIGINT" else 143
    print(f"sweep: {outcome['finished']} of {outcome['planned']} trials finished; results in "
          f"{os.path.join(spec.output_dir, 'results.md')}")
    failures = [error for s in outcome["selections"] for _, error in s.failed]
    if failures and not any(s.best for s in outcome["selections"]):
        print(f"error: every trial failed; the first: {failures[0]}", file=sys.stderr)
        return 1
    return 0


__all__ = ["run_sweep", "main"]
