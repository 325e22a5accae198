"""The planner's step-time order against measured steps: one process, DP2, TP2 and PP2 (8
micro-batches) at equal cores on this machine.

usage: python tools/benchmarks/layouts.py [--config mini] [--seq 128] [--micro-batch 4]
                                          [--global-batch 32] [--steps 5] [--warmup 2] [--json out.json]

Each layout trains the same config (fp32, ZeRO-0, LAMB, synthetic data) in fresh processes on
the machine's 2 cores: one process with 2 threads, or two ranks with 1 thread each. The median
step time of --steps steps after --warmup is the measurement. The prediction is
pretrain/plan/step_time.py's with this machine measured first, in separate processes, as
a device at 1 and 2 threads: the FLOP/s of the layer's largest matrix product at the config's
shapes, and the rate of the element-wise work from a one-rank run of single micro-batch steps
(the time its forward + backward takes beyond the matrix products, against the bytes the model
counts for it); and a gloo all-reduce of 1 element and of 8 MB between two processes (latency
and bandwidth). Measured and predicted print side by side with their orders.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.benchmarks.harness import launch_ranks, one_rank_world, write_json  # noqa: E402

CONFIGS = {"mini": REPO / "configs" / "bert-mini.yaml", "small": REPO / "configs" / "bert-small.yaml"}
# name -> (tensor parallel, pipeline parallel, ranks); ranks share the machine's 2 cores
LAYOUTS = {"single": (1, 1, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 2), "pp2": (1, 2, 2)}
CORES = 2


def bench_config(args, tp: int, pp: int):
    from pretrain.config import load_config

    return load_config(str(CONFIGS[args.config]), [
        f"data.seq_length={args.seq}", f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}", f"train.train_steps={args.warmup + args.steps}",
        f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}", "parallel.zero_stage=0",
        "train.precision=fp32", "optimizer.name=lamb", "scheduler.warmup_steps=0", "scheduler.decay=constant",
        "eval.interval=0", "checkpoint.save_interval=0", "checkpoint.save_dir=null", "logging.tensorboard_dir=null",
        "data.num_workers=0", "data.kind=synthetic"])


def child_layout(args) -> dict:
    """One rank of a layout's run: the median step time (rank 0 reports)."""
    from pretrain.distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel
    from pretrain.training.trainer import Trainer

    tp, pp, ranks = LAYOUTS[args.child]
    cfg = bench_config(args, tp, pp)
    cfg.validate(world_size=ranks)
    launch = discover_launch_env()
    launch.export_to(os.environ)
    parallel = init_parallel(launch, tp, pp)
    trainer = Trainer(cfg, parallel)
    batches = trainer.loaders.training(trainer.train_data, 0)
    times = []
    for i in range(args.warmup + args.steps):
        started = time.perf_counter()
        trainer.train_step(batches)  # ends in a collective: every rank has finished the step
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    trainer.close_loaders()
    shutdown_parallel()
    return {"layout": args.child, "times": times}


def child_rate(args) -> dict:
    """This machine as a device at --threads. Matrix products: the FLOP/s of the layer's largest
    one ([micro x seq, hidden] x [hidden, ffn], forward and both backward products). Element-wise
    work: a one-rank run of single micro-batch steps (nothing to accumulate or reduce) with the
    phase timers on; what its forward + backward takes beyond its matrix products at that rate,
    set against the bytes pretrain/plan/step_time.py counts for it, is the memory bandwidth; the
    optimizer step's bytes over its time, the optimizer's."""
    import torch

    from pretrain.model.flops import encoder_flops_per_row, head_flops_per_sample
    from pretrain.distributed.parallel import shutdown_parallel
    from pretrain.plan.shapes import stage_parameters
    from pretrain.plan.step_time import layer_elementwise_bytes, optimizer_bytes_per_element
    from pretrain.training.trainer import Trainer

    cfg = bench_config(args, 1, 1)
    rows, h, f = args.micro_batch * args.seq, cfg.model.hidden_size, cfg.model.ffn_size
    x, w, g = torch.randn(rows, h), torch.randn(f, h), torch.randn(rows, f)
    gemm_times = []
    for i in range(40):
        started = time.perf_counter()
        torch.mm(x, w.t()), torch.mm(g, w), torch.mm(g.t(), x)
        if i:
            gemm_times.append(time.perf_counter() - started)
    flops_per_second = 3 * 2 * rows * h * f / min(gemm_times)  # the best: what the device can do

    cfg.train.global_batch_size = args.micro_batch
    cfg.logging.timers = True
    cfg.validate(world_size=1)
    parallel = one_rank_world()
    trainer = Trainer(cfg, parallel)
    batches = trainer.loaders.training(trainer.train_data, 0)
    compute, optimizer = [], []
    for i in range(args.warmup + 2 * args.steps):
        trainer.train_step(batches)
        phases = trainer.timers.read(1)
        if i >= args.warmup:
            compute.append((phases["forward"] + phases["backward"]) / 1e3)
            optimizer.append(phases["optimizer"] / 1e3)
    trainer.close_loaders()
    shutdown_parallel()
    matmul = args.micro_batch * (encoder_flops_per_row(cfg) + head_flops_per_sample(cfg)) / flops_per_second
    elementwise = args.micro_batch * cfg.model.num_layers * layer_elementwise_bytes(
        cfg.model, args.seq, 1, "fp32", "none")
    stepped = optimizer_bytes_per_element(cfg.optimizer, "cpu") * stage_parameters(cfg, 1, 1)[0].numel
    return {"threads": args.threads, "flops_per_second": flops_per_second,
            "memory_bandwidth": elementwise / (statistics.median(compute) - matmul),
            "optimizer_bandwidth": stepped / statistics.median(optimizer)}


