"""Loss (and accuracy) curves from TensorBoard logs as one PNG, for a look instead of a read.

usage: python tools/plot_curves.py --logdir DIR [--logdir DIR2 ...] --output curves.png
         [--tags train/lm_loss,train/nsp_loss,eval/lm_loss]

Every directory under a --logdir that holds event files (events.out.tfevents.*) is a run, e.g.
pretraining and fine-tuning logs under one root; series are labelled run: tag (tag alone for a
single run). Default tags: every scalar whose name ends in `loss` or contains `accuracy`
(train/loss, train/lm_loss, eval/mlm_accuracy, ...; not the *-vs-samples copies). One subplot
per kind of metric (losses, accuracies, then each other requested metric), step on the x axis.
Events are read with TensorBoard's own EventAccumulator; the PNG is drawn with matplotlib's Agg
backend (no display needed) and written to a temporary file renamed into place.
Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import sys

from pretrain.cli import run_command
from pretrain.errors import UserError


class PlotError(UserError, ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python tools/plot_curves.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", action="append", required=True,
                        help="TensorBoard log directory, searched recursively for runs; repeatable")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--tags", help="comma-separated scalar tags (default: every *loss and *accuracy* tag)")
    parser.add_argument("--title", help="figure title (default: none)")
    args = parser.parse_args(argv)
    if args.tags is not None:
        args.tags = [t.strip() for t in args.tags.split(",") if t.strip()]
        if not args.tags:
            parser.error("--tags: no tag given")
    return args


def find_runs(logdirs: list[str]) -> list[tuple[str, str]]:
    """(label, directory) of every directory holding event files, labelled by its path relative
    to what all runs have in common (its own name for a single run)."""
    found = []
    for logdir in logdirs:
        if not os.path.isdir(logdir):
            problem = "not a directory" if os.path.exists(logdir) else "no such directory"
            raise PlotError(f"--logdir {logdir}: {problem}")
        runs = sorted(root for root, _, files in os.walk(logdir) if any("tfevents" in f for f in files))
        if not runs:
            raise PlotError(f"--logdir {logdir}: no TensorBoard event files (events.out.tfevents.*) in it "
                            "or below")
        found += [os.path.abspath(run) for run in runs if os.path.abspath(run) not in found]
    if len(found) == 1:
        return [(os.path.basename(found[0]), found[0])]
    common = os.path.commonpath(found)
    return [(os.path.relpath(run, common) if run != common else os.path.basename(run), run) for run in found]


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] sorted by step; a step written twice (a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    try:
        accumulator.Reload()
    except Exception as e:  # a truncated or foreign file: say which directory
        raise PlotError(f"{run_dir}: cannot read its event files ({type(e).__name__}: {e})") from None
    scalars = {}
    for tag in accumulator.Tags()["scalars"]:
        by_step = {event.step: event.value for event in accumulator.Scalars(tag)}
        scalars[tag] = sorted(by_step.items())
    return scalars


def default_tag(tag: str) -> bool:
    section, _, name = tag.rpartition("/")
    return not section.endswith("-vs-samples") and (name.endswith("loss") or "accuracy" in name)


def kind_of(tag: str) -> str:
    name = tag.rpartition("/")[2]
    if name.endswith("loss"):
        return "loss"
    if "accuracy" in name:
        return "accuracy"
    return name


def select_series(runs, scalars_by_run, tags: list[str] | None) -> tuple[list[tuple[str, str, list]], list[str]]:
    """([(label, kind, points)], requested tags found nowhere)."""
    available = sorted({tag for scalars in scalars_by_run for tag in scalars})
    wanted = tags if tags is not None else [tag for tag in available if default_tag(tag)]
    missing = [tag for tag in wanted if tag not in available]
    series = []
    for (label, _), scalars in zip(runs, scalars_by_run):
        for tag in wanted:
            if scalars.get(tag):
                series.append((f"{label}: {tag}" if len(runs) > 1 else tag, kind_of(tag), scalars[tag]))
    if not series:
        where = ", ".join(label for label, _ in runs)
        what = f"none of the tags {', '.join(wanted)}" if tags is not None else "no *loss or *accuracy* scalar"
        raise PlotError(f"{what} in the runs ({where}); their scalar tags: {', '.join(available) or 'none'}")
    return series, missing


def plot(series, output: str, title: str | None) -> int:
    """Draw one subplot per metric kind and write the PNG atomically; returns the subplot count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = []
    for _, kind, _ in series:
        if kind not in kinds:
            kinds.append(kind)
    kinds.sort(key=lambda k: {"loss": 0, "accuracy": 1}.get(k, 2))  # stable: other kinds keep their order
    figure, axes = plt.subplots(len(kinds), 1, figsize=(10, 3.6 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        for label, series_kind, points in series:
            if series_kind != kind:
                continue
            steps, values = zip(*points)
            ax.plot(steps, values, label=label, marker="o" if len(points) < 30 else None, markersize=3, linewidth=1.2)
        ax.set_ylabel(kind)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(directory):
        plt.close(figure)
        raise PlotError(f"--output {output}: directory {directory} does not exist")
    tmp = os.path.join(directory, f".{os.path.basename(output)}.tmp{os.getpid()}")
    try:
        figure.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, output)
    except OSError as e:
        raise PlotError(f"--output {output}: {e.strerror}") from None
    finally:
        plt.close(figure)
        if os.path.exists(tmp):
            os.remove(tmp)
    return len(kinds)


def main(argv=None) -> int:
    return run_command(parse_args, plot_runs, argv, name="plot_curves")


def plot_runs(args: argparse.Namespace) -> None:
    runs = find_runs(args.logdir)
    scalars_by_run = [read_scalars(run_dir) for _, run_dir in runs]
    series, missing = select_series(runs, scalars_by_run, args.tags)
    subplots = plot(series, args.output, args.title)
    if missing:
        print(f"plot_curves: note: not in any run: {', '.join(missing)}", file=sys.stderr)
    print(f"wrote {len(series)} series from {len(runs)} run(s) in {subplots} subplot(s) to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
