"""Rank entry point for multi-process tests: train one or more configs, write per-step metrics.

usage: python tests/_train_worker.py OUT.json TP PP RUN_JSON...
Each RUN_JSON is {"name": ..., "overrides": [...]} applied on top of tests' tiny config, with
optional "evaluate": true (evaluation metrics after training), "expect_error": true (a run the
trainer must refuse: its error message is recorded, and the job goes on), "per_shard": true (the
negative control: LAMB trust ratios, or StableAdamW's RMS terms, of whatever tensor each rank
steps, not of whole parameters)
and "tp"/"pp"/"cp" (this run's layout instead of TP PP and CP 1: the process group stays, the
TP/CP/PP/DP groups are built anew, so one job runs several layouts of its world size and starts
its processes once).
The logging rank writes, per run: the per-step metrics, the params norm, where it ran, what
every rank reports of its layout and optimizer groups (what proves the layout took effect), and
the lines the trainer logged.
"""
import json
import os
import sys
import time

# The heavy imports are inside the functions: a loader process started from the forkserver runs
# the main script again (multiprocessing's preparation of __main__), which must stay cheap.
# `python -m pretrain` is exempt (a package's __main__ is not run again).

TINY = [
    "model.vocab_size=200", "model.hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
    "model.max_position_embeddings=64", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
    "data.seq_length=32", "data.max_predictions_per_seq=5", "data.num_samples=100000",
    "train.global_batch_size=8", "train.micro_batch_size=2", "train.train_steps=5", "logging.interval=1",
    "train.seed=7", "scheduler.warmup_steps=2", "scheduler.decay=linear", "optimizer.lr=0.01",
    "optimizer.grad_clip=1.0", "resilience.dist_timeout_minutes=3",
    # batches built inline: the loader processes' own tests (layouts, signals, hangs, failures,
    # test_bert_dataset) set data.num_workers=2, the default; everywhere else they only cost start-up
    "data.num_workers=0",
]


def where_it_ran(trainer, parallel) -> dict:
    """What proves the device took effect: the rank's device and backend, and where the model's
    parameters (ZeRO-3: their partitions) and the optimizer's tensors actually live."""
    from pretrain.distributed import internals
    from pretrain.optim.layout import layout_for_deepspeed

    params = [internals.zero3_partition(p) if internals.is_zero3_param(p) else p for p in trainer.model.parameters()]
    stepped = [tensor for tensor, _ in layout_for_deepspeed(trainer.engine).entries()]
    return {"device": str(parallel.device), "backend": parallel.backend,
            "parameters": sorted({str(p.device) for p in params}),
            "optimizer_tensors": sorted({str(t.device) for t in stepped})}


def layout_report(trainer, parallel) -> dict:
    """This rank's view of the layout, from the libraries themselves, not from our config: the
    sizes megatron-core and DeepSpeed work with, what the rank holds, the optimizer wrapper."""
    from megatron.core import parallel_state as ps

    from pretrain.distributed import internals
    from pretrain.model.names import logical_parameters
    from pretrain.optim.norms import counted_once

    engine = trainer.engine
    params = list(trainer.model.parameters())
    zero3 = [p for p in params if internals.is_zero3_param(p)]
    return {
        "rank": parallel.rank, "tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank,
        "cp_rank": parallel.cp_rank, "megatron_cp_size": ps.get_context_parallel_world_size(),
        "tokens_computed": getattr(trainer, "tokens_seen_by_layers", None),
        "input_tokens": getattr(trainer, "input_tokens", None),
        "ring_calls": getattr(trainer, "ring_calls", None),
        "megatron_tp_size": ps.get_tensor_model_parallel_world_size(),
        "deepspeed_dp_size": engine.dp_world_size,
        "deepspeed_stages": engine.num_stages if trainer.pipelined else 1,
        "deepspeed_stage_id": engine.stage_id if trainer.pipelined else 0,
        # elements of the parameters this rank holds (ZeRO-3: of its partitions)
        "local_elements": sum(internals.zero3_partition(p).numel() if internals.is_zero3_param(p) else p.numel()
                              for p in params),
        # the same for the logical parameters a whole-model sum counts on this rank: over the
        # ranks of one data-parallel replica they add up to the whole model, in any layout
        "counted_elements": sum(internals.full_shape(lp.param).numel() for lp in counted_once(trainer.model, parallel)),
        "zero3_parameters": len(zero3),
        "zero3_partitioned": sum(internals.zero3_partition(p).numel() < internals.full_shape(p).numel() for p in zero3),
        "optimizer_wrapper": type(engine.optimizer).__name__,
        "parameter_dtypes": ",".join(sorted({str(p.dtype) for p in params})),
        "optimizer_groups": optimizer_groups_by_name(trainer),
        "logical_names": [lp.hf_name for lp in logical_parameters(trainer.model)],
    }


def optimizer_groups_by_name(trainer) -> dict:
    """{Hugging Face name: [weight_decay, layer_adaptation]} of the optimizer group that actually
    steps each parameter this rank holds, read through the wrappers (ZeRO flat groups: through
    the layout's map from flat segments back to parameters)."""
    from pretrain.model.names import logical_parameters
    from pretrain.optim.layout import layout_for_deepspeed, stepped_tensors_by_group

    names = {id(lp.param): lp.hf_name for lp in logical_parameters(trainer.model)}
    layout = layout_for_deepspeed(trainer.engine)
    found = {}
    for tensor, group in stepped_tensors_by_group(trainer.engine):
        for segment in layout.segments_for(tensor):
            param = layout.params[segment.logical_index] if layout.params else tensor
            found[names[id(param)]] = [group["weight_decay"], group.get("layer_adaptation")]
    return found


