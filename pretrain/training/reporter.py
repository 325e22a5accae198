"""What a pretraining run reports: the console line of each log window, TensorBoard scalars (and
the same to Weights & Biases and MLflow, observability/trackers.py), the evaluation results file,
and the first steps' memory beside the planner's prediction. It owns the run's history (every
step's reduced metrics), which stays readable after a failure."""
from __future__ import annotations

import logging

import json
import math
import os
import resource
import sys

import torch

from ..common.atomic import atomic_outputs
from ..common.errors import UserError
from ..config import Config
from ..distributed import device
from ..distributed.parallel import Parallel
from ..model.flops import encoder_flops_per_row, head_flops_per_sample
from ..observability.console import duration
from ..observability.device_memory import MB
from ..observability.stragglers import WindowFigures
from ..observability.timers import PHASE_LABELS
from ..observability.trackers import Trackers
from ..plan import predict_rank_memory

logger = logging.getLogger(__name__)


# FirstStepMemory's figures as the log line names them
MEMORY_ITEMS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
                ("activations_peak", "activations peak"), ("device_peak", "device peak"))


class Reporter:
    def __init__(self, cfg: Config, parallel: Parallel):
        self.cfg, self.parallel = cfg, parallel
        self.reports = parallel.rank == parallel.logging_rank  # the rank that writes TensorBoard and eval.results
        self.history: list[dict] = []  # every step's reduced metrics with its host figures
        self.first_step_memory: list[dict] | None = None  # every rank's measured and planned memory
        results, tensorboard_dir = cfg.eval.results, cfg.logging.tensorboard_dir
        self.eval_results = EvalResults(results) if results and self.reports else None
        self.writer = None
        if tensorboard_dir and self.reports:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)
        self.trackers = Trackers(cfg, cfg.to_dict()) if self.reports else None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def checkpoint_saved(self, path: str, step: int) -> None:
        """A checkpoint is complete: the trackers record its path."""
        if self.trackers is not None:
            self.trackers.checkpoint(path, step)

    @property
    def nsp_keys(self) -> tuple[str, ...]:
        """The next-sentence metrics, which a model without the binary head does not have."""
        return ("nsp_loss", "nsp_accuracy") if self.cfg.binary_head else ()

    def scalars(self, prefix: str, values: dict, step: int, consumed_samples: int) -> None:
        if self.trackers is not None:  # by step (their own x-axis choices plot them against anything logged)
            self.trackers.scalars({f"{prefix}/{name}": value for name, value in values.items()}, step)
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, step)
            self.writer.add_scalar(f"{prefix}-vs-samples/{name}", value, consumed_samples)

    def training(self, step: int, consumed_samples: int, metrics: dict, perf: dict, phase_ms: dict[str, float],
                 extra: dict, ranks: WindowFigures | None = None) -> None:
        """The log line of a window ending at `step`: its last step's `metrics`, the window's
        `perf` (ThroughputWindow.rates plus iteration_time and data_wait_time per step), `extra`
        train scalars (params_norm, loss_scale), and every rank's own figures (`ranks`,
        logging.stragglers: their spread on the line, each rank's in TensorBoard, the straggler
        warnings). The model FLOPs are those of the rows computed (the encoder) and of the
        samples (the heads)."""
        t, seconds = self.cfg.train, perf["iteration_time"]
        rows = perf["tokens_per_second"] * seconds / self.cfg.data.seq_length  # = global batch unless packed
        flops = encoder_flops_per_row(self.cfg) * rows + head_flops_per_sample(self.cfg) * metrics["global_batch_size"]
        perf = dict(perf, model_tflops_per_rank=flops / seconds / 1e12 / self.parallel.world_size,
                    peak_memory_gb=peak_memory_gb(self.parallel.device))
        train = {k: metrics[k] for k in ("loss", "lm_loss", *self.nsp_keys, "mlm_accuracy", "learning_rate",
                                          "grad_norm", "skipped_steps", "global_batch_size", "tokens_seen")}
        self.scalars("train", dict(train, **extra), step, consumed_samples)
        self.scalars("perf", perf, step, consumed_samples)
        self.scalars("time", {f"{phase}_ms": ms for phase, ms in phase_ms.items()}, step, consumed_samples)
        if ranks is not None and self.writer is not None:  # by step only: one scalar per rank and figure
            for name, value in ranks.scalars().items():
                self.writer.add_scalar(f"stragglers/{name}", value, step)
        if ranks is not None and self.trackers is not None:
            self.trackers.scalars({f"stragglers/{name}": value for name, value in ranks.scalars().items()}, step)
        phases = " ".join(f"{PHASE_LABELS[phase]} {ms:.0f}" for phase, ms in phase_ms.items())
        nsp = f"| nsp {metrics['nsp_loss']:.4f} " if self.cfg.binary_head else ""
        logger.info(
            f"step {step}/{t.train_steps} | loss {metrics['loss']:.4f} | lm {metrics['lm_loss']:.4f} "
            f"{nsp}| mlm acc {metrics['mlm_accuracy']:.3f} | lr {metrics['learning_rate']:.3e} "
            f"| grad norm {metrics['grad_norm']:.3f} "
            + (f"| batch {metrics['global_batch_size']} " if t.batch_warmup_tokens else "")
            + f"| tokens {_count(metrics['tokens_seen'])} | {perf['real_tokens_per_second']:.0f} real tok/s "
            f"({perf['tokens_per_second']:.0f} computed, {100 * perf['real_token_share']:.0f}% real) "
            f"| data wait {1e3 * perf['data_wait_time']:.0f} ms/step "
            + (f"| {ranks.line()} " if ranks is not None else "") +
            f"| {perf['model_tflops_per_rank'] * 1e3:.1f} GFLOP/s/rank | ETA {duration(seconds * (t.train_steps - step))}"
            + (f" | skipped {metrics['skipped_steps']}" if metrics["skipped_steps"] else "")
            + (f" | ms/step: {phases}" if phases else ""))
        if ranks is not None and self.reports:  # every rank has the figures: one rank says it
            for line in ranks.warnings:
                logger.warning(line)
            for line in ranks.back:
                logger.info(line)

    def evaluation(self, split: str, metrics: dict, step: int, consumed_samples: int) -> None:
        """One evaluation ("eval": the validation set, "test"): console, TensorBoard, eval.results."""
        metrics = {k: v for k, v in metrics.items() if not k.startswith("nsp_") or k in self.nsp_keys}
        metrics["perplexity"] = math.exp(min(metrics["lm_loss"], 50.0))
        self.scalars(split, metrics, step, consumed_samples)
        nsp = (f" | nsp {metrics['nsp_loss']:.4f}", f" | nsp acc {metrics['nsp_accuracy']:.3f}") \
            if self.cfg.binary_head else ("", "")
        logger.info(f"{split} at step {step} | lm {metrics['lm_loss']:.4f} | perplexity {metrics['perplexity']:.2f}"
                 f"{nsp[0]} | mlm acc {metrics['mlm_accuracy']:.3f}{nsp[1]}")
        if self.eval_results is not None:
            self.eval_results.add("valid" if split == "eval" else split, step, consumed_samples, metrics)

    def memory(self, measured: dict[str, int], step: int, consumed_samples: int) -> None:
        """Every rank's measured breakdown beside the planner's prediction for it, one line per
        rank on the logging rank (one collective, once); kept in `first_step_memory`."""
        p = self.parallel
        try:
            planned = predict_rank_memory(self.cfg, p.world_size, p.pp_rank, p.device.type, p.dp_cp_rank).breakdown()
        except Exception as error:  # a planner bug must not stop a training run: say it, go on
            planned = {}
            logger.warning(f"memory planner failed on rank {p.rank}: {type(error).__name__}: {error}")
        self.first_step_memory = device.all_gather_object({"measured": measured, "planned": planned})
        for rank, report in enumerate(self.first_step_memory):
            logger.info(f"memory of rank {rank} in step {step}: "
                     + " | ".join(_memory_item(label, key, report) for key, label in MEMORY_ITEMS
                                  if key in report["measured"]))
        mine = self.first_step_memory[p.rank]
        self.scalars("memory", {f"{key}_mb": value / MB for key, value in mine["measured"].items()}, step,
                     consumed_samples)
        self.scalars("memory", {f"planned_{key}_mb": value / MB for key, value in mine["planned"].items()}, step,
                     consumed_samples)


