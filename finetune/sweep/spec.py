"""The sweep spec: which tasks, which grid over fine-tuning keys, how many random restarts, where.

A YAML file with one section, ``sweep``::

    sweep:
      tasks: glue                # or a list: [mrpc, rte, squad]; "glue" = the 9 GLUE tasks
      grid: paper                # a preset name (GRID_PRESETS), or {dotted fine-tuning key: [values]}
      restarts: 5                # random restarts per grid point (>= 1; default 1)
      first_seed: 42             # restart r (0-based) runs with train.seed = first_seed + r
      output_dir: outputs/sweep  # required: trial r of a point runs in <output_dir>/<trial directory>
      data_root: glue_data       # optional: a GLUE task's task.data_dir = <data_root>/<GLUE directory>
      overrides: [model.init_from=ckpt/bert-base]   # dotted fine-tuning overrides for every trial
      task_overrides:            # task -> dotted overrides for that task's trials (win over `overrides`)
        squad: [task.data_dir=squad_data]
      ranks_per_trial: 1         # processes (GPUs) of one trial: its parallel.tensor_parallel x data parallel
      parallel_trials: null      # trials at once, each on its own processes; null: GPUs / ranks_per_trial (CPU: 1)

Command-line overrides are dotted too: ``sweep.restarts=5``, ``sweep.grid=paper-appendix``,
``sweep.grid.train.lr=[3e-5,2e-5]`` (one grid key), ``sweep.task_overrides.mrpc=[task.max_seq_length=64]``.
Values are YAML. Every problem is reported at once, one line each, naming the key (ConfigError).

Grid presets (GRID_PRESETS), from the BERT paper:

- ``paper``: §4.1 (GLUE): train.lr in 5e-5, 4e-5, 3e-5, 2e-5; batch 32; 3 epochs;
- ``paper-appendix``: A.3: batch 16 or 32; lr 5e-5, 3e-5, 2e-5; epochs 2, 3 or 4.

The keys a sweep owns cannot be grid keys or overrides: task.name (the trial's task), train.seed
(the restarts own it) and train.output_dir (the trial's directory); model.init_from is not a grid
key (one pretrained model per sweep: set it in `overrides`). AX has no trials of its own: MNLI's
selected model predicts it.
"""
from __future__ import annotations

import difflib
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pretrain.config import ConfigError, load_sections
from pretrain.config.typed_yaml import _read_yaml, check_tree, split_override

from ..config import SECTIONS
from ..tasks import GLUE, TASK_NAMES

# GLUE's directory names (the GLUE download script's layout), by task
GLUE_DIRS: Mapping[str, str] = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP",
                                "mnli": "MNLI", "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}

GRID_PRESETS: Mapping[str, Mapping[str, tuple]] = {
    "paper": {"train.lr": (5e-5, 4e-5, 3e-5, 2e-5), "train.global_batch_size": (32,), "train.epochs": (3.0,)},
    "paper-appendix": {"train.global_batch_size": (16, 32), "train.lr": (5e-5, 3e-5, 2e-5),
                       "train.epochs": (2.0, 3.0, 4.0)},
}

# keys the sweep sets itself, with why (grid keys and overrides)
OWNED_KEYS: Mapping[str, str] = {
    "task.name": "the sweep sets each trial's task (sweep.tasks)",
    "train.seed": "the restarts own the seed (sweep.first_seed, sweep.restarts)",
    "train.output_dir": "the sweep puts each trial in its own directory under sweep.output_dir",
}
NOT_GRID_KEYS: Mapping[str, str] = {
    **OWNED_KEYS,
    "model.init_from": "a sweep fine-tunes one pretrained model: set it in sweep.overrides",
}

SWEEP_KEYS = ("tasks", "grid", "restarts", "first_seed", "output_dir", "data_root", "overrides", "task_overrides",
              "ranks_per_trial", "parallel_trials")


@dataclass(frozen=True)
class SweepSpec:
    tasks: tuple[str, ...]
    grid: tuple[tuple[str, tuple], ...]  # (dotted key, values) in the grid's order
    output_dir: str
    restarts: int = 1
    first_seed: int = 42
    data_root: str | None = None
    overrides: tuple[str, ...] = ()
    task_overrides: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    ranks_per_trial: int = 1  # processes of one trial (its TP x DP; one GPU each)
    parallel_trials: int | None = None  # trials at once; None: the GPUs / ranks_per_trial (1 on the CPU)

    def seed(self, restart: int) -> int:
        return self.first_seed + restart

    def task_data_overrides(self, task: str) -> list[str]:
        """task.data_dir=<data_root>/<GLUE directory> for a GLUE task when data_root is set."""
        if self.data_root is None or task not in GLUE_DIRS:
            return []
        return [f"task.data_dir={json.dumps(os.path.join(self.data_root, GLUE_DIRS[task]))}"]


