"""Rank entry point for the loss-spike tests: train runs in several layouts with a spike injected,
report what happened.

usage: python tests/_spike_worker.py OUT.json RUN_JSON...
RUN_JSON: {"name": ..., "layout": [tp, pp], "overrides": [...], "poisons": [...] (as _guard_worker's),
"latest": TAG (optional: point the run's load_dir `latest` at this tag first)}
Per run the logging rank writes the per-step metrics, the parameter norm after every step, each
parameter's checksums at the end (every rank's, by Hugging Face name), the skipped steps and the
error, if any.
"""
import json
import os
import sys

import torch

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from _guard_worker import build  # noqa: E402
from _train_worker import TINY, finish  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed import device  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.model.names import logical_parameters  # noqa: E402
from pretrain.observability.console import configure_logging  # noqa: E402


def checksums(trainer) -> dict:
    """Per parameter of this rank: sum, sum of squares, and a position-weighted sum (catches moves)."""
    out = {}
    for lp in logical_parameters(trainer.model):
        w = lp.param.detach().double().flatten()
        out[f"{lp.hf_name}@tp{trainer.parallel.tp_rank}"] = [
            w.sum().item(), (w * w).sum().item(), (w * torch.arange(w.numel(), dtype=torch.float64)).sum().item()]
    return out


def main():
    out_path, runs = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)
    results, parallel, layout = {}, None, None
    for run in runs:
        if tuple(run["layout"]) != layout:
            layout = tuple(run["layout"])
            parallel = init_parallel(launch, *layout, timeout_minutes=3)
            configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)  # the log is looked at
        cfg = load_config(None, TINY + [f"parallel.tensor_parallel={layout[0]}",
                                        f"parallel.pipeline_parallel={layout[1]}"] + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        if run.get("latest"):
            temp = os.path.join(cfg.checkpoint.load_dir, f"latest.tmp{parallel.rank}")
            with open(temp, "w") as f:
                f.write(run["latest"])
            os.replace(temp, os.path.join(cfg.checkpoint.load_dir, "latest"))
        device.barrier()
        trainer = build(cfg, parallel, run.get("poisons", []))
        norms = []
        result = {"norms": norms}
        try:
            trainer.train(after_step=lambda step: norms.append(trainer.params_norm()))
        except Exception as error:
            result["error"] = [type(error).__name__, str(error)]
        result["history"] = [{k: h[k] for k in ("loss", "learning_rate", "skipped_steps")} for h in trainer.history]
        result["skipped_steps"] = trainer.steps_skipped
        result["skipped_samples"] = trainer.spikes.state()["skipped_samples"]
        result["steps"] = trainer.step
        merged = {}
        for part in device.all_gather_object(checksums(trainer)):
            merged.update(part)
        result["weights"] = merged
        results[run["name"]] = result
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