class EvalResults:
    """eval.results: a JSON file {"valid": [...], "test": [...]} of {step, consumed_samples,
    metrics} entries, read once (a resumed run keeps what came before), rewritten atomically after
    each evaluation. Entries at a step being evaluated again (after a crash past them) are replaced."""

    def __init__(self, path: str):
        self.path = path
        self.results: dict | None = None

    def _read(self) -> dict:
        results = {"valid": [], "test": []}
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding="utf-8") as f:
                    results.update(json.load(f))
            except (OSError, ValueError) as err:
                raise UserError(f"eval.results: {self.path} cannot be read as JSON ({err}); move it away") from None
        return results

    def add(self, split: str, step: int, consumed_samples: int, metrics: dict) -> None:
        if self.results is None:
            self.results = self._read()
        entries = [e for e in self.results.get(split, []) if e["step"] < step]
        self.results[split] = entries + [{"step": step, "consumed_samples": consumed_samples, "metrics": metrics}]
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with atomic_outputs([self.path]) as temps, open(temps[self.path], "w", encoding="utf-8") as f:
            json.dump(self.results, f, indent=1)


def _memory_item(label: str, key: str, report: dict) -> str:
    text = f"{label} {report['measured'][key] / MB:,.1f} MB"
    if key in report["planned"]:
        text += f" (planned {report['planned'][key] / MB:,.1f})"
    return text


def peak_memory_gb(on: torch.device) -> float:
    """The device's allocated peak (GPUs, the CPU test device); the process's peak resident memory on the CPU."""
    peak = device.peak_memory_allocated(on)
    if peak is not None:
        return peak / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30


def _count(n: float) -> str:
    """A token count for the log line: 512, 12.3K, 4.50M, 1.70B, 2.00T."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 100 * scale else f"{n / scale:.0f}{suffix}"
    return f"{n:.0f}"
