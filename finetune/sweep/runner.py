"""`python -m finetune sweep --config SWEEP.yaml [sweep.key=value ...]`: the BERT paper's fine-tuning
protocol in one command (spec.py: tasks x grid x random restarts; selection.py; table.py; bundle.py).

The runner starts `parallel_trials` slots, each a worker process group of `ranks_per_trial` ranks
(worker.py) that takes trials from the sweep's queue and runs them one after another in-process:
on GPUs each slot has its own devices (CUDA_VISIBLE_DEVICES), on the CPU the cores are shared out
(OMP_NUM_THREADS). The queue holds the trials still to run in the sweep's order; a slot that
finishes a trial takes the next one nobody has taken, so short and long trials even out.

Relaunching the same command goes on where a killed sweep stopped: a trial with a trial.json (done or
failed) is not run again and its files are not touched; a trial without one reruns from scratch
(--retry-failed: the failed ones too). The directory's sweep.json (manifest.py) refuses a relaunch
whose fixed settings changed, and a first launch into a directory that holds other files.
SIGTERM or Ctrl-C stops the workers and exits 143 / 130 with the count of finished trials. When a
worker dies, the trial it had taken is recorded as failed and a new worker takes the slot. At the
end: results.md / .csv / .json (Table 1's layout), glue_submission.zip when the selected runs predicted
GLUE's test files, the selected SQuAD and SWAG predictions, and every trial in TensorBoard's HParams
view under <output_dir>/tensorboard.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

from pretrain.distributed.ports import PortPicker

from .manifest import claim_directory, sole_sweep
from .spec import SweepSpec, load_sweep_spec
from .trials import TRIAL_FILE, Trial, expand, read_records, record_for, write_trial_record

logger = logging.getLogger(__name__)

SLOTS_DIR = ".slots"  # under output_dir: the queue the workers read, and their claims
POLL_SECONDS = 0.5


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m finetune sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="the sweep's YAML (section `sweep`)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run the trials recorded as failed again (a worker killed by the OOM killer, a lost "
                             "node); without it a relaunch reruns only the trials that never ended")
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


class Queue:
    """The trials still to run, in the sweep's order, as the workers read them (QUEUE_FILE), and
    the claims by which each is taken by one slot (worker.py)."""

    def __init__(self, spec: SweepSpec, trials: list[Trial]):
        self.spec, self.trials = spec, trials
        slots_dir = os.path.join(spec.output_dir, SLOTS_DIR)
        shutil.rmtree(slots_dir, ignore_errors=True)  # a previous launch's (its workers ended with it)
        self.claims = os.path.join(slots_dir, "claims")
        os.makedirs(self.claims)
        for trial in trials:
            os.makedirs(trial.output_dir(spec), exist_ok=True)
        self.path = os.path.join(slots_dir, "queue.json")
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump({"tensor_parallel": _tensor_parallel(spec), "claims": self.claims,
                       "trials": [trial_entry(spec, t) for t in trials]}, f, indent=1)

    def claimed_by(self, position: int) -> tuple[int, int] | None:
        """(slot, attempt) of the worker that took the trial at `position`, None while nobody has."""
        try:
            with open(os.path.join(self.claims, str(position)), encoding="utf-8") as f:
                slot, attempt = f.read().split()
        except (FileNotFoundError, ValueError):  # not taken, or being written
            return None
        return int(slot), int(attempt)

    def unclaimed(self) -> int:
        return sum(self.claimed_by(k) is None for k in range(len(self.trials)))


class Slot:
    """One worker process group, taking trials from the queue until none is left."""

    def __init__(self, index: int, spec: SweepSpec, env: dict[str, str], queue: Queue, ports: PortPicker):
        self.index, self.spec, self.env, self.queue = index, spec, env, queue
        self.ports = ports  # shared by the slots: two workers starting together never draw one port
        self.process: subprocess.Popen | None = None
        self.attempt = 0
        self.log_path = os.path.join(spec.output_dir, "logs", f"slot-{index}.log")

    def start(self) -> None:
        self.attempt += 1
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        port, ranks = self.ports(), self.spec.ranks_per_trial
        env = dict(os.environ, **self.env, PYTHONUNBUFFERED="1")
        worker = ["-m", "finetune.sweep.worker", self.queue.path, str(self.index), str(self.attempt)]
        if ranks == 1:
            env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = [sys.executable, *worker]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                       "--master-addr", "127.0.0.1", "--master-port", str(port), *worker]
        log = open(self.log_path, "a", encoding="utf-8")
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_end_with_the_runner)
        log.close()
        logger.info(f"slot {self.index}: worker {self.attempt} on {ranks} rank(s) "
                    f"({', '.join(f'{k}={v}' for k, v in self.env.items() if v)}); log {self.log_path}")

    def poll(self) -> bool:
        """Whether the slot is done: its worker ended with nothing left to take, or ended without
        taking a trial (it would again: the slot is closed, its log says why)."""
        if self.process is None or self.process.poll() is None:
            return self.process is None
        status, self.process = self.process.returncode, None
        taken = [(k, trial) for k, trial in enumerate(self.queue.trials)
                 if (self.queue.claimed_by(k) or (None,))[0] == self.index]
        this_attempt = [trial for k, trial in taken if self.queue.claimed_by(k)[1] == self.attempt]
        for trial in [t for t, r in read_records(self.spec, [t for _, t in taken]) if r is None]:
            # the one it was running when it died
            error = f"the worker of slot {self.index} exited with status {status} during this trial (see {self.log_path})"
            write_trial_record(trial.output_dir(self.spec), record_for(trial, "failed", error))
            logger.warning(f"trial {trial.id}: failed: {error}")
        if status == 0 or not self.queue.unclaimed():
            return True
        if not this_attempt:
            logger.error(f"slot {self.index}: its worker exited with status {status} before taking a trial (see "
                         f"{self.log_path}); the slot is closed")
            return True
        self.start()
        return False

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

    from ..config import load_finetune_config, task_config
    from ..tasks import TASKS
    from .worker import one_line

    valid = []
    for trial in trials:
        try:
            overrides = trial_entry(spec, trial)["overrides"]
            load_finetune_config(task_config(trial.task), [f"task.name={trial.task}", *overrides]).validate(
                spec.ranks_per_trial, TASKS)
        except ConfigError as error:
            write_trial_record(trial.output_dir(spec), record_for(trial, "failed", one_line(error)))
            logger.warning(f"trial {trial.id}: failed: {one_line(error)}")
            continue
        valid.append(trial)
    return valid


def forget_failed(spec: SweepSpec, trials: list[Trial]) -> int:
    """Remove the trial.json of every failed trial, so that it runs again; how many."""
    failed = [t for t, r in read_records(spec, trials) if r is not None and r.status == "failed"]
    for trial in failed:
        os.remove(os.path.join(trial.output_dir(spec), TRIAL_FILE))
    if failed:
        logger.info(f"--retry-failed: {len(failed)} failed trial(s) run again: {', '.join(t.id for t in failed)}")
    return len(failed)


def run_sweep(spec: SweepSpec, environ=os.environ, retry_failed: bool = False) -> dict:
    """Run what is left of the sweep (with retry_failed, the failed trials too), then select,
    tabulate and bundle. {"finished", "planned", "interrupted": signal name or None, "selections"}."""
    with sole_sweep(spec.output_dir):
        claim_directory(spec)  # before anything is written: a foreign or changed directory is refused
        return _run_claimed(spec, environ, retry_failed)


def _run_claimed(spec: SweepSpec, environ, retry_failed: bool) -> dict:
    from .bundle import write_bundle
    from .selection import select_all
    from .table import markdown, write_results

    trials = expand(spec)
    if retry_failed:
        forget_failed(spec, trials)
    left = refuse_invalid(spec, [t for t, r in read_records(spec, trials) if r is None])
    envs = slot_environments(spec, environ)[:max(1, len(left))]  # no idle slot
    logger.info(f"sweep {spec.output_dir}: {len(trials)} trials ({len(trials) - len(left)} finished before), "
                f"{len(envs)} slot(s) of {spec.ranks_per_trial} rank(s)")
    queue = Queue(spec, left)
    ports = PortPicker()
    slots = [Slot(k, spec, env, queue, ports) for k, env in enumerate(envs)]
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        running = slots if left else []
        for slot in running:
            slot.start()
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
        outcome = run_sweep(spec, retry_failed=args.retry_failed)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if outcome["interrupted"]:
        print(f"sweep: stopped by {outcome['interrupted']}: {outcome['finished']} of {outcome['planned']} trials "
              f"finished; run the same command again to go on with the rest", file=sys.stderr)
        return 130 if outcome["interrupted"] == "SIGINT" else 143
    print(f"sweep: {outcome['finished']} of {outcome['planned']} trials finished; results in "
          f"{os.path.join(spec.output_dir, 'results.md')}")
    if outcome["finished"] < outcome["planned"]:
        print(f"error: {outcome['planned'] - outcome['finished']} trial(s) never ran: every slot's worker ended "
              f"before taking them (see {os.path.join(spec.output_dir, 'logs')}); run the same command again "
              f"to go on with them", file=sys.stderr)
        return 1
    failures = [error for s in outcome["selections"] for _, error in s.failed]
    if failures and not any(s.best for s in outcome["selections"]):
        print(f"error: every trial failed; the first: {failures[0]}", file=sys.stderr)
        return 1
    return 0


__all__ = ["run_sweep", "main"]
