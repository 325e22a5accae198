"""The fine-tuning tasks' names, importable without torch: the command line's choices (so that
`python -m finetune --help` and a misspelt task answer at once). finetune/tasks/__init__.py's
TASKS has exactly these keys, in this order (tests/test_cli.py holds them together)."""

TASK_NAMES = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli", "swag", "squad", "squad2",
              "conll2003")
