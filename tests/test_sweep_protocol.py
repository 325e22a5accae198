"""The fine-tuning protocol layer (finetune/sweep): spec, trial expansion, records, selection,
the Table 1 results and the GLUE bundle, sweep.json and the lock, the queue's claims and a dead
worker's bookkeeping. Fast: no training; the queue's tests start one-line processes as workers."""
from __future__ import annotations

import csv
import io
import json
import os
import statistics
import subprocess
import sys
import zipfile

import pytest

from finetune.sweep import bundle as bundle_mod
from finetune.sweep.bundle import GLUE_FILES, check_submission_file, copy_predictions, glue_bundle, write_bundle
from finetune.sweep.selection import SelectionError, official_score, select, select_all
from finetune.sweep.spec import GRID_PRESETS, load_sweep_spec
from finetune.sweep.table import GLUE_COLUMNS, csv_text, glue_row, markdown, results_json, write_results
from finetune.sweep.trials import (Trial, expand, read_records, read_trial_record, record_for,
                                   write_trial_record)
from pretrain.config import ConfigError, load_sections

GLUE9 = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")


def spec_of(*overrides, output_dir="out"):
    return load_sweep_spec(None, [f"sweep.output_dir={output_dir}", *overrides])


def problems_of(*overrides, path=None):
    with pytest.raises(ConfigError) as e:
        load_sweep_spec(path, list(overrides))
    return e.value.problems


# ----------------------------------------------------------------------------- package


