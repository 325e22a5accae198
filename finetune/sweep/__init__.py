"""The BERT paper's fine-tuning protocol over `python -m finetune` (issue 42), as pure, process-free
parts a runner drives:

- spec.py: the sweep spec (tasks x a grid over fine-tuning keys x N random restarts), loaded from
  YAML with dotted overrides and validated up front (`load_sweep_spec`);
- trials.py: the trials a spec expands to (`expand`), each one `python -m finetune TASK` with its
  overrides, and the trial.json record a runner writes in a trial's directory;
- manifest.py: the sweep directory's sweep.json (a relaunch must keep the fixed settings);
- selection.py: each task's official dev metric and the selected trial (`select`);
- table.py: the results in the paper's Table 1 layout (Markdown, CSV, JSON; `write_results`);
- bundle.py: the GLUE leaderboard zip and the SQuAD/SWAG prediction files of the selected runs;
- runner.py and worker.py: the processes that run the trials.

Importing this package imports nothing heavy (no torch): the modules are imported by name.
"""
