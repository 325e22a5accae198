"""<output_dir>/sweep.json: what a sweep directory's trials were run with.

A relaunch reuses every trial with a trial.json, so it must be the same experiment: the same
sweep.overrides (the checkpoint, the model, every fixed setting), task_overrides, data_root and
first_seed. The trials themselves may change: the directory of a trial names its task, grid point
and restart, so a grid that gains a learning rate or a sweep that gains a task or restarts reuses what
matches and runs the rest. parallel_trials and ranks_per_trial may change too (how, not what).

The first launch writes sweep.json into a new or empty directory; a directory that holds other
files and no sweep.json is refused, since rerunning a trial overwrites its directory. While a sweep
runs it holds a lock on <output_dir>/.lock: a second sweep on the same directory is refused.
"""
from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager

from pretrain.common.atomic import replace_durably
from pretrain.config import ConfigError

from .spec import SweepSpec

MANIFEST = "sweep.json"
IDENTITY_KEYS = ("overrides", "task_overrides", "data_root", "first_seed")
LOCK = ".lock"


def identity(spec: SweepSpec) -> dict:
    """The settings finished trials must share with a relaunch (JSON-comparable)."""
    return {"overrides": list(spec.overrides),
            "task_overrides": {task: list(items) for task, items in sorted(spec.task_overrides.items()) if items},
            "data_root": spec.data_root, "first_seed": spec.first_seed}


def describe(spec: SweepSpec) -> dict:
    """sweep.json's content: the identity, then the trials' dimensions of the latest launch."""
    return {**identity(spec), "tasks": list(spec.tasks), "restarts": spec.restarts,
            "grid": {key: list(values) for key, values in spec.grid}}


def claim_directory(spec: SweepSpec) -> None:
    """Check that spec.output_dir is this sweep's (or new), then write sweep.json. A ConfigError
    naming each setting that changed, or the directory's foreign files."""
    path = os.path.join(spec.output_dir, MANIFEST)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                stored = json.load(f)
            if not isinstance(stored, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            raise ConfigError(f"{path}: unreadable ({error}); it records what this directory's trials were run "
                              f"with: restore it, or use a new sweep.output_dir") from None
        now = identity(spec)
        changed = [f"sweep.{key}: {json.dumps(stored.get(key))} before, {json.dumps(now[key])} now"
                   for key in IDENTITY_KEYS if stored.get(key) != now[key]]
        if changed:
            raise ConfigError([f"sweep.output_dir {spec.output_dir} holds a sweep run with other settings; its finished "
                               f"trials would be mixed with these (use a new sweep.output_dir, or the old settings):",
                               *(f"  {line}" for line in changed)])
    elif os.path.isdir(spec.output_dir) and set(os.listdir(spec.output_dir)) - {LOCK}:
        found = sorted(set(os.listdir(spec.output_dir)) - {LOCK})
        raise ConfigError(f"sweep.output_dir {spec.output_dir} is not empty ({', '.join(found[:5])}"
                          f"{', ...' if len(found) > 5 else ''}) and holds no {MANIFEST}: not a sweep's directory, "
                          f"and a trial run there would overwrite what it finds; choose a new or empty directory")
    os.makedirs(spec.output_dir, exist_ok=True)
    replace_durably(path, json.dumps(describe(spec), indent=1) + "\n")


@contextmanager
def sole_sweep(output_dir: str):
    """Hold <output_dir>/.lock while the sweep runs (released however the runner ends); a
    ConfigError when another sweep holds it."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"sweep.output_dir {output_dir} is a file, not a directory")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, LOCK)
    existed = os.path.exists(path)
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise ConfigError(f"sweep.output_dir {output_dir}: another sweep runs there ({lock.read().strip() or 'a process'}); "
                              f"wait for it, or stop it first") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
        try:
            yield
        except ConfigError:  # a directory that is not the sweep's keeps no lock file of ours
            if not existed:
                os.remove(path)
            raise
