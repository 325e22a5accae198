"""Rank entry point: the optimizer groups BERT-base's parameters are stepped in, by name.

usage: python tests/_groups_worker.py OUT.json TP ZERO_STAGE
Builds the trainer for configs/bert-base.yaml (no step is taken) and writes, from the logging
rank, every rank's {Hugging Face name: [weight decay, layer adaptation]} and layout sizes.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from _train_worker import layout_report  # noqa: E402
from pretrain.distributed import device  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


def main():
    out_path, tp, stage = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, tp, 1, timeout_minutes=3)
    cfg = load_config("configs/bert-base.yaml", [
        f"parallel.tensor_parallel={tp}", f"parallel.zero_stage={stage}", "data.kind=synthetic",
        "data.seq_length=32", "data.max_predictions_per_seq=5", "train.global_batch_size=4",
        "train.micro_batch_size=1", "logging.tensorboard_dir=null", "checkpoint.save_dir=null"])
    cfg.validate(world_size=parallel.world_size)
    trainer = Trainer(cfg, parallel)
    reports = device.all_gather_object(layout_report(trainer, parallel))
    if parallel.rank == parallel.logging_rank:
        with open(out_path, "w") as f:
            json.dump({"ranks": reports, "weight_decay": cfg.optimizer.weight_decay,
                       "no_weight_decay": cfg.optimizer.no_weight_decay}, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
