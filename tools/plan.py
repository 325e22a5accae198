"""Will it fit, and which layout is fastest? Every layout of a config on N devices, its memory per
rank and its step time predicted, ranked.

usage: python tools/plan.py --config FILE --gpus N [--gpus-per-node 8] --device-memory 80GB
         [--reserve 2GB] [--peak-tflops 312] [--fp32-tflops T] [--efficiency E] [--elementwise-efficiency E]
         [--intra-node-bandwidth 150GB/s] [--inter-node-bandwidth 25GB/s] [--memory-bandwidth 1500GB/s]
         [--latency-us 20] [--layer-overhead-ms 0.1]
         [--precision bf16,fp16,fp32] [--recompute none,selective,full] [--zero 0,1,2,3]
         [--micro-batch 4,8,16] [--device cuda|cpu] [--top 15] [--all] [--json] [section.key=value ...]

For the config's model and data shapes, every layout (tensor x pipeline x data parallel, ZeRO
stage, micro-batch, recomputation, precision) the trainer accepts is predicted per rank (the
most loaded pipeline stage): parameters, gradients, optimizer state (masters included),
activations (1F1B's in-flight micro-batches, the MLM head at masked positions), DeepSpeed's
communication buffers, the framework's workspace; and its step time from the FLOPs each rank
computes at the device's achievable rate (peak x efficiency), its element-wise work and optimizer
step at the achievable share of the memory bandwidth, and the TP, PP and DP traffic over the given
bandwidths. The shares default to those measured for the model's family on an H100
(pretrain/plan/calibration.py: BERT's steps within 8%). The table lists the fastest layouts that
fit, then the fastest that do not and why; the last line is the pick, as overrides for `python -m pretrain` (with
checkpoint.async_save, then the host memory a save's snapshot takes on the pick's fullest rank).
Layouts the trainer would refuse are counted by its reason, and what the plan does not model is
said (data.packing, CPU offload, ...).

Memory sizes need a unit, and K, M, G, T are binary whichever way they are written: 80G, 80GB,
80 GiB and 81920MiB are all 80 GiB, what a GPU sold as "80GB" has (nvidia-smi reports 81,559-81,920
MiB for one; its total can be given as it is). Bandwidths are decimal, as vendors quote them
(150GB/s = 150e9 bytes/s; GiB/s binary); a lower-case b (Gb/s: bits) is refused. Exit status: 0
a layout fits, 1 none fits (or bad input), 2 bad usage (one line naming the argument).
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from pretrain.cli import positive_int, run_command

GiB = 2**30
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*")


def _amount(text: str, example: str) -> tuple[float, str]:
    """'80 GB' -> (80.0, 'GB'); a bare number or an unknown word is refused (argparse type errors)."""
    found = _AMOUNT.fullmatch(text)
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} is not an amount (e.g. {example})")
    value, unit = float(found.group(1)), found.group(2)
    if not unit:
        raise argparse.ArgumentTypeError(f"{text.strip()!r} has no unit: write e.g. {value:g}{example}")
    return value, unit


def _scale(unit: str, decimal: bool) -> int | None:
    """Bytes per `unit`: B; K, M, G, T alone or with B or iB (iB always 2^10n; the others 10^3n
    where `decimal`, else 2^10n); None for anything else."""
    upper = unit.upper()
    if upper == "B":
        return 1
    if len(upper) > 3 or upper[0] not in "KMGT" or upper[1:] not in ("", "B", "IB"):
        return None
    power = "KMGT".index(upper[0]) + 1
    return 1000**power if decimal and not upper.endswith("IB") else 1024**power


def size(text: str) -> int:
    """A memory size -> bytes (argparse type): G, GB and GiB all mean 2^30 bytes (K, M, T alike),
    as a GPU's "80GB" is 80 GiB of memory chips and nvidia-smi's MiB are 2^20: '80GB', '80G',
    '80 GiB' and '81920MiB' are the same size. A bare number is refused (bytes? GB?)."""
    value, unit = _amount(text, "GB (G, GB and GiB all mean 2^30 bytes, as nvidia-smi's MiB are 2^20)")
    scale = _scale(unit, decimal=False)
    if scale is None:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown unit {unit!r} (B, K, M, G, T; G, GB and GiB alike)")
    return int(value * scale)


def bandwidth(text: str) -> float:
    """A bandwidth -> bytes per second (argparse type), decimal as vendors quote them: 150GB/s is
    150e9 bytes/s (GiB/s: 2^30). A lower-case b is bits (a network's 200 Gb/s): refused."""
    value, unit = _amount(re.sub(r"/s\s*$", "", text.strip()), "GB/s (10^9 bytes per second)")
    if unit.endswith("b"):
        raise argparse.ArgumentTypeError(f"{text!r}: a lower-case b is bits; give bytes per second "
                                         f"({value:g} {unit}/s = {value / 8:g}{unit[:-1]}B/s)")
    scale = _scale(unit, decimal=True)
    if scale is None:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown unit {unit!r} (e.g. GB/s, TB/s, GiB/s)")
    return value * scale


def gib(size_bytes: int) -> str:
    return f"{size_bytes / GiB:.1f} GiB"


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with a usage error in one line (the problem, and where the usage is)
    instead of the usage dump above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def choices(kind, allowed=None):
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {kind.__name__} values") from None
        bad = [v for v in values if allowed is not None and v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, allowed or []))}")
        return values
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from pretrain.config.choices import PRECISIONS, RECOMPUTE

    parser = OneLineParser(prog="python tools/plan.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the pretraining config (YAML, with its base: files)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument("--gpus", type=positive_int, required=True, help="devices of the job")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8)
    parser.add_argument("--device-memory", type=size, required=True,
                        help="memory of one device, e.g. 80GB: a GPU sold as 80GB (G, GB, GiB: 2^30 bytes), "
                             "or nvidia-smi's total as it prints it (81559MiB)")
    parser.add_argument("--reserve", type=size, default=size("2GB"),
                        help="kept off the plan: CUDA context, NCCL buffers, allocator fragmentation (default 2GB)")
    parser.add_argument("--peak-tflops", type=float, default=312.0,
                        help="dense bf16/fp16 matrix-product peak of one device (default 312: A100)")
    parser.add_argument("--fp32-tflops", type=float, default=None,
                        help="fp32 peak (default: half the 16-bit peak, TF32, with train.tf32; 1/16 without)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="share of --peak-tflops the model's matrix products reach (default: the family's "
                             "measured share, 0.67 for BERT)")
    parser.add_argument("--elementwise-efficiency", type=float, default=None,
                        help="share of --memory-bandwidth the element-wise work reaches (default: the family's "
                             "measured share, 0.47 for BERT; the optimizer step runs at 0.89)")
    parser.add_argument("--intra-node-bandwidth", type=bandwidth, default=bandwidth("150GB/s"),
                        help="collective bandwidth of one device inside a node (default 150GB/s: NVLink)")
    parser.add_argument("--inter-node-bandwidth", type=bandwidth, default=bandwidth("25GB/s"),
                        help="collective bandwidth of one device across nodes (default 25GB/s: 200 Gb/s per GPU)")
    parser.add_argument("--memory-bandwidth", type=bandwidth, default=bandwidth("1500GB/s"),
                        help="device memory bandwidth: element-wise work, the optimizer step (default 1500GB/s: A100 40GB)")
    parser.add_argument("--latency-us", type=float, default=20.0, help="per collective or message (default 20)")
    parser.add_argument("--layer-overhead-ms", type=float, default=None,
                        help="time a layer's forward + backward takes beyond its FLOPs and bytes, per micro-batch: "
                             "kernel launches (default 0.1, the calibration's)")
    parser.add_argument("--precision", type=choices(str, PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--recompute", type=choices(str, RECOMPUTE), default=list(RECOMPUTE))
    parser.add_argument("--zero", type=choices(int, (0, 1, 2, 3)), default=[0, 1, 2, 3])
    parser.add_argument("--micro-batch", type=choices(int), default=None,
                        help="micro-batch sizes to weigh (default: powers of two dividing each rank's share)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="whose kernels the activations follow (default cuda)")
    parser.add_argument("--top", type=positive_int, default=15, help="fitting layouts listed (default 15)")
    parser.add_argument("--all", action="store_true", help="list every layout")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout instead of the table")
    args = parser.parse_args(argv)
    for name in ("efficiency", "elementwise_efficiency"):
        value = getattr(args, name)
        if value is not None and not 0 < value <= 1:
            parser.error(f"--{name.replace('_', '-')} must be in (0, 1], got {value}")
    if args.gpus % min(args.gpus, args.gpus_per_node):
        parser.error(f"--gpus {args.gpus} must be a multiple of --gpus-per-node {args.gpus_per_node} "
                     "(or fewer than one node)")
    if args.reserve >= args.device_memory:
        parser.error(f"--reserve ({gib(args.reserve)}) must be less than --device-memory ({gib(args.device_memory)})")
    return args


def hardware(args, cfg):
    from pretrain.plan.calibration import calibration_for, datasheet_shares
    from pretrain.plan.step_time import Hardware

    shares = datasheet_shares(calibration_for(cfg.model.architecture))
    efficiency = args.efficiency if args.efficiency is not None else shares["matrix_products"]
    elementwise = args.elementwise_efficiency if args.elementwise_efficiency is not None else shares["elementwise"]
    calibration = calibration_for(cfg.model.architecture)
    overhead = calibration.layer_overhead if args.layer_overhead_ms is None else args.layer_overhead_ms * 1e-3
    peak = args.peak_tflops * 1e12
    fp32 = args.fp32_tflops * 1e12 if args.fp32_tflops else peak / (2 if cfg.train.tf32 else 16)
    rate = {"bf16": peak, "fp16": peak, "fp32": fp32}
    return Hardware(gpus_per_node=min(args.gpus, args.gpus_per_node),
                    flops={k: v * efficiency for k, v in rate.items()},
                    intra_node_bandwidth=args.intra_node_bandwidth, inter_node_bandwidth=args.inter_node_bandwidth,
                    memory_bandwidth=args.memory_bandwidth * elementwise,
                    optimizer_bandwidth=args.memory_bandwidth * shares["optimizer"], latency=args.latency_us * 1e-6,
                    layer_overhead=overhead, device_type=args.device)


def row_json(row) -> dict:
    layout, memory = row.layout, row.memory
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero": layout.zero, "micro_batch": layout.micro_batch,
            "recompute": layout.recompute, "precision": layout.precision, "stage": row.stage,
            "memory_bytes": {**memory.breakdown(), "total": memory.total},
            "step_seconds": {"total": row.time.total, "compute": row.time.compute, "bubble": row.time.bubble,
                             "tp": row.time.tp, "pp": row.time.pp, "dp": row.time.dp,
                             "optimizer": row.time.optimizer},
            "samples_per_second": row.samples_per_second, "fits": row.fits, "why_not": row.why,
            "overrides": layout.overrides(),
            # host memory (checkpoint.async_save: a save's snapshot of the rank's files; 0 without it)
            "host_bytes": {"checkpoint_snapshot": memory.checkpoint_snapshot}}


HEADER = (f"{'':>3} {'layout':<15} {'ZeRO':>4} {'micro':>5} {'recompute':<9} {'prec':<4} | {'states':>6} "
          f"{'activ':>6} {'other':>6} {'total':>6} GiB | {'step s':>7} {'samples/s':>9} | comm s (tp/pp/dp)")


def row_line(index: int, row) -> str:
    lay, mem, t = row.layout, row.memory, row.time
    states = mem.parameters + mem.gradients + mem.optimizer_state
    other = mem.total - states - mem.activations_peak
    line = (f"{index:>3} {lay.label():<15} {lay.zero:>4} {lay.micro_batch:>5} {lay.recompute:<9} {lay.precision:<4} | "
            f"{states / GiB:>6.1f} {mem.activations_peak / GiB:>6.1f} {other / GiB:>6.1f} {mem.total / GiB:>6.1f}     | "
            f"{t.total:>7.3f} {row.samples_per_second:>9.0f} | {t.tp:.3f}/{t.pp:.3f}/{t.dp:.3f}")
    return line if row.fits else f"{line}  DOES NOT FIT: {row.why}"


def body(args) -> int:
    from pretrain.checkpoint.starting_point import load_run_config
    from pretrain.plan.planner import NOT_MODELLED, Budget, plan, unmodelled

    cfg = load_run_config(args.config, args.overrides)
    choices_given = dict(precisions=args.precision, recompute=args.recompute, zero_stages=args.zero,
                         micro_batches=args.micro_batch)
    budget = Budget(args.device_memory, args.reserve)
    rows, refused = plan(cfg, args.gpus, budget, hardware(args, cfg), args.device, **choices_given)
    fitting = [row for row in rows if row.fits]
    if args.json:  # one object per line on stdout; what the plan leaves out on stderr
        for row in rows:
            print(json.dumps(row_json(row)))
        print("\n".join([*unmodelled(cfg), "not modelled: " + "; ".join(NOT_MODELLED)]), file=sys.stderr)
        return 0 if fitting else 1
    m, d, t = cfg.model, cfg.data, cfg.train
    print(f"{args.config}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
          f"seq {d.seq_length}, {d.max_predictions()} predictions, global batch {t.global_batch_size}; "
          f"{args.gpus} devices ({min(args.gpus, args.gpus_per_node)} per node) of {args.device_memory / GiB:.1f} GiB, "
          f"{budget.usable / GiB:.1f} GiB usable each")
    print(f"{len(rows)} layouts the trainer accepts, {len(fitting)} fit; memory of the most loaded rank "
          "(states = parameters + gradients + optimizer state; other = DeepSpeed's buffers + workspace)")
    print(HEADER)
    shown = rows if args.all else fitting[:args.top] + [r for r in rows if not r.fits][:5]
    for row in shown:
        print(row_line(rows.index(row) + 1, row))
    if refused:
        print(f"refused by the trainer's config rules ({sum(refused.values())} layouts):")
        for reason, count in sorted(refused.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {count:>5} x {reason}")
    for note in unmodelled(cfg):
        print(note)
    print("not modelled: " + "; ".join(NOT_MODELLED))
    if not fitting:
        print("no layout fits: more devices, a larger --device-memory, or a smaller micro-batch / sequence")
        return 1
    best = fitting[0]
    print(f"pick: {best.layout.label()} ZeRO-{best.layout.zero}, micro-batch {best.layout.micro_batch}, "
          f"recompute {best.layout.recompute}, {best.layout.precision}: {best.memory.total / GiB:.1f} GiB of "
          f"{budget.usable / GiB:.1f}, {best.time.total:.3f} s/step")
    print("  " + " ".join(best.layout.overrides()))
    if cfg.checkpoint.async_save:
        print(f"  checkpoint.async_save: a save's snapshot takes {gib(best.memory.checkpoint_snapshot)} of host (CPU) "
              "memory on its fullest rank while the files are written, besides the device memory above")
    return 0


def main(argv=None) -> int:
    return run_command(parse_args, body, argv, name="plan")


if __name__ == "__main__":
    sys.exit(main())