def test_importing_the_package_and_modules_imports_no_torch():
    code = ("import sys, finetune.sweep, finetune.sweep.spec, finetune.sweep.trials, finetune.sweep.selection, "
            "finetune.sweep.table, finetune.sweep.bundle; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- spec


def test_yaml_spec_with_glue_tasks_preset_and_defaults(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("sweep:\n  tasks: glue\n  grid: paper\n  output_dir: o\n  overrides: [model.init_from=ckpt]\n")
    spec = load_sweep_spec(str(path), [])
    assert spec.tasks == GLUE9
    assert spec.restarts == 1 and spec.first_seed == 42 and spec.data_root is None
    assert spec.grid == (("train.lr", (5e-5, 4e-5, 3e-5, 2e-5)), ("train.global_batch_size", (32,)),
                         ("train.epochs", (3.0,)))
    assert spec.overrides == ("model.init_from=ckpt",)


def test_paper_appendix_preset():
    spec = spec_of("sweep.tasks=[rte]", "sweep.grid=paper-appendix")
    grid = dict(spec.grid)
    assert grid == {"train.global_batch_size": (16, 32), "train.lr": (5e-5, 3e-5, 2e-5),
                    "train.epochs": (2.0, 3.0, 4.0)}
    assert len(expand(spec)) == 2 * 3 * 3
    assert set(GRID_PRESETS) == {"paper", "paper-appendix"}


def test_command_line_overrides_replace_and_extend_the_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("sweep:\n  tasks: [mrpc]\n  grid: paper\n  output_dir: o\n  restarts: 2\n")
    spec = load_sweep_spec(str(path), ["sweep.restarts=5", "sweep.grid.train.lr=[3e-5]", "sweep.first_seed=7",
                                       "sweep.task_overrides.mrpc=[task.max_seq_length=64]"])
    assert spec.restarts == 5 and spec.first_seed == 7
    assert dict(spec.grid)["train.lr"] == (3e-5,)
    assert dict(spec.grid)["train.global_batch_size"] == (32,)  # the rest of the preset kept
    assert spec.task_overrides == {"mrpc": ("task.max_seq_length=64",)}


def test_unknown_grid_key_is_named_with_a_suggestion():
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid={train.lrr: [1e-5]}")
    assert len(problems) == 1
    assert "train.lrr" in problems[0] and "did you mean 'train.lr'" in problems[0]
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid={lr: [1e-5]}")
    assert "'lr' is not a fine-tuning key (did you mean 'train.lr'?)" in problems[0]


@pytest.mark.parametrize("key,why", [("task.name", "task"), ("train.seed", "restarts own the seed"),
                                     ("train.output_dir", "directory"), ("model.init_from", "sweep.overrides")])
def test_owned_grid_keys_are_refused_naming_key_and_why(key, why):
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", f"sweep.grid={{{key}: [x]}}")
    assert len(problems) == 1 and key in problems[0] and why in problems[0]


def test_parallel_keys_are_the_sweeps_and_slot_sizes_are_checked():
    """Every trial runs on process groups started once per slot: parallel.* is set in sweep.overrides only."""
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid={parallel.zero_stage: [0, 1]}",
                           "sweep.task_overrides.rte=[parallel.tensor_parallel=2]", "sweep.ranks_per_trial=0",
                           "sweep.parallel_trials=two")
    text = "\n".join(problems)
    assert "sweep.grid: parallel.zero_stage cannot be a grid key" in text
    assert "sweep.task_overrides.rte: parallel.tensor_parallel cannot differ by task" in text
    assert "sweep.ranks_per_trial must be an int >= 1" in text and "sweep.parallel_trials must be an int" in text
    spec = load_sweep_spec(None, ["sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.ranks_per_trial=2",
                                  "sweep.overrides=[parallel.tensor_parallel=2]"])
    assert (spec.ranks_per_trial, spec.parallel_trials) == (2, None)


def test_every_problem_reported_at_once_one_line_each():
    problems = problems_of("sweep.tasks=[mrpcc, ax]", "sweep.grid={train.lr: [], train.epochs: [two]}",
                           "sweep.restarts=0", "sweep.first_seed=x", "sweep.overrides=[train.seed=1, train.foo=1]",
                           "sweep.restart=3", "sweep.task_overrides.rte=[task.max_seq_length=9]")
    text = "\n".join(problems)
    for expected in ("'mrpcc' (did you mean 'mrpc'?)", "ax has no trials", "train.lr must be a non-empty list",
                     "train.epochs must be float", "sweep.restarts must be an int >= 1", "sweep.first_seed",
                     "sweep.output_dir is required", "train.seed cannot be set here", "train.foo",
                     "unknown key 'sweep.restart' (did you mean 'sweep.restarts'?)",
                     "sweep.task_overrides.rte: rte is not one of sweep.tasks"):
        assert expected in text, expected
    assert all("\n" not in p for p in problems)


def test_unknown_preset_duplicate_values_and_grid_override_conflict():
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid=paperr")
    assert "unknown grid preset 'paperr'" in problems[0] and "did you mean 'paper'" in problems[0]
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid={train.lr: [2e-5, 2.0e-5]}")
    assert "train.lr lists a value twice" in problems[0]
    problems = problems_of("sweep.output_dir=o", "sweep.tasks=[rte]", "sweep.grid=paper",
                           "sweep.overrides=[train.lr=1e-5]")
    assert "train.lr is also a grid key" in problems[0]


def test_file_errors_name_the_file(tmp_path):
    assert "not found" in problems_of(path=str(tmp_path / "none.yaml"))[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: 1\nsweep:\n  tasks: [rte]\n  output_dir: o\n")
    assert any(str(bad) in p and "unknown section 'train'" in p for p in problems_of(path=str(bad)))


# ----------------------------------------------------------------------------- trials


def test_expansion_order_ids_seeds_and_directories():
    spec = spec_of("sweep.tasks=[rte, mrpc]", "sweep.grid={train.lr: [5e-5, 2e-5], train.epochs: [2, 3]}",
                   "sweep.restarts=2", "sweep.first_seed=10")
    trials = expand(spec)
    assert len(trials) == 2 * 4 * 2
    assert [t.task for t in trials] == ["rte"] * 8 + ["mrpc"] * 8
    assert [t.point for t in trials[:8:2]] == [(("train.lr", 5e-5), ("train.epochs", 2.0)),
                                               (("train.lr", 5e-5), ("train.epochs", 3.0)),
                                               (("train.lr", 2e-5), ("train.epochs", 2.0)),
                                               (("train.lr", 2e-5), ("train.epochs", 3.0))]
    assert [(t.restart, t.seed) for t in trials[:2]] == [(0, 10), (1, 11)]
    assert trials[1].directory == "rte/lr-5e-05_epochs-2/restart-1"
    assert trials[1].id == trials[1].directory
    assert len({t.id for t in trials}) == len(trials) == len({t.directory for t in trials})
    assert expand(spec) == trials  # deterministic


def test_clashing_field_names_use_the_dotted_key_and_no_grid_is_default():
    spec = spec_of("sweep.tasks=[conll2003]", "sweep.grid={train.lr: [1e-5], features.lr: [1e-3]}")
    assert expand(spec)[0].directory == "conll2003/train.lr-1e-05_features.lr-0.001/restart-0"
    assert expand(spec_of("sweep.tasks=[rte]"))[0].directory == "rte/default/restart-0"


def test_trial_overrides_load_as_a_finetune_config():
    from finetune.config import SECTIONS

    spec = spec_of("sweep.tasks=[mrpc, squad]", "sweep.grid=paper", "sweep.data_root=/data/glue",
                   "sweep.overrides=[model.init_from=ckpt]", "sweep.restarts=2",
                   "sweep.task_overrides.squad=[task.data_dir=/data/squad]", output_dir="/s weep")
    trials = expand(spec)
    mrpc = trials[3]  # lr 4e-5, restart 1
    overrides = mrpc.overrides(spec)
    assert overrides[0] == 'task.data_dir="/data/glue/MRPC"'
    assert overrides[-2:] == ["train.seed=43",
                              'train.output_dir="/s weep/mrpc/lr-4e-05_global_batch_size-32_epochs-3/restart-1"']
    tree = load_sections(None, overrides, SECTIONS)
    assert tree["task"]["data_dir"] == "/data/glue/MRPC"
    assert tree["model"]["init_from"] == "ckpt"
    assert tree["train"] == {"lr": 4e-5, "global_batch_size": 32, "epochs": 3.0, "seed": 43,
                             "output_dir": "/s weep/mrpc/lr-4e-05_global_batch_size-32_epochs-3/restart-1"}
    squad = [t for t in trials if t.task == "squad"][0]
    assert load_sections(None, squad.overrides(spec), SECTIONS)["task"]["data_dir"] == "/data/squad"


# ----------------------------------------------------------------------------- records


def make_trial(root, task, point, restart, status="done", metrics=None, error=None, submission=None):
    """A fabricated finished trial directory under root; its TrialRecord as read back."""
    name = "_".join(f"{k.split('.')[-1]}-{v}" for k, v in point.items()) or "default"
    directory = os.path.join(str(root), task, name, f"restart-{restart}")
    trial = Trial(task, tuple(point.items()), restart, 42 + restart, f"{task}/{name}/restart-{restart}",
                  f"{task}/{name}/restart-{restart}")
    write_trial_record(directory, record_for(trial, status, error, 1.5))
    if status == "done":
        with open(os.path.join(directory, "metrics.json"), "w") as f:
            json.dump({"task": task, "history": [], "best": {"epoch": 1, "step": 9, "metrics": metrics,
                                                             "score": 0.0}, "train_losses": []}, f)
    for name, text in (submission or {}).items():
        os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    record = read_trial_record(directory)
    assert record is not None
    return record


def test_record_round_trip_keeps_one_error_line(tmp_path):
    trial = expand(spec_of("sweep.tasks=[rte]", "sweep.grid=paper"))[0]
    write_trial_record(str(tmp_path), record_for(trial, "failed", "CUDA out of memory\nTraceback ...", 3.0))
    record = read_trial_record(str(tmp_path))
    assert record.status == "failed" and record.error == "CUDA out of memory" and record.metrics is None
    assert record.point == {"train.lr": 5e-5, "train.global_batch_size": 32, "train.epochs": 3.0}
    assert (record.id, record.restart, record.seed, record.seconds) == (trial.id, 0, 42, 3.0)
    assert sorted(os.listdir(tmp_path)) == ["trial.json"]  # no temporary left behind


def test_record_write_is_atomic(tmp_path, monkeypatch):
    trial = expand(spec_of("sweep.tasks=[rte]"))[0]
    write_trial_record(str(tmp_path), record_for(trial, "failed", "first"))
    before = (tmp_path / "trial.json").read_text()
    import pretrain.common.atomic as atomic

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(atomic.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_trial_record(str(tmp_path), record_for(trial, "failed", "second"))
    monkeypatch.undo()
    assert (tmp_path / "trial.json").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["trial.json"]


@pytest.mark.parametrize("content", ["", "{not json", '{"id": "x"}', '{"id":"x","task":"rte","point":{},"restart":0,'
                                     '"seed":42,"status":"running","error":null,"seconds":1}', "[]"])
def test_unreadable_records_count_as_not_finished(tmp_path, content):
    (tmp_path / "trial.json").write_text(content)
    assert read_trial_record(str(tmp_path)) is None


def test_absent_record_and_done_without_metrics_are_not_finished(tmp_path):
    assert read_trial_record(str(tmp_path)) is None
    trial = expand(spec_of("sweep.tasks=[rte]"))[0]
    write_trial_record(str(tmp_path), record_for(trial, "done"))
    assert read_trial_record(str(tmp_path)) is None  # no metrics.json
    (tmp_path / "metrics.json").write_text('{"best": {"metrics": {"accuracy": 0.7}}}')
    assert read_trial_record(str(tmp_path)).metrics == {"accuracy": 0.7}


def test_read_records_follows_expand(tmp_path):
    spec = spec_of("sweep.tasks=[rte]", "sweep.restarts=2", output_dir=str(tmp_path))
    trials = expand(spec)
    write_trial_record(trials[1].output_dir(spec), record_for(trials[1], "failed", "boom"))
    pairs = read_records(spec)
    assert [t for t, _ in pairs] == trials
    assert pairs[0][1] is None and pairs[1][1].error == "boom"


# ----------------------------------------------------------------------------- selection


def test_official_scores():
    assert official_score("mrpc", {"f1": 0.9, "accuracy": 0.8}) == pytest.approx(0.85)
    assert official_score("qqp", {"f1": 0.7, "accuracy": 0.9}) == pytest.approx(0.8)
    assert official_score("stsb", {"pearson": 0.88, "spearman": 0.86}) == pytest.approx(0.87)
    assert official_score("mnli", {"dev_matched/accuracy": 0.84, "dev_mismatched/accuracy": 0.99}) == 0.84
    assert official_score("cola", {"matthews_corr": 0.5, "accuracy": 0.9}) == 0.5
    assert official_score("squad", {"f1": 88.0, "exact_match": 80.0}) == 88.0
    assert official_score("conll2003", {"f1": 0.9, "accuracy": 0.99}) == 0.9
    # one dev set: its metrics unprefixed; several: the task's own (MNLI matched), else their mean
    assert official_score("mnli", {"accuracy": 0.8}) == 0.8
    assert official_score("sst2", {"dev/accuracy": 0.8, "extra/accuracy": 0.9}) == pytest.approx(0.85)
    with pytest.raises(SelectionError, match="mnli: the metrics lack dev_matched/accuracy"):
        official_score("mnli", {"dev_mismatched/accuracy": 0.8, "other/accuracy": 0.7})
    with pytest.raises(SelectionError, match="mrpc: the metrics lack f1"):
        official_score("mrpc", {"accuracy": 0.8})


def test_a_fine_tuning_run_picks_its_best_epoch_by_the_official_score_the_sweep_selects_by():
    """One definition (finetune/official_metrics.py): the task's score is the sweep's, so an MRPC
    epoch with the better accuracy but the worse mean of F1 and accuracy is not the best, and MNLI's
    mismatched dev set does not count."""
    from finetune.tasks import TASKS

    for name in TASKS:
        metrics = {"accuracy": 0.7, "f1": 0.6, "pearson": 0.5, "spearman": 0.4, "matthews_corr": 0.3,
                   "exact_match": 50.0, "exact": 40.0}
        assert TASKS[name].score(metrics) == official_score(name, metrics), name
    accurate, balanced = {"accuracy": 0.90, "f1": 0.50}, {"accuracy": 0.85, "f1": 0.80}
    assert TASKS["mrpc"].score(balanced) > TASKS["mrpc"].score(accurate)
    assert TASKS["mnli"].score({"dev_matched/accuracy": 0.8, "dev_mismatched/accuracy": 0.2}) == 0.8
    assert TASKS["stsb"].score({"pearson": 0.9, "spearman": 0.7}) == pytest.approx(0.8)


def test_select_names_the_trial_whose_metrics_lack_the_official_key(tmp_path):
    r = make_trial(tmp_path, "mnli", {"train.lr": 5e-5}, 0, metrics={"dev_mismatched/accuracy": 0.8})
    with pytest.raises(SelectionError, match="trial mnli/lr-5e-05/restart-0: mnli: the metrics lack dev_matched/acc"):
        select("mnli", [r])


def test_select_uses_the_official_metric_not_accuracy(tmp_path):
    a = make_trial(tmp_path, "mrpc", {"train.lr": 5e-5}, 0, metrics={"accuracy": 0.90, "f1": 0.70})  # 0.80
    b = make_trial(tmp_path, "mrpc", {"train.lr": 2e-5}, 0, metrics={"accuracy": 0.85, "f1": 0.80})  # 0.825
    s = select("mrpc", [a, b])
    assert s.best.id == b.id and s.score == pytest.approx(0.825) and s.point == {"train.lr": 2e-5}
    c = make_trial(tmp_path, "stsb", {"train.lr": 5e-5}, 0, metrics={"pearson": 0.90, "spearman": 0.80})  # 0.85
    d = make_trial(tmp_path, "stsb", {"train.lr": 2e-5}, 0, metrics={"pearson": 0.84, "spearman": 0.88})  # 0.86
    assert select("stsb", [c, d]).best.id == d.id
    e = make_trial(tmp_path, "mnli", {"train.lr": 5e-5}, 0,
                   metrics={"dev_matched/accuracy": 0.84, "dev_mismatched/accuracy": 0.80})
    f = make_trial(tmp_path, "mnli", {"train.lr": 2e-5}, 0,
                   metrics={"dev_matched/accuracy": 0.83, "dev_mismatched/accuracy": 0.90})
    assert select("mnli", [e, f]).best.id == e.id


def test_ties_go_to_the_earlier_grid_point_then_the_lower_restart(tmp_path):
    m = {"accuracy": 0.7}
    p1r1 = make_trial(tmp_path, "rte", {"train.lr": 5e-5}, 1, metrics=m)
    p0r1 = make_trial(tmp_path, "rte", {"train.lr": 3e-5}, 1, metrics=m)
    p0r0 = make_trial(tmp_path, "rte", {"train.lr": 3e-5}, 0, metrics={"accuracy": 0.6})
    # expand order: the 3e-5 point first
    assert select("rte", [p0r0, p0r1, p1r1]).best.id == p0r1.id
    p1r0 = make_trial(tmp_path, "rte", {"train.lr": 5e-5}, 0, metrics=m)
    assert select("rte", [p1r0, p1r1, p0r1]).best.id == p1r0.id
    assert select("rte", [p1r1, p1r0, p0r1]).best.id == p1r0.id  # lower restart, whatever the list order
    # the earlier grid point wins over a lower restart of a later one
    assert select("rte", [p0r0, p0r1, p1r0]).best.id == p0r1.id


def test_mean_and_std_over_the_restarts_of_the_selected_point(tmp_path):
    scores = [0.70, 0.66, 0.61]
    records = [make_trial(tmp_path, "rte", {"train.lr": 5e-5}, r, metrics={"accuracy": v})
               for r, v in enumerate(scores)]
    records += [make_trial(tmp_path, "rte", {"train.lr": 2e-5}, r, metrics={"accuracy": v})
                for r, v in enumerate([0.1, 0.69])]
    s = select("rte", records, planned=6)
    assert s.best.restart == 0 and s.score == 0.70
    assert s.restart_scores == tuple(scores)
    assert s.mean == pytest.approx(statistics.mean(scores))
    assert s.std == pytest.approx(statistics.stdev(scores))
    assert s.done == 5 and s.failed == () and s.not_finished == 1
    one = select("rte", [records[4]])
    assert one.std is None and one.restart_scores == (0.69,)  # a sample std of one score is undefined


def test_failed_trials_listed_and_a_task_without_finished_trials(tmp_path):
    ok = make_trial(tmp_path, "cola", {"train.lr": 5e-5}, 0, metrics={"matthews_corr": 0.5})
    bad = make_trial(tmp_path, "cola", {"train.lr": 5e-5}, 1, status="failed", error="out of memory")
    s = select("cola", [ok, bad, None])
    assert s.failed == ((bad.id, "out of memory"),) and s.done == 1 and s.status == "done"
    only_failed = select("cola", [bad])
    assert only_failed.status == "failed" and only_failed.best is None and only_failed.score is None
    assert select("rte", [ok, bad]).status == "not run"
    assert [x.task for x in select_all(["cola", "rte"], [ok, bad])] == ["cola", "rte"]


# ----------------------------------------------------------------------------- table


def glue_selections(tmp_path, **drop):
    """The paper's BERT-base Table 1 numbers as selected dev metrics (fractions)."""
    values = {"mnli": {"dev_matched/accuracy": 0.846, "dev_mismatched/accuracy": 0.834},
              "qqp": {"f1": 0.712, "accuracy": 0.89}, "qnli": {"accuracy": 0.905}, "sst2": {"accuracy": 0.935},
              "cola": {"matthews_corr": 0.521}, "stsb": {"pearson": 0.87, "spearman": 0.858},
              "mrpc": {"f1": 0.889, "accuracy": 0.84}, "rte": {"accuracy": 0.664}, "wnli": {"accuracy": 0.5}}
    out = []
    for task, metrics in values.items():
        if task in drop:
            error = drop[task]
            records = [make_trial(tmp_path, task, {"train.lr": 5e-5}, 0, "failed", error=error)] if error else []
        else:
            records = [make_trial(tmp_path, task, {"train.lr": 5e-5}, 0, metrics=metrics)]
        out.append(select(task, records, planned=1))
    return out


def test_table1_columns_values_and_average(tmp_path):
    row = glue_row(glue_selections(tmp_path))
    assert list(row) == ["MNLI-m", "MNLI-mm", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "Average"]
    expected = [84.6, 83.4, 71.2, 90.5, 93.5, 52.1, 85.8, 88.9, 66.4]
    assert [row[c] for c, _, _ in GLUE_COLUMNS] == pytest.approx(expected)
    assert row["Average"] == pytest.approx(716.4 / 9)  # the paper's 79.6
    md = markdown(glue_selections(tmp_path / "again"))
    assert "| 84.6 | 83.4 | 71.2 | 90.5 | 93.5 | 52.1 | 85.8 | 88.9 | 66.4 | 79.6 |" in md


def test_failed_and_missing_tasks_show_words_not_numbers(tmp_path):
    selections = glue_selections(tmp_path, cola="killed by signal 9", rte=None)
    row = glue_row(selections)
    assert row["CoLA"] == "failed" and row["RTE"] == "not run" and row["Average"] is None
    md = markdown(selections)
    assert "| failed |" in md and "| not run |" in md and "| - |" in md
    assert "- cola/lr-5e-05/restart-0: killed by signal 9" in md
    assert glue_row([s for s in selections if s.task != "mnli"])["MNLI-mm"] == "not run"


def test_details_csv_and_json(tmp_path):
    records = [make_trial(tmp_path, "mrpc", {"train.lr": 5e-5}, r, metrics={"f1": f, "accuracy": a})
               for r, (f, a) in enumerate([(0.90, 0.86), (0.88, 0.84)])]
    records.append(make_trial(tmp_path, "mrpc", {"train.lr": 2e-5}, 0, "failed", error="nan loss"))
    squad = make_trial(tmp_path, "squad", {"train.lr": 5e-5}, 0, metrics={"f1": 88.46, "exact_match": 81.0})
    selections = [select("mrpc", records, planned=4), select("squad", [squad], planned=1), select("swag", [], 1)]
    rows = list(csv.DictReader(io.StringIO(csv_text(selections))))
    assert [r["task"] for r in rows] == ["mrpc", "squad", "swag"]
    assert rows[0]["score"] == "88.0" and rows[0]["mean"] == "87.0"
    assert rows[0]["std"] == f"{100 * statistics.stdev([0.88, 0.86]):.1f}"
    assert (rows[0]["done"], rows[0]["failed"], rows[0]["planned"]) == ("2", "1", "4")
    assert rows[0]["reported"] == "MRPC=90.0" and rows[0]["point"] == "train.lr=5e-05"
    assert rows[1]["score"] == "88.5" and rows[1]["reported"] == "F1=88.5; EM=81.0"
    assert rows[2]["status"] == "not run" and rows[2]["score"] == ""
    data = results_json(selections)
    assert data["tasks"][0]["failed_trials"] == [{"id": "mrpc/lr-2e-05/restart-0", "error": "nan loss"}]
    assert data["tasks"][0]["std"] == pytest.approx(statistics.stdev([0.88, 0.86]))
    assert data["other"][1] == {"task": "SWAG", "values": {"Accuracy": "not run"}}
    md = markdown(selections)
    assert "| SQuAD 1.1 | F1 88.5, EM 81.0 |" in md
    assert "87.0 ± 1.4 (n=2)" in md


def test_write_results_writes_three_files(tmp_path):
    paths = write_results(glue_selections(tmp_path / "t"), str(tmp_path / "r"))
    assert sorted(os.listdir(tmp_path / "r")) == ["results.csv", "results.json", "results.md"]
    assert json.loads(open(paths[2]).read())["glue"]["Average"] == pytest.approx(716.4 / 9)


# ----------------------------------------------------------------------------- bundle


def tsv(rows=2, header="index\tprediction"):
    return header + "\n" + "".join(f"{i}\t1\n" for i in range(rows))


def test_glue_file_names_are_the_ones_the_tasks_write():
    glue = pytest.importorskip("finetune.tasks.glue")
    names = {f"{t.submission}{suffix}.tsv" for t in glue.GLUE_TASKS.values() for _, suffix in t.test_files}
    assert set(GLUE_FILES) == names | {"AX.tsv"}
    assert glue.submission_text(glue.GLUE_TASKS["rte"], [], []).rstrip("\n") == bundle_mod.HEADER


def test_check_submission_file(tmp_path):
    good, nohead, empty, bad = (tmp_path / n for n in ("g.tsv", "h.tsv", "e.tsv", "b.tsv"))
    good.write_text(tsv())
    nohead.write_text("0\t1\n")
    empty.write_text(tsv(rows=0))
    bad.write_text("index\tprediction\n0 1\n")
    assert check_submission_file(str(good)) is None
    assert "first line must be the header" in check_submission_file(str(nohead))
    assert "no prediction rows" in check_submission_file(str(empty))
    assert "line 2" in check_submission_file(str(bad))


def test_glue_bundle_zips_good_files_and_lists_missing_and_bad(tmp_path):
    runs = tmp_path / "runs"
    mnli = make_trial(runs, "mnli", {}, 0, metrics={"dev_matched/accuracy": 0.8},
                      submission={"submission/MNLI-m.tsv": tsv(), "submission/MNLI-mm.tsv": tsv(3),
                                  "submission/AX.tsv": tsv()})
    cola = make_trial(runs, "cola", {}, 0, metrics={"matthews_corr": 0.5}, submission={"submission/CoLA.tsv": tsv()})
    rte = make_trial(runs, "rte", {}, 0, metrics={"accuracy": 0.7}, submission={"submission/RTE.tsv": "0\tx\n"})
    sst2 = make_trial(runs, "sst2", {}, 0, metrics={"accuracy": 0.9})  # no test file given
    selections = [select(t, [r]) for t, r in (("mnli", mnli), ("cola", cola), ("rte", rte), ("sst2", sst2))]
    out = tmp_path / "out"
    b = glue_bundle(selections, str(out))
    assert b.zip_path == str(out / "glue_submission.zip")
    assert sorted(b.included) == ["AX.tsv", "CoLA.tsv", "MNLI-m.tsv", "MNLI-mm.tsv"]
    with zipfile.ZipFile(b.zip_path) as z:
        assert sorted(z.namelist()) == sorted(b.included)
        assert z.read("MNLI-mm.tsv").decode() == tsv(3)
    assert len(b.problems) == 1 and "RTE.tsv: first line must be the header" in b.problems[0]
    missing = {m.split(":")[0] for m in b.missing}
    assert missing == {"SST-2.tsv", "MRPC.tsv", "STS-B.tsv", "QQP.tsv", "QNLI.tsv", "WNLI.tsv"}
    assert any(m.startswith("SST-2.tsv") and "no test file" in m for m in b.missing)
    assert sorted(os.listdir(out)) == ["glue_submission.zip"]  # no temporary left


def test_no_good_file_writes_no_zip(tmp_path):
    b = glue_bundle([select("rte", [])], str(tmp_path / "out"))
    assert b.zip_path is None and len(b.missing) == len(GLUE_FILES)
    assert not os.path.exists(tmp_path / "out" / "glue_submission.zip")


def test_squad_and_swag_predictions_copied(tmp_path):
    runs = tmp_path / "runs"
    squad = make_trial(runs, "squad", {}, 0, metrics={"f1": 88.0, "exact_match": 80.0},
                       submission={"submission/SQuAD.json": '{"q": "a"}',
                                   "predictions/dev-v1.1/predictions.json": '{"d": "b"}',
                                   "predictions/dev-v1.1/nbest_predictions.json": "{}"})
    swag = make_trial(runs, "swag", {}, 0, metrics={"accuracy": 0.8},
                      submission={"submission/SWAG.csv": "pred\n", "predictions/val.tsv": tsv()})
    out = tmp_path / "out"
    copied = copy_predictions([select("squad", [squad]), select("swag", [swag])], str(out))
    assert sorted(os.path.relpath(p, out) for p in copied) == [
        "squad/predictions/dev-v1.1/predictions.json", "squad/submission/SQuAD.json",
        "swag/predictions/val.tsv", "swag/submission/SWAG.csv"]
    assert (out / "squad/submission/SQuAD.json").read_text() == '{"q": "a"}'
    b = write_bundle([select("swag", [swag])], str(tmp_path / "out2"))
    assert b.zip_path is None and len(b.copied) == 2


# ----------------------------------------------------------------------------- sweep.json

def test_a_relaunch_keeps_the_fixed_settings_and_may_grow_the_grid(tmp_path):
    from finetune.sweep.manifest import MANIFEST, claim_directory

    out = tmp_path / "sweep"
    first = spec_of("sweep.tasks=[rte]", "sweep.grid={train.lr: [1e-5]}", "sweep.overrides=[model.init_from=a]",
                    output_dir=str(out))
    claim_directory(first)
    stored = json.loads((out / MANIFEST).read_text())
    assert stored["overrides"] == ["model.init_from=a"] and stored["grid"] == {"train.lr": [1e-5]}
    (out / "rte").mkdir()  # trials ran
    claim_directory(first)  # the same command again
    grown = spec_of("sweep.tasks=[rte, mrpc]", "sweep.grid={train.lr: [1e-5, 2e-5]}", "sweep.restarts=3",
                    "sweep.parallel_trials=2", "sweep.overrides=[model.init_from=a]", output_dir=str(out))
    claim_directory(grown)  # more trials, more slots: the finished ones still answer the same question
    assert json.loads((out / MANIFEST).read_text())["restarts"] == 3
    for changed, key in ((["sweep.overrides=[model.init_from=b]"], "sweep.overrides"),
                         (["sweep.overrides=[model.init_from=a]", "sweep.first_seed=7"], "sweep.first_seed"),
                         (["sweep.overrides=[model.init_from=a]", "sweep.task_overrides={rte: [train.epochs=2]}"],
                          "sweep.task_overrides")):
        with pytest.raises(ConfigError) as e:
            claim_directory(spec_of("sweep.tasks=[rte]", "sweep.grid={train.lr: [1e-5]}", *changed, output_dir=str(out)))
        assert "other settings" in e.value.problems[0] and [p for p in e.value.problems[1:] if key in p], e.value.problems
        assert len(e.value.problems) == 2, e.value.problems  # only what changed is named


def test_a_foreign_or_damaged_directory_is_refused_before_anything_is_written(tmp_path):
    from finetune.sweep.manifest import MANIFEST, claim_directory
    from finetune.sweep.runner import run_sweep

    out = tmp_path / "mine"
    (out / "rte").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    spec = spec_of("sweep.tasks=[rte]", output_dir=str(out))
    with pytest.raises(ConfigError, match=r"not empty \(notes.txt, rte\) and holds no sweep.json"):
        run_sweep(spec)
    assert sorted(p.name for p in out.rglob("*")) == ["notes.txt", "rte"]
    (out / "notes.txt").unlink()
    (out / "rte").rmdir()
    claim_directory(spec)  # an empty directory is fine
    (out / MANIFEST).write_text("{trunc")
    with pytest.raises(ConfigError, match="sweep.json: unreadable"):
        claim_directory(spec)


def test_one_sweep_at_a_time_in_a_directory(tmp_path):
    from finetune.sweep.manifest import sole_sweep

    with sole_sweep(str(tmp_path / "s")):
        with pytest.raises(ConfigError, match=r"another sweep runs there \(pid \d+ on "):
            with sole_sweep(str(tmp_path / "s")):
                pass
    with sole_sweep(str(tmp_path / "s")):  # released when the first ended
        pass
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        with sole_sweep(str(tmp_path / "f")):
            pass


# ----------------------------------------------------------------------------- the queue

class _Rank0:
    rank = 0


def test_each_queued_trial_is_claimed_by_one_slot(tmp_path, monkeypatch):
    from finetune.sweep import worker
    from finetune.sweep.runner import Queue
    from pretrain.distributed import device

    monkeypatch.setattr(device, "all_gather_object", lambda obj, group=None: [obj])  # a world of one
    spec = spec_of("sweep.tasks=[rte]", "sweep.grid={train.lr: [1e-5, 2e-5, 3e-5]}", output_dir=str(tmp_path / "s"))
    queue = Queue(spec, expand(spec))
    assert [e["id"] for e in json.loads(open(queue.path).read())["trials"]] == [t.id for t in expand(spec)]
    assert all(os.path.isdir(t.output_dir(spec)) for t in expand(spec))  # trial.log has a home
    assert worker.claim_trial(queue.claims, 1, 0, 1, _Rank0())
    assert not worker.claim_trial(queue.claims, 1, 1, 1, _Rank0())  # slot 1 finds it taken
    assert worker.claim_trial(queue.claims, 0, 1, 2, _Rank0())
    assert [queue.claimed_by(k) for k in range(3)] == [(1, 2), (0, 1), None] and queue.unclaimed() == 1
    assert sorted(os.listdir(queue.claims)) == ["0", "1"]  # no drafts left behind
    Queue(spec, expand(spec)[2:])  # a relaunch starts a fresh queue
    assert os.listdir(os.path.join(spec.output_dir, ".slots", "claims")) == []


def _ended(code: int):
    """A worker process that ended with `code` (negative: killed by that signal)."""
    body = f"import os; os.kill(os.getpid(), {-code})" if code < 0 else f"raise SystemExit({code})"
    proc = subprocess.Popen([sys.executable, "-c", body])
    proc.wait()
    return proc


def test_a_dead_worker_fails_its_trial_and_is_replaced_unless_it_took_none(tmp_path, monkeypatch):
    from finetune.sweep.runner import Queue, Slot
    from pretrain.distributed.ports import PortPicker

    spec = spec_of("sweep.tasks=[rte]", "sweep.grid={train.lr: [1e-5, 2e-5, 3e-5]}", output_dir=str(tmp_path / "s"))
    trials = expand(spec)
    queue = Queue(spec, trials)
    starts = []
    monkeypatch.setattr(Slot, "start", lambda self: starts.append(self.index))
    slot = Slot(0, spec, {}, queue, PortPicker())
    slot.attempt = 1

    def claim(position, who, attempt):
        with open(os.path.join(queue.claims, str(position)), "w") as f:
            f.write(f"{who} {attempt}\n")

    claim(0, 0, 1)  # done by slot 0
    write_trial_record(trials[0].output_dir(spec), record_for(trials[0], "done"))
    with open(os.path.join(trials[0].output_dir(spec), "metrics.json"), "w") as f:
        json.dump({"best": {"metrics": {"accuracy": 0.5}}}, f)
    claim(1, 0, 1)  # running when the worker died
    slot.process = _ended(-9)
    assert slot.poll() is False and starts == [0]  # a new worker for the rest
    failed = read_trial_record(trials[1].output_dir(spec))
    assert failed.status == "failed" and "the worker of slot 0 exited with status -9" in failed.error
    assert "slot-0.log" in failed.error
    assert json.loads(open(os.path.join(trials[0].output_dir(spec), "trial.json")).read())["status"] == "done"

    slot.attempt = 2
    slot.process = _ended(1)  # the new worker dies before taking anything: the slot closes
    assert slot.poll() is True and starts == [0]
    assert read_trial_record(trials[2].output_dir(spec)) is None  # left for a relaunch
    claim(2, 0, 3)
    slot.attempt, slot.process = 3, _ended(0)
    assert slot.poll() is True  # nothing left to take
