"""Rank entry point for checkpoint-interop tests: train or load, then the model's outputs.

usage: python tests/_interop_worker.py OUT.pt TP PP RUN_JSON...
Each RUN_JSON is {"name", "overrides", "train": bool, "encode": bool} on top of tests' tiny
config (tests/_train_worker.py). With "train" the run trains (and saves, if checkpoint.save_dir is
set); otherwise it only loads (checkpoint.load_dir / checkpoint.init_from). Then it computes, in its own
layout, the MLM logits at the masked positions (gathered over the vocabulary shards) and the NSP
logits of a fixed batch, and with "encode" (pipeline_parallel 1 only) BertModel's outputs. One
rank of the last stage writes {name: {history, inputs, mlm, nsp[, hidden, pooled]}} to OUT.pt.
"""
import json
import os
import sys

from pretrain.common.quiet import hide_library_warnings

hide_library_warnings()  # the known noise only: anything new shows up in the test run

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _train_worker import TINY  # noqa: E402
from pretrain.config import load_config  # noqa: E402
from pretrain.data.samples.batches import collate, split_inputs_labels  # noqa: E402
from pretrain.data.samples.synthetic import SyntheticDataset  # noqa: E402
from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel  # noqa: E402
from pretrain.observability.console import configure_logging  # noqa: E402
from pretrain.training.trainer import Trainer  # noqa: E402


def fixed_batch(cfg, device):
    data = SyntheticDataset(cfg.model.vocab_size, cfg.data.seq_length, cfg.data.max_predictions_per_seq, 64, seed=99)
    return split_inputs_labels(collate([data[i] for i in range(cfg.train.micro_batch_size)]), device)


@torch.no_grad()
def outputs(trainer, inputs, labels, encode: bool) -> dict:
    engine, p = trainer.engine, trainer.parallel
    engine.eval()
    result = {}
    if p.pp_size > 1:
        _, logits = engine.eval_batch(iter([(inputs, labels)] * trainer.grad_accum), return_logits=True,
                                      bcast_loss=False)
        if not p.is_last_stage:
            return {}
        mlm, nsp = logits
    else:
        mlm, nsp = engine(inputs)
        if encode:
            result["hidden"], result["pooled"] = trainer.model.encode(inputs)
    pieces = [torch.empty_like(mlm) for _ in range(p.tp_size)]
    dist.all_gather(pieces, mlm.contiguous(), group=p.tp_group)
    result.update(mlm=torch.cat(pieces, dim=-1)[..., : trainer.cfg.model.vocab_size], nsp=nsp)
    return result


def main():
    out_path, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    parallel = init_parallel(launch, tp, pp, timeout_minutes=3)
    configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)  # as the programs show them
    results = {}
    for run in map(json.loads, sys.argv[4:]):
        cfg = load_config(None, TINY + [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
                          + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        trainer = Trainer(cfg, parallel)
        history = trainer.train() if run.get("train", True) else (trainer.resume() or [])
        inputs, labels = fixed_batch(cfg, parallel.device)
        results[run["name"]] = {"history": history, "inputs": inputs,
                                **outputs(trainer, inputs, labels, run.get("encode", False))}
    if parallel.is_last_stage and parallel.tp_rank == 0 and parallel.dp_rank == 0:
        torch.save(results, out_path)
    shutdown_parallel()


if __name__ == "__main__":
    main()
