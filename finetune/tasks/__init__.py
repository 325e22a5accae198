"""The fine-tuning tasks by the name the config gives (task.name): a registry that imports no task
module, and so no torch, until a task is asked for (`python -m finetune --help`, a misspelt task and
the config's name check answer at once). One module per kind:

- glue.py: sentence(-pair) classification and STS-B regression (cola sst2 mrpc stsb qqp mnli qnli rte wnli);
- swag.py: multiple choice (swag);
- squad.py: span extraction (squad: SQuAD 1.1, squad2: SQuAD 2.0);
- ner.py: token classification (conll2003: CoNLL-2003 named entities), reading tagging.py's files;
- base.py: the Task interface the trainer calls, and what the kinds share.

A new kind is one more module with a Task subclass and a dict of its tasks by name, and its names
added to WHERE below: the one list of task names. The metric definitions stay importable on their
own (finetune/glue_metrics.py, finetune/squad_metrics.py, finetune/ner_metrics.py):
tools/evaluate_squad.py uses the official SQuAD evaluation without torch or the tasks.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:  # annotations only: the task modules are imported when a task is asked for
    from .base import Task

GLUE = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
# task name -> (the module of this package that defines it, that module's dict of tasks by name),
# in the command line's order
WHERE: Mapping[str, tuple[str, str]] = {
    **{name: ("glue", "GLUE_TASKS") for name in GLUE},
    "swag": ("swag", "SWAG_TASKS"),
    "squad": ("squad", "SQUAD_TASKS"),
    "squad2": ("squad", "SQUAD_TASKS"),
    "conll2003": ("ner", "NER_TASKS"),
}
TASK_NAMES: tuple[str, ...] = tuple(WHERE)


class _Tasks(Mapping):
    """name -> Task; a kind's module is imported when its first task is asked for."""

    def __getitem__(self, name: str) -> Task:
        module, tasks = WHERE[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), tasks)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(TASK_NAMES)

    def __len__(self) -> int:
        return len(TASK_NAMES)


TASKS: Mapping[str, Task] = _Tasks()