def use_per_shard_norms(trainer) -> None:
    """The negative control of the layout tests: each stepped tensor (a TP shard, a ZeRO
    partition) taken for a whole parameter, as a LAMB or StableAdamW unaware of the layout would."""
    from pretrain.optim import Lamb, StableAdamW
    from pretrain.optim.layout import layout_for_params

    client = trainer.engine.basic_optimizer
    assert isinstance(client, (Lamb, StableAdamW)), type(client).__name__
    client.set_layout(layout_for_params([g["params"] for g in client.param_groups], tp_group=None))


def log_lines(parallel) -> list[str]:
    """The library's log messages from now on (pretrain.*) until the next call, as the programs
    show them: the logging rank's information, every rank's warnings."""
    import logging

    lines = []

    class Collect(logging.Handler):
        collects = True

        def emit(self, record):
            lines.append(record.getMessage())

    library = logging.getLogger("pretrain")
    for old in [h for h in library.handlers if getattr(h, "collects", False)]:
        library.removeHandler(old)  # the previous run's list is complete
    library.addHandler(Collect())
    library.setLevel(logging.INFO if parallel.rank == parallel.logging_rank else logging.WARNING)
    return lines


def main():
    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()  # the known noise only: anything new shows up in the test run
    from pretrain.distributed import device
    from pretrain.config import load_config
    from pretrain.distributed.parallel import discover_launch_env, init_parallel
    from pretrain.training.trainer import Trainer

    out_path, job_tp, job_pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    runs = [json.loads(arg) for arg in sys.argv[4:]]
    launch = discover_launch_env()
    launch.export_to(os.environ)  # DeepSpeed reads LOCAL_RANK and the master address there
    results, parallel, layout = {}, None, None
    for run in runs:
        started = time.perf_counter()
        tp, pp, cp = run.get("tp", job_tp), run.get("pp", job_pp), run.get("cp", 1)
        if (tp, pp, cp) != layout:
            parallel, layout = init_parallel(launch, tp, pp, timeout_minutes=3, context_parallel=cp), (tp, pp, cp)
        cfg = load_config(None, TINY + [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}",
                                        f"parallel.context_parallel={cp}"] + run["overrides"])
        cfg.validate(world_size=parallel.world_size)
        lines = log_lines(parallel)
        trainer = Trainer(cfg, parallel)
        count_layer_tokens(trainer)
        if run.get("per_shard"):
            use_per_shard_norms(trainer)
        try:
            history = trainer.train()
        except Exception as error:  # noqa: BLE001 (a run that must be refused: its message is the result)
            if not run.get("expect_error"):
                raise
            results[run["name"]] = {"error": str(error), "log": lines}
            trainer.close_loaders()
            continue
        results[run["name"]] = {"history": history, "params_norm": trainer.params_norm(),
                                "device": where_it_ran(trainer, parallel),
                                "ranks": device.all_gather_object(layout_report(trainer, parallel)),
                                "log": lines, "memory": trainer.first_step_memory}
        if run.get("evaluate"):
            results[run["name"]]["evaluation"] = trainer.evaluate()
        trainer.close_loaders()  # the evaluation's loader processes (training closed its own)
        results[run["name"]]["seconds"] = time.perf_counter() - started  # where a job's time goes
    finish(parallel, out_path, results)


def count_layer_tokens(trainer) -> None:
    """trainer.input_tokens: the tokens of the rows this rank's embedding stage was given (rows x
    seq_length, padding included), summed over the run (what proves packing took effect: fewer
    rows for the same samples). ModernBERT: [tokens this rank's first encoder layer computed,
    tokens of the rows it was given, documents in them, forwards] summed over the run, as
    trainer.tokens_seen_by_layers (what proves a context-parallel split took effect: each rank
    computes its share of the row)."""
    embedding = [m for m in trainer.model.modules() if type(m).__name__ in ("EmbeddingTail", "EmbeddingNorm")]
    if embedding:
        trainer.input_tokens = 0

        def count_input(_module, inputs):
            trainer.input_tokens += inputs[0][2].numel()  # the padding mask or the packed rows' sample ids

        embedding[0].register_forward_pre_hook(count_input)
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "ModernLayer"]
    if not layers:
        return
    trainer.tokens_seen_by_layers = [0, 0, 0, 0]

    def count(_module, inputs):
        hidden, sample_ids = inputs[0][0], inputs[0][1]
        trainer.tokens_seen_by_layers[0] += hidden.shape[1]
        trainer.tokens_seen_by_layers[1] += sample_ids.shape[1]
        trainer.tokens_seen_by_layers[2] += len(sample_ids.unique_consecutive())
        trainer.tokens_seen_by_layers[3] += 1

    layers[0].register_forward_pre_hook(count)
    # the global layers' ring attention (parallel.context_attention: ring), counted where it is called
    from pretrain.model import context_parallel

    trainer.ring_calls, ring = 0, context_parallel.ring_attention

    def counted_ring(*args, **kwargs):
        trainer.ring_calls += 1
        return ring(*args, **kwargs)

    context_parallel.ring_attention = counted_ring


def finish(parallel, out_path: str, results: dict) -> None:
    """The logging rank writes the results; every rank leaves the process groups."""
    from pretrain.distributed.parallel import shutdown_parallel

    if parallel.rank == parallel.logging_rank:
        with open(out_path, "w") as f:
            json.dump(results, f)
    shutdown_parallel()


if __name__ == "__main__":
    main()