def child_link(args) -> dict:
    """Latency (1 element) and bandwidth (8 MB) of a gloo all-reduce between the two ranks."""
    import torch
    import torch.distributed as dist

    from pretrain.distributed.parallel import discover_launch_env

    launch = discover_launch_env()
    dist.init_process_group("gloo", init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                            rank=launch.rank, world_size=launch.world_size)

    def seconds(numel: int, repeat: int) -> float:
        tensor = torch.ones(numel)
        dist.all_reduce(tensor)
        started = time.perf_counter()
        for _ in range(repeat):
            dist.all_reduce(tensor)
        return (time.perf_counter() - started) / repeat

    latency = seconds(1, 200)
    big = 2 * 2**20  # 8 MB of fp32
    per_call = seconds(big, 10)
    dist.destroy_process_group()
    # an all-reduce of n bytes over 2 ranks moves 2 (g - 1) / g n = n per rank
    return {"latency": latency, "bandwidth": 4 * big / (per_call - latency)}


def launch_children(kind: str, ranks: int, threads: int, args) -> dict:
    return launch_ranks([str(Path(__file__).resolve()), "--child", kind, "--config", args.config, "--seq", str(args.seq),
                         "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch),
                         "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(threads)],
                        ranks, threads, f"layouts benchmark: {kind}")


def predictions(args, rates: dict[int, dict], link: dict) -> dict[str, float]:
    from pretrain.plan.layouts import Layout
    from pretrain.plan.shapes import stage_parameters
    from pretrain.plan.step_time import Hardware, predict_step_time

    predicted = {}
    for name, (tp, pp, ranks) in LAYOUTS.items():
        cfg = bench_config(args, tp, pp)
        layout = Layout(tp, pp, ranks // (tp * pp), 0, args.micro_batch, "none", "fp32")
        rate = rates[CORES // ranks]
        hw = Hardware(gpus_per_node=ranks, flops={"fp32": rate["flops_per_second"]},
                      intra_node_bandwidth=link["bandwidth"], inter_node_bandwidth=link["bandwidth"],
                      memory_bandwidth=rate["memory_bandwidth"], optimizer_bandwidth=rate["optimizer_bandwidth"],
                      latency=link["latency"], device_type="cpu")
        stages = [s.numel for s in stage_parameters(cfg, tp, pp)]
        predicted[name] = predict_step_time(cfg, layout, hw, stages, 4).total
    return predicted


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="mini", choices=tuple(CONFIGS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32, help="8 micro-batches of 4 on one rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=CORES, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        from pretrain.common.quiet import hide_library_warnings

        hide_library_warnings()
        import torch

        torch.set_num_threads(args.threads)
        runner = {"rate": child_rate, "link": child_link}.get(args.child, child_layout)
        result = runner(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.child_out).write_text(json.dumps(result))
        return
    rates = {t: launch_children("rate", 1, t, args) for t in (1, 2)}
    link = launch_children("link", 2, 1, args)
    measured = {name: statistics.median(launch_children(name, ranks, CORES // ranks, args)["times"])
                for name, (_, _, ranks) in LAYOUTS.items()}
    predicted = predictions(args, rates, link)
    print(f"BERT-{args.config}, seq {args.seq}, global batch {args.global_batch} in micro-batches of "
          f"{args.micro_batch}, fp32 ZeRO-0, {CORES} cores per layout")
    print(f"this machine, measured: matrix products {rates[1]['flops_per_second'] / 1e9:.1f} GFLOP/s at 1 thread, "
          f"{rates[2]['flops_per_second'] / 1e9:.1f} at 2; element-wise {rates[1]['memory_bandwidth'] / 1e9:.1f} / "
          f"{rates[2]['memory_bandwidth'] / 1e9:.1f} GB/s, optimizer {rates[1]['optimizer_bandwidth'] / 1e9:.1f} / "
          f"{rates[2]['optimizer_bandwidth'] / 1e9:.1f} GB/s; gloo all-reduce latency {link['latency'] * 1e6:.0f} us, "
          f"bandwidth {link['bandwidth'] / 1e9:.2f} GB/s")
    order_measured = sorted(measured, key=measured.get)
    order_predicted = sorted(predicted, key=predicted.get)
    print(f"{'layout':<8}{'measured s':>11}{'predicted s':>12}{'pred/meas':>10}{'rank meas':>10}{'rank pred':>10}")
    for name in LAYOUTS:
        print(f"{name:<8}{measured[name]:>11.3f}{predicted[name]:>12.3f}{predicted[name] / measured[name]:>10.2f}"
              f"{order_measured.index(name) + 1:>10}{order_predicted.index(name) + 1:>10}")
    print(f"order measured:  {' < '.join(order_measured)}")
    print(f"order predicted: {' < '.join(order_predicted)} ({'agrees' if order_measured == order_predicted else 'DIFFERS'})")
    write_json(args.json, {"measured": measured, "predicted": predicted, "rates": rates, "link": link})


if __name__ == "__main__":
    main()
