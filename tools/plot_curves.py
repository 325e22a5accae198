"""Training curves from TensorBoard logs as one PNG, for a look instead of a read.

usage: python tools/plot_curves.py --logdir DIR [--logdir DIR2 ...] --output curves.png
         [--tags train/lm_loss,train/nsp_loss,eval/lm_loss]

Every directory under a --logdir that holds event files (events.out.tfevents.*) is a run, e.g.
pretraining and fine-tuning logs under one root. Each run gets a row of panels (rows in the order
the runs started), one per metric family, a metric in one colour, train solid, evaluation (eval,
test) dashed, markers on evaluations and on series of few points (one point draws no line):
pretraining's MLM loss and NSP loss (train vs eval), accuracy (MLM and NSP, train vs eval),
learning rate and grad norm; fine-tuning's loss and its dev metrics per epoch (eval-vs-epoch/*).
Step on the x axis (epoch for per-epoch metrics). Without --tags: those families (not the
*-vs-samples copies, not the total loss where its MLM and NSP parts are drawn); a requested tag of
no family gets a panel of its own.
Events are read with TensorBoard's own EventAccumulator; the PNG is drawn with matplotlib's Agg
backend (no display needed) and written to a temporary file renamed into place.
Exit status: 0 done, 1 bad input, 2 bad usage.
"""
from __future__ import annotations

import argparse
import os
import sys

from pretrain.cli import run_command
from pretrain.common.errors import UserError


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


