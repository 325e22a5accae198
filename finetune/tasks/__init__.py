"""The fine-tuning tasks by the name the config gives (task.name), one module per kind:

- glue.py: sentence(-pair) classification and STS-B regression (cola sst2 mrpc stsb qqp mnli qnli rte wnli);
- swag.py: multiple choice (swag);
- squad.py: span extraction (squad: SQuAD 1.1, squad2: SQuAD 2.0);
- ner.py: token classification (conll2003: CoNLL-2003 named entities), reading tagging.py's files;
- base.py: the Task interface the trainer calls, and what the kinds share.

A new kind is one more module with a Task subclass, and its tasks added here. The metric
definitions stay importable on their own (finetune/glue_metrics.py, finetune/squad_metrics.py,
finetune/ner_metrics.py):
tools/evaluate_squad.py uses the official SQuAD evaluation without torch or the tasks.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .base import Task
from .glue import GLUE_TASKS
from .ner import NER_TASKS
from .squad import SQUAD_TASKS
from .swag import SWAG

TASKS: Mapping[str, Task] = MappingProxyType({**GLUE_TASKS, SWAG.name: SWAG, **SQUAD_TASKS, **NER_TASKS})
