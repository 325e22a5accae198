"""Rank entry point: ModernBERT fine-tuning runs, with what a test compares against transformers.

usage: python tests/_finetune_modern_worker.py OUT.json TENSOR_PARALLEL RUN_JSON...
Each RUN_JSON is {"name", "task", "overrides"}; runs go in order (a run may start from an earlier
one's export). For each, one Finetuner is built, its head's starting weights and its dev logits
before training are recorded, it trains (keeping the best epoch's export in train.output_dir/best)
and the logging rank records: the losses, the metrics, the dev inputs it was given and its dev
logits after training (padding positions of token-level logits are zeros), the head's layout.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from finetune.config import load_finetune_config  # noqa: E402
from finetune.finetuner import Finetuner  # noqa: E402
from finetune.tasks import TASKS  # noqa: E402
from _train_worker import finish  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402


def dev_record(runner) -> dict:
    dev = runner.dev_sets[0]
    f = dev.features
    return {"name": dev.name, "input_ids": f.input_ids.tolist(), "token_type_ids": f.token_type_ids.tolist(),
            "attention_mask": f.attention_mask.tolist(), "lengths": f.lengths.tolist()}


def main():
    out_path, tensor_parallel, runs = sys.argv[1], int(sys.argv[2]), [json.loads(arg) for arg in sys.argv[3:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, tensor_parallel, 1, timeout_minutes=5)
    results = {}
    for run in runs:
        cfg = load_finetune_config(None, [f"task.name={run['task']}", "train.progress=false", *run["overrides"]])
        cfg.validate(launch.world_size, TASKS)
        runner = Finetuner(cfg, parallel)
        dev = runner.dev_sets[0]
        head = {name: param.detach().tolist() for name, param in runner.model.head.named_parameters()}
        before = runner.outputs(dev.features).tolist()
        summary = runner.train()
        after = runner.outputs(dev.features).tolist()
        encoder = runner.model.bert
        results[run["name"]] = {
            "tp": parallel.tp_size, "architecture": runner.task.exported_architecture(runner.model_cfg),
            "pooling": runner.model_cfg.classifier_pooling, "head_before": head, "logits_before": before,
            "logits": after, "dev": dev_record(runner), "summary": summary,
            "local_qkv_rows": [tuple(p.shape) for n, p in encoder.named_parameters() if n.endswith("attn_qkv.weight")][0],
        }
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