def read_run(run_dir: str) -> tuple[dict[str, list[tuple[int, float]]], float]:
    """(tag -> [(step, value)] sorted by step, the first event's wall time); a step written twice
    (a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.SCALARS: 0})
    try:
        accumulator.Reload()
    except Exception as e:  # a truncated or foreign file: say which directory
        raise PlotError(f"{run_dir}: cannot read its event files ({type(e).__name__}: {e})") from None
    scalars, started = {}, float("inf")
    for tag in accumulator.Tags()["scalars"]:
        events = accumulator.Scalars(tag)
        scalars[tag] = sorted({event.step: event.value for event in events}.items())
        started = min([started] + [event.wall_time for event in events])
    return scalars, started


# Panel of each metric family, in drawing order: what the trainer and the fine-tuner write.
_FAMILIES = ("MLM loss", "NSP loss", "loss", "accuracy", "dev metrics per epoch", "learning rate", "grad norm")


def family_of(tag: str) -> str | None:
    """The panel a default tag goes to (None: not drawn unless asked for with --tags)."""
    section, _, name = tag.rpartition("/")
    if section.endswith("-vs-samples"):
        return None
    if section == "eval-vs-epoch":
        return "dev metrics per epoch"
    if name == "lm_loss":
        return "MLM loss"
    if name in ("nsp_loss", "sop_loss"):
        return "NSP loss"
    if name.endswith("loss"):
        return "loss"
    if "accuracy" in name:
        return "accuracy"
    return {"learning_rate": "learning rate", "grad_norm": "grad norm"}.get(name)


def default_tags(scalars: dict) -> list[str]:
    """A run's tags worth a look, each in its family, without repeats: not the total loss where
    its MLM and NSP parts are drawn, not eval/<metric> where eval-vs-epoch/<metric> is."""
    tags = [tag for tag in sorted(scalars) if family_of(tag)]
    per_epoch = {tag.rpartition("/")[2] for tag in tags if tag.startswith("eval-vs-epoch/")}
    has_parts = any(family_of(tag) == "MLM loss" for tag in tags)
    return [tag for tag in tags
            if not (has_parts and tag.rpartition("/")[2] == "loss")
            and not (tag.startswith("eval/") and tag.rpartition("/")[2] in per_epoch)]


def select_series(runs, scalars_by_run, tags: list[str] | None) -> tuple[list[tuple[str, str, str, list]], list[str]]:
    """([(run label, panel, tag, points)], requested tags found nowhere). Panels are metric
    families (family_of); a requested tag of no family gets a panel of its own name."""
    available = sorted({tag for scalars in scalars_by_run for tag in scalars})
    missing = [tag for tag in tags or [] if tag not in available]
    series = []
    for (label, _), scalars in zip(runs, scalars_by_run):
        for tag in tags if tags is not None else default_tags(scalars):
            if scalars.get(tag):
                series.append((label, family_of(tag) or tag.rpartition("/")[2], tag, scalars[tag]))
    if not series:
        where = ", ".join(label for label, _ in runs)
        what = (f"none of the tags {', '.join(tags)}" if tags is not None
                else "no loss, accuracy, learning-rate or grad-norm scalar")
        raise PlotError(f"{what} in the runs ({where}); their scalar tags: {', '.join(available) or 'none'}")
    return series, missing


def panels_of(series) -> list[tuple[str, list[str]]]:
    """(run label, its panels in drawing order) per run, runs in their order."""
    layout: dict[str, list[str]] = {}
    for label, panel, _, _ in series:
        panels = layout.setdefault(label, [])
        if panel not in panels:
            panels.append(panel)
    order = {family: i for i, family in enumerate(_FAMILIES)}
    return [(label, sorted(panels, key=lambda p: order.get(p, len(order)))) for label, panels in layout.items()]


# A series of this many points or fewer gets a marker at each: a line through one point draws
# nothing (a test set evaluated once, a run of a few steps).
FEW_POINTS = 20


def line_style(tag: str, points: int) -> dict:
    """matplotlib keywords of a series: train solid; evaluation (eval, test) dashed and heavier;
    markers on evaluation points and on any series of few points."""
    evaluation = tag.split("/")[0].split("-")[0] in ("eval", "test")
    marked = evaluation or points <= FEW_POINTS
    return {"marker": "o" if marked else None, "markersize": 4, "linewidth": 1.6 if evaluation else 1.0,
            "linestyle": "--" if evaluation else "-"}


def plot(series, output: str, title: str | None) -> int:
    """One row of panels per run (program), one panel per metric family, train solid and
    evaluation dashed; the PNG written atomically. Returns the number of panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    rows = panels_of(series)
    columns = max(len(panels) for _, panels in rows)
    figure, axes = plt.subplots(len(rows), columns, figsize=(4.4 * columns, 3.3 * len(rows)), squeeze=False)
    # a metric keeps its colour in every panel and for both splits: train solid, evaluation dashed
    metrics = list(dict.fromkeys(tag.rpartition("/")[2] for _, _, tag, _ in series))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, (label, panels) in enumerate(rows):
        for column in range(columns):
            ax = axes[row, column]
            if column >= len(panels):
                ax.set_visible(False)
                continue
            panel = panels[column]
            for run, series_panel, tag, points in series:
                if run != label or series_panel != panel:
                    continue
                steps, values = zip(*points)
                colour = colours[metrics.index(tag.rpartition("/")[2]) % len(colours)]
                ax.plot(steps, values, label=tag, color=colour, **line_style(tag, len(points)))
            ax.set_title(f"{label}: {panel}" if len(rows) > 1 else panel, fontsize="medium")
            ax.set_xlabel("epoch" if panel == "dev metrics per epoch" else "step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    return sum(len(panels) for _, panels in rows)


def main(argv=None) -> int:
    return run_command(parse_args, plot_runs, argv, name="plot_curves")


def plot_runs(args: argparse.Namespace) -> None:
    found = find_runs(args.logdir)
    read = [read_run(run_dir) for _, run_dir in found]
    order = sorted(range(len(found)), key=lambda i: read[i][1])  # rows in the order the runs started
    runs, scalars_by_run = [found[i] for i in order], [read[i][0] for i in order]
    series, missing = select_series(runs, scalars_by_run, args.tags)
    panels = plot(series, args.output, args.title)
    if missing:
        print(f"plot_curves: note: not in any run: {', '.join(missing)}", file=sys.stderr)
    print(f"wrote {len(series)} series from {len(runs)} run(s) in {panels} panel(s) to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
