"""Rank entry point: a task's dev (and test) outputs with train.padding max_length and longest.

usage: python tests/_finetune_padding_worker.py OUT.json RUN_JSON...
Each RUN_JSON is {"name", "task", "overrides"}; for each run one Finetuner (eval only, the
checkpoint as it is) evaluates every dev set and predicts every test set twice, padding every
batch to task.max_seq_length and then to its longest example, and the logging rank records both:
metrics, the prediction and submission files, the logits, and the tokens the model was given.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from finetune.config import load_finetune_config  # noqa: E402
from finetune.finetuner import Finetuner  # noqa: E402
from finetune.tasks import TASKS  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402


def outputs_of(runner) -> dict:
    """Everything an evaluation and a prediction produce, and the input tokens they took."""
    seen = {"tokens": 0}

    def count(module, args):
        seen["tokens"] += args[0].numel()

    hook = runner.model.register_forward_pre_hook(count)
    result = {"metrics": runner.evaluate_all(epoch=0)["metrics"], "files": dict(runner.pending_files), "logits": {},
              "lengths": {}}
    for dataset in runner.dev_sets + runner.test_sets:
        result["logits"][dataset.name] = runner.outputs(dataset.features).tolist()
        result["lengths"][dataset.name] = dataset.features.lengths.tolist()
    for test in runner.test_sets:
        result["files"].update(runner.task.submission_files(test, runner.outputs(test.features), runner.cfg.task))
    hook.remove()
    result["tokens"] = seen["tokens"]
    return result


def main():
    out_path, runs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, 1, 1, timeout_minutes=3)  # data parallel over every rank
    results = {}
    for run in runs:
        cfg = load_finetune_config(None, [f"task.name={run['task']}", "train.eval_only=true", "train.progress=false",
                                          "train.padding=max_length", *run["overrides"]])
        cfg.validate(launch.world_size, TASKS)
        runner = Finetuner(cfg, parallel)
        fixed = outputs_of(runner)
        runner.cfg.train.padding = "longest"
        results[run["name"]] = {"max_length": fixed, "longest": outputs_of(runner), "dp": parallel.dp_size}
    if parallel.rank == parallel.logging_rank:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
