"""Rank entry point: contrastive training runs (finetune/embedding/trainer.py) in one process group.

usage: python tests/_embed_worker.py OUT.json TENSOR_PARALLEL RUN_JSON...
Each RUN_JSON is {"name", "overrides", "texts"}; runs go in order. For each, a ContrastiveTrainer is
built and trained (its export written to train.output_dir/best when train.keep_best), and the
logging rank records: the per-step losses, the encoder's whole weights after training (TP shards
gathered), the embeddings of `texts` after training (the trainer's own evaluation path), and what
shows the layout, caching and precision took effect: the TP/DP sizes, the local shape of the first
tensor-parallel weight, the rows the texts take (packed or padded), DeepSpeed's accumulation steps
and ZeRO stage, the engine's parameter dtype.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()

from finetune.embedding.config import load_embed_config  # noqa: E402
from finetune.embedding.trainer import ContrastiveTrainer  # noqa: E402
from finetune.finetuner import gathered_encoder_weights  # noqa: E402
from _train_worker import finish  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel  # noqa: E402
from pretrain.model.names import logical_parameters  # noqa: E402


def main():
    out_path, tensor_parallel, runs = sys.argv[1], int(sys.argv[2]), [json.loads(arg) for arg in sys.argv[3:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, tensor_parallel, 1, timeout_minutes=5)
    results = {}
    for run in runs:
        cfg = load_embed_config(None, ["train.progress=false", *run["overrides"]])
        cfg.validate(launch.world_size)
        trainer = ContrastiveTrainer(cfg, parallel)
        try:
            summary = trainer.train()
            weights = gathered_encoder_weights(trainer.model.bert, trainer.model_cfg, parallel)
            embeddings = trainer.embed_texts(run["texts"]).tolist()
            engine = trainer.engine
            sharded = next(lp for lp in logical_parameters(trainer.model.bert)  # a layer's (not the padded vocabulary)
                           if lp.tp_partition_dim is not None and ".layer" in lp.hf_name)
            results[run["name"]] = {
                "tp": parallel.tp_size, "dp": parallel.dp_size, "losses": summary["train_losses"],
                "history": summary["history"], "embeddings": embeddings,
                "weights": {name: tensor.flatten().tolist() for name, tensor in weights.items()},
                "accumulation_steps": engine.gradient_accumulation_steps(),
                "zero_stage": engine.zero_optimization_stage(), "dtype": str(next(engine.module.parameters()).dtype),
                "sharded": [sharded.hf_name, list(sharded.param.shape)], "cached": trainer.random_state is not None,
                "probe_rows": trainer._inputs(run["texts"])[0].shape[0],  # 1 packed, one per text padded
            }
        finally:
            trainer.close()
    finish(parallel, out_path, results)


if __name__ == "__main__":
    main()
