"""Rank entry point for multi-process tests: train one or more configs, write per-step metrics.

usage: python tests/_train_worker.py OUT.json TP PP RUN_JSON...
Each RUN_JSON is {"name": ..., "overrides": [...]} applied on top of tests' tiny config.
The logging rank writes {name: [per-step metrics]} to OUT.json.
"""
import json
import sys
import warnings

warnings.filterwarnings("ignore")

from pretrain.config import load_config  # noqa: E402
from pretrain.parallel import init_parallel, shutdown_parallel  # noqa: E402
from pretrain.training import Trainer  # noqa: E402

TINY = [
    "model.vocab_size=200", "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
    "model.max_position_embeddings=64", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
    "data.seq_length=32", "data.max_predictions_per_seq=5", "data.num_samples=100000",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_steps=5", "train.log_interval=1",
    "train.seed=7", "scheduler.warmup_steps=2", "scheduler.decay=linear", "optimizer.lr=0.01",
    "optimizer.grad_clip=1.0", "train.dist_timeout_minutes=3",
]


def where_it_ran(trainer, parallel) -> dict:
    """What proves the device took effect: the rank's device and backend, and where the model's
    parameters (ZeRO-3: their partitions) and the optimizer's tensors actually live."""
    from pretrain import device
    from pretrain.optim.layout import layout_for_deepspeed

    params = [device.zero3_partition(p) if device.is_zero3_param(p) else p for p in trainer.model.parameters()]
    stepped = [tensor for tensor, _ in layout_for_deepspeed(trainer.engine).entries()]
    return {"device": str(parallel.device), "backend": parallel.backend,
            "parameters": sorted({str(p.device) for p in params}),
            "optimizer_tensors": sorted({str(t.device) for t in stepped})}


def main():
    out_path, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    runs = [json.loads(arg) for arg in sys.argv[4:]]
    parallel = init_parallel(tp, pp, timeout_minutes=3)
    results = {}
    for run in runs:
        cfg = load_config(None, TINY + [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"] + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        trainer = Trainer(cfg, parallel, log=lambda *a, **k: None)
        history = trainer.train()
        results[run["name"]] = {"history": history, "params_norm": trainer.params_norm(),
                                "device": where_it_ran(trainer, parallel)}
    if parallel.rank == parallel.logging_rank:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
