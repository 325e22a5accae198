"""Weights & Biases and MLflow beside TensorBoard (pretrain/observability/trackers.py): a 2-rank
run saved at step 3 and resumed to step 6 gives W&B (offline, its transaction log read with its
own record definitions) and MLflow (a local file store, read with its client) the scalar series
TensorBoard gets, continuing the same tracker runs after the resume; only the logging rank
writes; the config and the checkpoints' paths reach both; a missing package is one line naming
the extra."""
import glob
import json
import os

import pytest

import _wandb_log
from distributed import REPO, ranks_pythonpath, run_ranks
from pretrain.config import ConfigError, load_config

# wandb and mlflow, installed by tools/install.sh beside the venv's packages (see there why)
TRACKERS = REPO / ".venv" / "trackers"


@pytest.fixture
def trackers_on_path(monkeypatch):
    assert (TRACKERS / "wandb").is_dir() and (TRACKERS / "mlflow").is_dir(), \
        f"{TRACKERS} holds no wandb and mlflow: run tools/install.sh"
    monkeypatch.syspath_prepend(str(TRACKERS))
    return str(TRACKERS)

SERIES = ("train/lm_loss", "train/learning_rate", "perf/real_tokens_per_second", "eval/lm_loss")


def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch):
    from pretrain.observability import trackers

    cfg = load_config("configs/bert-tiny.yaml", ["logging.wandb_project=p", "logging.mlflow_experiment=e"])
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    assert trackers.tracker_problems(cfg) == [
        "logging.wandb_project needs the wandb package, which is not installed: pip install 'bert-pretrain[wandb]' "
        "(or pip install -e '.[wandb]' in the repository)",
        "logging.mlflow_experiment needs the mlflow package, which is not installed: pip install "
        "'bert-pretrain[mlflow]' (or pip install -e '.[mlflow]' in the repository)"]
    with pytest.raises(ConfigError, match=r"logging.wandb_mode \('cloud'\) must be online or offline"):
        load_config("configs/bert-tiny.yaml", ["logging.wandb_mode=cloud"]).validate()


@pytest.mark.slow
def test_trackers_get_tensorboards_series_and_continue_after_a_resume(tmp_path, monkeypatch, trackers_on_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save, uri = tmp_path / "ckpt", f"file://{tmp_path / 'mlruns'}"
    base = ["train.train_steps=6", "eval.interval=3", "eval.steps=1", f"logging.tensorboard_dir={tmp_path / 'tb'}",
            "logging.wandb_project=bert-tests", "logging.wandb_mode=offline", f"logging.wandb_dir={tmp_path / 'wb'}",
            "logging.mlflow_experiment=bert-tests", f"logging.mlflow_tracking_uri={uri}",
            f"checkpoint.save_dir={save}", "checkpoint.save_interval=3"]
    runs = [json.dumps({"name": "first", "overrides": base + ["resilience.exit_after_steps=3"]}),
            json.dumps({"name": "second", "overrides": base + [f"checkpoint.load_dir={save}"]})]
    out = tmp_path / "out.json"
    run_ranks(["tests/_train_worker.py", str(out), "1", "1", *runs], 2, timeout=600,
              env={"WANDB_SILENT": "true", "MLFLOW_ALLOW_FILE_STORE": "true",
                   "PYTHONPATH": f"{ranks_pythonpath()}{os.pathsep}{trackers_on_path}"})
    results = json.loads(out.read_text())
    assert [len(results[n]["history"]) for n in ("first", "second")] == [3, 3]

    board = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    board.Reload()
    tensorboard = {tag: {e.step: e.value for e in board.Scalars(tag)} for tag in SERIES}
    assert sorted(tensorboard["train/lm_loss"]) == [1, 2, 3, 4, 5, 6] and sorted(tensorboard["eval/lm_loss"]) == [3, 6]

    # W&B: one offline run directory per launch (the logging rank's only), both the same run
    logs = sorted(glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(logs) == 2, logs
    ids = set().union(*(_wandb_log.run_ids(log) for log in logs))
    assert len(ids) == 1 and json.loads((save / "trackers.json").read_text())["wandb"] in ids
    wandb = {}
    for log in logs:
        for key, values in _wandb_log.history(log).items():
            wandb.setdefault(key, {}).update(values)
    # MLflow: one run, read back with its own client
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in to a local file store
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("bert-tests")
    mlflow_runs = client.search_runs([experiment.experiment_id])
    assert len(mlflow_runs) == 1 and mlflow_runs[0].info.run_id == json.loads((save / "trackers.json").read_text())["mlflow"]
    run_id = mlflow_runs[0].info.run_id
    for tag in SERIES:
        history = {m.step: m.value for m in client.get_metric_history(run_id, tag)}
        for name, got in (("wandb", wandb[tag]), ("mlflow", history)):
            assert sorted(got) == sorted(tensorboard[tag]), (name, tag)
            assert [got[s] for s in sorted(got)] == pytest.approx([tensorboard[tag][s] for s in sorted(got)],
                                                                  rel=1e-6), (name, tag)
    # the config and the checkpoints
    run = client.get_run(run_id)
    assert run.data.params["train.train_steps"] == "6" and run.data.params["model.hidden_size"] == "64"
    assert run.data.tags["last_checkpoint"] == f"{save}/iter_0000006"
    assert {m.step for m in client.get_metric_history(run_id, "checkpoint/step")} == {3, 6}
    assert sorted(wandb["checkpoint/step"]) == [3, 6]


def test_a_tracker_that_cannot_start_is_one_line_naming_its_key(tmp_path, monkeypatch, trackers_on_path):
    """MLflow 3 refusing a local file store without its opt-in: one line naming the key and the URI
    (W&B's online start needs the network, which the tests have not)."""
    from pretrain.common.errors import UserError
    from pretrain.observability.trackers import Trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")
    cfg = load_config("configs/bert-tiny.yaml", ["logging.mlflow_experiment=e",
                                                 f"logging.mlflow_tracking_uri=file://{tmp_path / 'mlruns'}"])
    with pytest.raises(UserError, match=r"^logging.mlflow_experiment: the tracker could not start its run "
                                        r"\(MlflowException: .*\); check logging.mlflow_tracking_uri \(file://"):
        Trackers(cfg, cfg.to_dict())