def _desc(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _fields() -> dict[str, dict[str, Any]]:
    return {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _key_problem(key: str, where: str, refused: Mapping[str, str]) -> str | None:
    """One line when `key` is not a fine-tuning key or is one the sweep owns."""
    if key in refused:
        return f"{where}: {key} cannot be set here: {refused[key]}"
    fields = _fields()
    section, _, name = key.partition(".")
    if section in fields and name in fields[section]:
        return None
    every = [f"{s}.{f}" for s, names in fields.items() for f in names]
    close = difflib.get_close_matches(key, every, n=1, cutoff=0.6)
    if not close:  # the field without its section, or in another one: lr -> train.lr
        close = [k for k in every if k.endswith(f".{name or section}")][:1]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{where}: {key!r} is not a fine-tuning key{hint}; keys are section.field of {', '.join(SECTIONS)}"


def _override_problems(items: Any, where: str) -> list[str]:
    if not _is_str_list(items):
        return [f"{where} must be a list of dotted key=value strings, got {_desc(items)}"]
    problems = []
    for item in items:
        key = item.partition("=")[0].strip()
        if key in OWNED_KEYS:
            problems.append(f"{where}: {key} cannot be set here: {OWNED_KEYS[key]}")
    rest = [item for item in items if item.partition("=")[0].strip() not in OWNED_KEYS]
    if rest:
        try:
            load_sections(None, rest, SECTIONS)
        except ConfigError as e:
            problems += [f"{where}: {p.removeprefix('command line: ')}" for p in e.problems]
    return problems


def _grid(value: Any, where: str, problems: list[str]) -> tuple[tuple[str, tuple], ...]:
    if isinstance(value, str):
        if value not in GRID_PRESETS:
            close = difflib.get_close_matches(value, list(GRID_PRESETS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}: unknown grid preset {value!r}{hint}; presets: {', '.join(GRID_PRESETS)}")
            return ()
        return tuple((k, tuple(v)) for k, v in GRID_PRESETS[value].items())
    if value is None:
        return ()
    if not isinstance(value, dict):
        problems.append(f"{where} must be a preset name ({', '.join(GRID_PRESETS)}) or a mapping of dotted "
                        f"fine-tuning key -> list of values, got {_desc(value)}")
        return ()
    grid = []
    for key, values in value.items():
        key = str(key)
        problem = _key_problem(key, where, NOT_GRID_KEYS)
        if problem:
            problems.append(problem)
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"{where}: {key} must be a non-empty list of values, got {_desc(values)}")
            continue
        section, _, name = key.partition(".")
        checked = []
        for v in values:
            clean, type_problems = check_tree({section: {name: v}}, where, SECTIONS)
            if type_problems:
                problems += type_problems
            else:
                checked.append(_frozen(clean[section][name]))
        if len(set(map(repr, checked))) != len(checked):
            problems.append(f"{where}: {key} lists a value twice: {values}")
            continue
        if len(checked) == len(values):
            grid.append((key, tuple(checked)))
    return tuple(grid)


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _apply_overrides(tree: dict, overrides: Sequence[str], problems: list[str]) -> None:
    for item in overrides:
        parsed = split_override(item, lambda parts: len(parts) >= 2 and parts[0] == "sweep", "sweep.KEY=value")
        if isinstance(parsed, str):
            problems.append(parsed)
            continue
        parts, value = parsed
        name, rest = parts[1], ".".join(parts[2:])
        if rest and name in ("grid", "task_overrides"):
            current = tree.get(name)
            if not isinstance(current, dict):  # a preset (or nothing) replaced by explicit keys
                current = ({k: list(v) for k, v in GRID_PRESETS[current].items()}
                           if name == "grid" and current in GRID_PRESETS else {})
            tree[name] = {**current, rest: value}
        elif rest:
            problems.append(f"command line: malformed override {item!r}: sweep.{name} has no sub-keys")
        else:
            tree[name] = value


def load_sweep_spec(path: str | None, overrides: Sequence[str] = ()) -> SweepSpec:
    """The spec of a YAML file (or none) with dotted ``sweep.KEY=value`` overrides; a ConfigError
    with every problem, one line each, naming the key."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'sweep.key=value' strings, not one string")
    problems: list[str] = []
    data = _read_yaml(path) if path is not None else {}
    source = path or "command line"
    for section in data:
        if section != "sweep":
            problems.append(f"{source}: unknown section {section!r}; a sweep config has one section, 'sweep'")
    tree = data.get("sweep") or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: section 'sweep' must be a mapping, got {_desc(tree)}")
    tree = dict(tree)
    _apply_overrides(tree, overrides, problems)
    for key in tree:
        if key not in SWEEP_KEYS:
            close = difflib.get_close_matches(str(key), SWEEP_KEYS, n=1)
            hint = f" (did you mean 'sweep.{close[0]}'?)" if close else ""
            problems.append(f"{source}: unknown key 'sweep.{key}'{hint}; valid keys: {', '.join(SWEEP_KEYS)}")

    tasks = tree.get("tasks")
    if tasks == "glue":
        tasks = list(GLUE)
    elif isinstance(tasks, str):
        tasks = [tasks]
    if not _is_str_list(tasks) or not tasks:
        problems.append(f"sweep.tasks must be 'glue' or a non-empty list of task names, got {_desc(tree.get('tasks'))}")
        tasks = []
    else:
        expanded: list[str] = []
        for t in tasks:
            for name in (GLUE if t == "glue" else (t,)):
                if name == "ax":
                    problems.append("sweep.tasks: ax has no trials of its own: MNLI's selected model predicts it")
                elif name not in TASK_NAMES:
                    close = difflib.get_close_matches(name, TASK_NAMES, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    problems.append(f"sweep.tasks: unknown task {name!r}{hint}; tasks: glue, {', '.join(TASK_NAMES)}")
                elif name in expanded:
                    problems.append(f"sweep.tasks: {name} is listed twice")
                else:
                    expanded.append(name)
        tasks = expanded

    grid = _grid(tree.get("grid"), "sweep.grid", problems)

    restarts, first_seed = tree.get("restarts", 1), tree.get("first_seed", 42)
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 1:
        problems.append(f"sweep.restarts must be an int >= 1, got {_desc(restarts)}")
    if not isinstance(first_seed, int) or isinstance(first_seed, bool) or first_seed < 0:
        problems.append(f"sweep.first_seed must be an int >= 0, got {_desc(first_seed)}")
    output_dir = tree.get("output_dir")
    if not isinstance(output_dir, str) or not output_dir:
        problems.append(f"sweep.output_dir is required: the directory the trials run in, got {_desc(output_dir)}")
    data_root = tree.get("data_root")
    if data_root is not None and (not isinstance(data_root, str) or not data_root):
        problems.append(f"sweep.data_root must be a directory path or null, got {_desc(data_root)}")

    common = tree.get("overrides") or []
    problems += _override_problems(common, "sweep.overrides")
    per_task = tree.get("task_overrides") or {}
    if not isinstance(per_task, dict):
        problems.append(f"sweep.task_overrides must be a mapping of task -> list of overrides, got {_desc(per_task)}")
        per_task = {}
    for task, items in per_task.items():
        if task not in tasks:
            problems.append(f"sweep.task_overrides.{task}: {task} is not one of sweep.tasks ({', '.join(tasks)})")
        problems += _override_problems(items, f"sweep.task_overrides.{task}")
    grid_keys = {k for k, _ in grid}
    for where, items in [("sweep.overrides", common), *((f"sweep.task_overrides.{t}", i) for t, i in per_task.items())]:
        for item in items if _is_str_list(items) else []:
            key = item.partition("=")[0].strip()
            if key in grid_keys:
                problems.append(f"{where}: {key} is also a grid key (sweep.grid): give it in one place")

    ranks, at_once = tree.get("ranks_per_trial", 1), tree.get("parallel_trials")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        problems.append(f"sweep.ranks_per_trial must be an int >= 1, got {_desc(ranks)}")
    if at_once is not None and (not isinstance(at_once, int) or isinstance(at_once, bool) or at_once < 1):
        problems.append(f"sweep.parallel_trials must be an int >= 1 or null (by the devices), got {_desc(at_once)}")
    for task, items in per_task.items():
        for item in items if _is_str_list(items) else []:
            if item.partition("=")[0].strip().startswith("parallel."):
                problems.append(f"sweep.task_overrides.{task}: {item.partition('=')[0].strip()} cannot differ by "
                                "task: every trial runs on process groups started once; set it in sweep.overrides")
    for key in grid_keys:
        if key.startswith("parallel."):
            problems.append(f"sweep.grid: {key} cannot be a grid key: every trial runs on process groups of "
                            "sweep.ranks_per_trial started once; set it in sweep.overrides")

    if problems:
        raise ConfigError(problems)
    return SweepSpec(tasks=tuple(tasks), grid=grid, output_dir=output_dir, restarts=restarts, first_seed=first_seed,
                     data_root=data_root, overrides=tuple(common),
                     task_overrides={t: tuple(i) for t, i in per_task.items()}, ranks_per_trial=ranks,
                     parallel_trials=at_once)
