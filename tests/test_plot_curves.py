"""tools/plot_curves.py: a PNG of every run under the log directories, one row of panels per run
and one panel per metric family, written atomically; missing directories, logs without events and
unknown tags are refused."""
import os
import subprocess
import sys

import pytest

from distributed import REPO
from tools import plot_curves


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """root/pretrain (the trainer's tags) and root/finetune/mrpc (the fine-tuner's), plus a text file."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("tb")
    writer = SummaryWriter(str(root / "pretrain"))
    for step in range(1, 41):
        for name, value in (("loss", 10.0 / step + 1), ("lm_loss", 9.0 / step + 1), ("nsp_loss", 0.7 / step),
                            ("mlm_accuracy", 1 - 1.0 / step), ("learning_rate", 1e-4), ("grad_norm", 2.0 / step)):
            writer.add_scalar(f"train/{name}", value, step)
            writer.add_scalar(f"train-vs-samples/{name}", value, step * 8)
        if step % 10 == 0:
            writer.add_scalar("eval/lm_loss", 9.0 / step + 1.2, step)
            writer.add_scalar("eval/nsp_loss", 0.7 / step + 0.1, step)
            writer.add_scalar("eval/mlm_accuracy", 1 - 1.2 / step, step)
            writer.add_scalar("eval/perplexity", 3.0, step)
    writer.close()
    writer = SummaryWriter(str(root / "finetune" / "mrpc"))
    for step in range(1, 21):
        writer.add_scalar("train/loss", 0.7 / step, step)
        if step % 5 == 0:  # an epoch is 5 steps: the fine-tuner writes each dev metric by step and by epoch
            writer.add_scalar("eval/accuracy", 0.6 + step / 100, step)
            writer.add_scalar("eval-vs-epoch/accuracy", 0.6 + step / 100, step // 5)
    writer.close()
    (root / "notes.txt").write_text("not an event file\n")
    return root


def check_png(path, min_height=300, min_width=400):
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert min_width <= width <= 4000 and min_height <= height <= 3000, image.shape
    assert image[..., :3].std() > 0.05  # something was drawn on the white canvas
    assert not [f for f in os.listdir(os.path.dirname(path)) if ".tmp" in f]  # no temporary file left
    return image


def test_command_line_plots_every_loss_and_accuracy_of_every_run(logs, tmp_path):
    out = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, "tools/plot_curves.py", "--logdir", str(logs), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    # pretrain: {train,eval}/{lm_loss,nsp_loss,mlm_accuracy}, train/{learning_rate,grad_norm} in 5 panels;
    # finetune/mrpc: train/loss, eval-vs-epoch/accuracy in 2: two rows of five columns
    assert done.stdout.strip() == f"wrote 10 series from 2 run(s) in 7 panel(s) to {out}"
    check_png(out, min_height=600, min_width=2000)


def test_labels_tags_and_subplots(logs, tmp_path, capsys):
    runs = plot_curves.find_runs([str(logs)])
    assert [label for label, _ in runs] == [os.path.join("finetune", "mrpc"), "pretrain"]
    scalars = [plot_curves.read_run(run)[0] for _, run in runs]
    started = [plot_curves.read_run(run)[1] for _, run in runs]
    assert started[1] < started[0]  # the fixture wrote pretraining first: its row comes first
    series, missing = plot_curves.select_series(runs, scalars, None)
    panels = {(label, tag): panel for label, panel, tag, _ in series}
    assert panels == {
        # the total loss is left out where its MLM and NSP parts are drawn; eval/accuracy where it is per epoch
        ("finetune/mrpc", "train/loss"): "loss", ("finetune/mrpc", "eval-vs-epoch/accuracy"): "dev metrics per epoch",
        ("pretrain", "train/lm_loss"): "MLM loss", ("pretrain", "eval/lm_loss"): "MLM loss",
        ("pretrain", "train/nsp_loss"): "NSP loss", ("pretrain", "eval/nsp_loss"): "NSP loss",
        ("pretrain", "train/mlm_accuracy"): "accuracy", ("pretrain", "eval/mlm_accuracy"): "accuracy",
        ("pretrain", "train/learning_rate"): "learning rate", ("pretrain", "train/grad_norm"): "grad norm"}
    assert plot_curves.panels_of(series) == [  # a row per program, a panel per family
        ("finetune/mrpc", ["loss", "dev metrics per epoch"]),
        ("pretrain", ["MLM loss", "NSP loss", "accuracy", "learning rate", "grad norm"])]
    steps = {(label, tag): [s for s, _ in points] for label, _, tag, points in series}
    assert steps["pretrain", "eval/lm_loss"] == [10, 20, 30, 40] and missing == []
    assert steps["finetune/mrpc", "eval-vs-epoch/accuracy"] == [1, 2, 3, 4]

    # chosen tags, one run (several --logdir): a subplot per kind, series named by tag alone
    out = tmp_path / "chosen.png"
    assert plot_curves.main(["--logdir", str(logs / "pretrain"), "--output", str(out),
                             "--tags", "train/lm_loss,eval/lm_loss,eval/perplexity,train/learning_rate,eval/nope"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"wrote 4 series from 1 run(s) in 3 panel(s) to {out}"
    assert "not in any run: eval/nope" in captured.err
    check_png(out, min_width=1300)  # three panels side by side

    out = tmp_path / "two.png"
    assert plot_curves.main(["--logdir", str(logs / "pretrain"), "--logdir", str(logs / "finetune"),
                             "--output", str(out), "--tags", "train/loss"]) == 0
    assert "wrote 2 series from 2 run(s) in 2 panel(s)" in capsys.readouterr().out
    check_png(out, min_height=600)  # one panel for each run, one above the other


def test_errors(logs, tmp_path, capsys):
    out = tmp_path / "x.png"

    def fails(*argv, output=out):
        assert plot_curves.main([*argv, "--output", str(output)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("plot_curves: error: ") and not output.exists()
        return err

    assert f"--logdir {tmp_path / 'missing'}: no such directory" in fails("--logdir", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    assert f"--logdir {empty}: no TensorBoard event files" in fails("--logdir", str(empty))
    assert "not a directory" in fails("--logdir", str(logs / "notes.txt"))
    err = fails("--logdir", str(logs), "--tags", "train/nope,eval/also_nope")
    assert "none of the tags train/nope, eval/also_nope" in err
    assert "eval/perplexity" in err and "train/learning_rate" in err  # lists the tags that exist
    err = fails("--logdir", str(logs / "pretrain"), "--tags", "train/loss", output=tmp_path / "no" / "x.png")
    assert f"directory {tmp_path / 'no'} does not exist" in err

    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "perf-only")) as writer:  # nothing of a family to plot by default
        writer.add_scalar("perf/tokens_per_second", 1e4, 1)
    assert ("no loss, accuracy, learning-rate or grad-norm scalar in the runs (perf-only); their scalar tags: "
            "perf/tokens_per_second") in fails("--logdir", str(tmp_path / "perf-only"))
    with pytest.raises(SystemExit) as usage:
        plot_curves.main(["--output", str(out)])  # --logdir is required
    assert usage.value.code == 2


def test_series_of_few_points_get_markers(tmp_path, monkeypatch):
    """A line through one point draws nothing: the test set's single evaluation (test/*, at the end
    of pretraining) and any short series are drawn with a marker on each point, and the test split
    dashed as an evaluation; a long train series stays a plain line."""
    from matplotlib.axes import Axes
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "run")) as writer:
        for step in range(1, 41):
            writer.add_scalar("train/lm_loss", 9.0 / step + 1, step)
        writer.add_scalar("train/grad_norm", 1.5, 40)  # a one-step run's
        writer.add_scalar("test/lm_loss", 2.0, 40)
    drawn = {}
    plot_line = Axes.plot

    def recording(ax, *args, **kwargs):
        drawn[kwargs["label"]] = kwargs
        return plot_line(ax, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording)
    assert plot_curves.main(["--logdir", str(tmp_path / "run"), "--output", str(tmp_path / "curves.png")]) == 0
    assert (drawn["test/lm_loss"]["marker"], drawn["test/lm_loss"]["linestyle"]) == ("o", "--")
    assert drawn["train/grad_norm"]["marker"] == "o"
    assert (drawn["train/lm_loss"]["marker"], drawn["train/lm_loss"]["linestyle"]) == (None, "-")
