"""Experiment trackers beside TensorBoard: Weights & Biases (logging.wandb_project) and MLflow
(logging.mlflow_experiment), written by the logging rank only, as TensorBoard is.

Each receives the scalars TensorBoard receives, by step and under the same names (train/lm_loss,
perf/real_tokens_per_second, eval/perplexity, ...), the run's config once (W&B's config, MLflow's
params as section.key), and the checkpoints as they are saved (W&B's summary and MLflow's tags:
the last checkpoint's path, and checkpoint/step as a series).

A resumed run continues the same tracker runs: their ids are kept in checkpoint.save_dir's
trackers.json, written when the runs start and read by a run that starts in that directory again.
A missing package is one line naming the extra to install, before any rank starts
(tracker_problems).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time

from ..common.atomic import atomic_outputs
from ..common.errors import UserError

logger = logging.getLogger(__name__)

RUN_IDS = "trackers.json"
# (config key that turns it on, the module, the extra that installs it)
PACKAGES = (("wandb_project", "wandb", "wandb"), ("mlflow_experiment", "mlflow", "mlflow"))
MLFLOW_PARAM_CHARS = 500  # MLflow's limit on a parameter's value
MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit)
MLFLOW_METRICS = 1000  # metrics per log_batch call (MLflow's limit; a large job's stragglers/* exceed it)


def tracker_problems(cfg) -> list[str]:
    """A tracker asked for whose package is not installed: one line each, naming the extra."""
    out = []
    for key, module, extra in PACKAGES:
        if getattr(cfg.logging, key) and importlib.util.find_spec(module) is None:
            out.append(f"logging.{key} needs the {module} package, which is not installed: "
                       f"pip install 'bert-pretrain[{extra}]' (or pip install -e '.[{extra}]' in the repository)")
    return out


def flat_config(stored: dict) -> dict[str, object]:
    """{section: {key: value}} as {"section.key": value}."""
    return {f"{section}.{key}": value for section, values in stored.items() if isinstance(values, dict)
            for key, value in values.items()}


class Trackers:
    """The trackers the config turns on (none: every call does nothing)."""

    def __init__(self, cfg, stored_config: dict):
        lg = cfg.logging
        self.save_dir = cfg.checkpoint.save_dir
        ids = self._read_ids()
        self.backends = []
        if lg.wandb_project:
            self.backends.append(_started("logging.wandb_project", "log in (wandb login, or WANDB_API_KEY), or set "
                                          "logging.wandb_mode=offline",
                                          lambda: WandbTracker(lg, ids.get("wandb"), stored_config, self.save_dir)))
        if lg.mlflow_experiment:
            self.backends.append(_started("logging.mlflow_experiment", "check logging.mlflow_tracking_uri "
                                          f"({lg.mlflow_tracking_uri or 'MLflow default'})",
                                          lambda: MlflowTracker(lg, ids.get("mlflow"), stored_config)))
        if self.backends and self.save_dir:
            self._write_ids({backend.name: backend.run_id for backend in self.backends})

    def _read_ids(self) -> dict:
        path = os.path.join(self.save_dir, RUN_IDS) if self.save_dir else None
        if path is None or not os.path.exists(path):
            return {}
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError) as error:
            logger.warning(f"{path} unreadable ({error}): the trackers start new runs")
            return {}

    def _write_ids(self, ids: dict) -> None:
        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, RUN_IDS)
        with atomic_outputs([path]) as temps, open(temps[path], "w", encoding="utf-8") as f:
            json.dump(ids, f, indent=1)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for backend in self.backends:
            backend.scalars(values, step)

    def checkpoint(self, path: str, step: int) -> None:
        for backend in self.backends:
            backend.checkpoint(path, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()


def _started(key: str, advice: str, start):
    """The tracker `start()` makes; its failure to start (no login, no server) one line naming the key."""
    try:
        return start()
    except Exception as error:  # noqa: BLE001 (any of the tracker's own errors: not ours to list)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{key}: the tracker could not start its run ({type(error).__name__}: {first}); "
                        f"{advice}") from None


class WandbTracker:
    name = "wandb"

    def __init__(self, lg, run_id: str | None, stored_config: dict, save_dir: str | None):
        import wandb

        directory = lg.wandb_dir or save_dir or os.getcwd()
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=lg.wandb_project, name=lg.wandb_run_name, id=run_id,
                              resume="allow" if run_id else None, mode=lg.wandb_mode, dir=directory,
                              config=stored_config)
        self.run_id = self.run.id
        logger.info(f"W&B run {self.run_id} ({lg.wandb_mode}, project {lg.wandb_project}"
                    + (", continued" if run_id else "") + f"), files under {directory}")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def checkpoint(self, path: str, step: int) -> None:
        self.run.log({"checkpoint/step": step}, step=step)
        self.run.summary["last_checkpoint"] = path

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, lg, run_id: str | None, stored_config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=lg.mlflow_tracking_uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(lg.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self.client.create_experiment(lg.mlflow_experiment))
            self.run_id = self.client.create_run(experiment_id, run_name=lg.mlflow_run_name).info.run_id
            params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in flat_config(stored_config).items()]
            for first in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, params=params[first:first + MLFLOW_BATCH])
        else:  # a resumed run: its params are logged already (MLflow refuses to change them)
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        logger.info(f"MLflow run {self.run_id} (experiment {lg.mlflow_experiment}"
                    + (", continued" if run_id else "") + f") at {self.client.tracking_uri}")

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        for first in range(0, len(metrics), MLFLOW_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[first:first + MLFLOW_METRICS])

    def checkpoint(self, path: str, step: int) -> None:
        self.scalars({"checkpoint/step": step}, step)
        self.client.set_tag(self.run_id, "last_checkpoint", path)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
