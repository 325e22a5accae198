"""The fine-tuning loop, the same for every task: data and tensor parallelism through the
pretraining stack, AdamW with warmup and linear decay, evaluation each epoch, best-epoch weights,
prediction and submission files, TensorBoard and progress bars. What differs between tasks (data
files, inputs, head, loss, metrics, output files, exported architecture) is the task object's
(finetune/tasks).

Every rank runs the same code. A global batch is cut into micro-batches exactly as in
pretraining (DP rank r takes the r-th slice of each accumulation step); TP ranks of a replica see
the same data. Evaluation shards the examples over DP ranks and gathers the outputs.
"""
from __future__ import annotations

import logging

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.checkpoint.format import CheckpointError
from pretrain.checkpoint.load import read_any
from pretrain.checkpoint.sharding import unpad_vocab
from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer, save_vocab
from pretrain.checkpoint.trained_length import longest
from pretrain.config import deepspeed_settings
from pretrain.common.diskspace import disk_full_named
from pretrain.common.atomic import atomic_outputs
from pretrain.data.samples.batches import micro_batch_indices
from pretrain.distributed.device import (DeviceError, all_gather, all_gather_object, all_reduce, configure_math,
                                        describe, precision_problem, to_host)
from pretrain.common.errors import UserError
from pretrain.distributed.internals import is_tp_sharded
from pretrain.model.names import logical_parameters
from pretrain.model.rng import RngTracker, seed_streams
from pretrain.observability.console import progress
from pretrain.optim import make_lr_scheduler
from pretrain.optim.groups import group_by_kind
from pretrain.resilience.watchdog import Watchdog
from pretrain.training.engine import initialize_engine
from pretrain.training.metrics import ThroughputWindow

from .config import FinetuneConfig
from .input_cache import cached, entry_key
from .inputs import Batches, length_grouped
from .model import build_encoder, initialise_head, load_encoder
from .official_metrics import official_metric
from .tasks import TASKS
from .tasks.base import Dataset, Read, TaskDataError

logger = logging.getLogger(__name__)


# Hugging Face's group_by_length sorts windows of 50 batches (its mega-batch multiplier).
LENGTH_GROUP_WINDOW = 50


class FinetuneError(UserError, RuntimeError):
    """Bad input found after start-up (a data file, the checkpoint, the tokenizer)."""


def write_files(directory: str, files: dict[str, str]) -> None:
    """Each file under `directory` (subdirectories made), under a temporary name until complete."""
    for relative, content in files.items():
        path = os.path.join(directory, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_outputs([path]) as temporary:
            with open(temporary[path], "w", encoding="utf-8", newline="") as f:  # the task's line ends as given
                f.write(content)


# Pretraining heads fine-tuning never runs: that a checkpoint lacks them (a BertModel directory)
# and they were initialised on reading is no news to a fine-tuning user. The pooler is: the task
# heads read the pooled [CLS].
UNUSED_PRETRAINING_HEADS = ("next-sentence head", "MLM head")


def notes_that_matter(notes: list[str]) -> list[str]:
    """The checkpoint reader's notes worth a fine-tuning log line."""
    return [note for note in notes if not any(f" has no {head}:" in note for head in UNUSED_PRETRAINING_HEADS)]


class Finetuner:
    def __init__(self, cfg: FinetuneConfig, parallel, checkpoint=None):
        """`checkpoint`: model.init_from as read_any read it, for a process that fine-tunes it several
        times (a sweep's worker reads it once); its tensors are only read."""
        self.cfg, self.parallel = cfg, parallel
        self.pending_files: dict[str, str] = {}  # prediction files of the last evaluation, written if it is the best
        self.task = TASKS[cfg.task.name].configured(cfg.task)
        t = cfg.train
        self.ckpt = checkpoint if checkpoint is not None else read_init_from(cfg.model.init_from)
        for note in notes_that_matter(self.ckpt.notes):
            logger.info(note)
        m = self.ckpt.config.model
        if cfg.model.classifier_pooling is not None and not m.modern:
            raise FinetuneError(f"model.classifier_pooling is ModernBERT's; {self.ckpt.source} is a "
                                f"{m.architecture} model (its sequence heads read the pooled [CLS])")
        self.model_cfg = replace(with_dropout(m, cfg.model),
                                 classifier_pooling=cfg.model.classifier_pooling or m.classifier_pooling)
        self.tokenizer = checkpoint_tokenizer_of(self.ckpt, cfg.model.vocab_file)
        self._read_data()
        prepare_device(parallel, t)
        logger.info(f"{describe(parallel)}, ZeRO-{cfg.parallel.zero_stage}, {t.precision}")
        self.tracker = RngTracker(parallel.device)
        seed_streams(self.tracker, t.seed, parallel.tp_rank, 0, parallel.dp_rank)
        bert = build_encoder(self.model_cfg, parallel.tp_group, self.tracker)
        load_encoder(bert, self.ckpt.weights, self.model_cfg, parallel.tp_rank, parallel.tp_size)
        self.model = self.task.build_model(bert, self.model_cfg, cfg.model, t.seed)
        try:
            note = initialise_head(self.model.head, self.ckpt)
        except ValueError as e:
            raise FinetuneError(str(e)) from None
        if note:
            logger.info(note)
        self.micro_per_step = t.global_batch_size // (t.micro_batch_size * parallel.dp_size)
        # train.padding "longest" rounds a batch's length up to this (pad_to_multiple_of, by device)
        self.pad_multiple = t.pad_to_multiple_of or (1 if parallel.device.type == "cpu" else 8)
        self.steps_per_epoch = max(1, math.ceil(len(self.train_features) / t.global_batch_size)) \
            if self.train_features is not None else 0
        self.total_steps = max(1, math.ceil(t.epochs * self.steps_per_epoch))
        self.engine = self._build_engine()
        self.watchdog = Watchdog.for_job(t.hang_timeout_minutes, parallel, key="train.hang_timeout_minutes")
        self.writer = None
        if parallel.rank == parallel.logging_rank:
            os.makedirs(t.output_dir, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(t.tensorboard_dir or os.path.join(t.output_dir, "tensorboard"))

    # ----------------------------------------------------------------------------- data
    def _inputs(self, path: str, split: str, training: bool = False) -> tuple[Read, Batches]:
        """A data file read and encoded, or both from task.cache_dir (finetune/input_cache.py: a
        sweep's runs tokenize each file once; the logging rank writes the entry)."""
        def read_and_encode() -> tuple[Read, Batches]:
            try:
                read = self.task.read(path, split, self.cfg.task)
            except TaskDataError as e:
                raise FinetuneError(str(e)) from None
            return read, self.task.encode(self.tokenizer.tokenizer, read.examples, self.cfg.task, training,
                                          self.tokenizer.specials)

        key = None
        if self.cfg.task.cache_dir:
            key = entry_key(path, split, training, self.cfg.task, self.tokenizer.to_str(), self.tokenizer.specials)
        read, features = cached(self.cfg.task.cache_dir, key, read_and_encode, f"{self.task.name} {split} ({path})",
                                write=self.parallel.rank == self.parallel.logging_rank)
        logger.info(read.report.summary())
        return read, features

    def _dataset(self, name: str, path: str, split: str) -> Dataset:
        read, features = self._inputs(path, split)
        return Dataset(name, read.examples, features, read.reference)

    def _read_data(self) -> None:
        c, task = self.cfg.task, self.task

        def default(name):
            return os.path.join(c.data_dir, name) if c.data_dir else None

        train_path = c.train_file or default(task.train_file)
        self.train_features = None
        if not self.cfg.train.eval_only:
            if not train_path or not os.path.exists(train_path):
                raise FinetuneError(f"no training file: {train_path} (set task.train_file, or train.eval_only)")
            self.train_features = self._inputs(train_path, "train", training=True)[1]
        dev_paths = c.dev_files or [default(f) for f in task.dev_files]
        self.dev_sets: list[Dataset] = []
        for path in dev_paths:
            if path and os.path.exists(path):
                self.dev_sets.append(self._dataset(os.path.splitext(os.path.basename(path))[0], path, "dev"))
            elif path:
                logger.info(f"{path}: not found; this dev set is left out")
        if not self.dev_sets:
            raise FinetuneError(f"no dev file for {task.name} (looked for {', '.join(map(str, dev_paths))})")
        self.test_sets: list[Dataset] = []
        for test in task.test_inputs(c):
            if os.path.exists(test.path):
                self.test_sets.append(self._dataset(test.submission, test.path, "test"))
            elif not test.optional:
                logger.info(f"{test.path}: not found; no predictions for it")

    # ----------------------------------------------------------------------------- engine
    def _build_engine(self):
        t, p = self.cfg.train, self.parallel
        batch = (t.global_batch_size, t.micro_batch_size, self.micro_per_step)
        return adamw_engine(self.model, self.model.bert, t, p, self.cfg.parallel.zero_stage, self.total_steps, batch)

    # ----------------------------------------------------------------------------- training
    def _epoch_order(self, epoch: int) -> list[int]:
        """A seeded permutation, wrapped around to whole global batches; with train.group_by_length
        sorted by length within windows of LENGTH_GROUP_WINDOW global batches."""
        n, batch = len(self.train_features), self.cfg.train.global_batch_size
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.train.seed + epoch)).tolist()
        order = (order * math.ceil(self.steps_per_epoch * batch / n + 1))[: self.steps_per_epoch * batch]
        if self.cfg.train.group_by_length:
            order = length_grouped(order, self.train_features.lengths, LENGTH_GROUP_WINDOW * batch)
        return order

    def _micro_batches(self, order: list[int], step: int):
        """This rank's example indices for each micro-step of `step`, by pretraining's rule."""
        t, p = self.cfg.train, self.parallel
        for a in range(self.micro_per_step):
            consumed = step * t.global_batch_size + a * t.micro_batch_size * p.dp_size
            yield [order[i] for i in micro_batch_indices(consumed, t.micro_batch_size, p.dp_rank, p.dp_size)]

    def train(self) -> dict:
        self.watchdog.start()
        try:
            return self._train()
        finally:
            self.watchdog.stop()

    def close(self) -> None:
        """Let go of the engine and the event file: a process that fine-tunes again (a sweep's worker)
        starts the next run without this one's hooks, buffers and open files."""
        if self.writer is not None:
            self.writer.close()
        self.engine.destroy()

    def _train(self) -> dict:
        t = self.cfg.train
        history, best, self.train_losses = [], None, []
        if t.eval_only:
            result = self.evaluate_all(epoch=0)
            self.write_predictions()
            self.predict_tests()
            return self._finish(history=[result], best=result)
        step, progress = 0, self._progress(self.total_steps)
        epochs = math.ceil(t.epochs)
        window = ThroughputWindow(self.parallel.device, unit="examples")  # since the last logged step
        for epoch in range(epochs):
            order = self._epoch_order(epoch)
            self.engine.train()
            steps_this_epoch = min(self.steps_per_epoch, self.total_steps - step)
            for s in range(steps_this_epoch):
                lr = self.engine.get_lr()[0]
                self.watchdog.doing(f"step {step + 1}: forward, backward, gradient reduction, optimizer", step)
                losses = []
                for indices in self._micro_batches(order, s):
                    inputs, labels = self.train_features.batch(indices, self.parallel.device, t.padding,
                                                               self.pad_multiple)
                    window.add(inputs[2])
                    loss = self.task.loss(self.engine(*inputs), labels)
                    self.engine.backward(loss)
                    self.engine.step()
                    losses.append(loss.detach())
                step += 1
                self.watchdog.progress(f"step {step}", step)
                loss_value = self._mean_over_dp(torch.stack(losses).mean())
                self.train_losses.append(loss_value)
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.4f}", epoch=epoch + 1)
                if step % t.log_interval == 0 or step == self.total_steps:
                    self._scalar("train/loss", loss_value, step)
                    self._scalar("train/learning_rate", lr, step)
                    for name, value in self._throughput(window).items():
                        self._scalar(f"perf/{name}", value, step)
            result = self.evaluate_all(epoch + 1, step)
            history.append(result)
            if best is None or result["score"] > best["score"]:
                best = result
                if t.keep_best:
                    self.save_best(result)
                self.write_predictions()
                self.predict_tests()
            window.restart()  # the evaluation's and the saves' time is not training's
        progress.close()
        return self._finish(history, best)

    def _finish(self, history, best) -> dict:
        summary = {"task": self.task.name, "selected_by": official_metric(self.task.name).description,
                   "history": history, "best": best, "train_losses": self.train_losses}
        if self.parallel.rank == self.parallel.logging_rank:
            path = os.path.join(self.cfg.train.output_dir, "metrics.json")
            with atomic_outputs([path]) as temporary, open(temporary[path], "w") as f:
                json.dump(summary, f, indent=2)
            self.writer.flush()
            logger.info(f"best: epoch {best['epoch']} by the {summary['selected_by']} ({best['score']:.4f}): "
                        + " ".join(f"{k} {v:.4f}" for k, v in best["metrics"].items()))
        return summary

    def _progress(self, total: int):
        enabled = self.cfg.train.progress and self.parallel.rank == self.parallel.logging_rank
        return progress(total, f"fine-tuning {self.task.name}", enabled=enabled, unit="step")

    def _scalar(self, name, value, step) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def _throughput(self, window: ThroughputWindow) -> dict[str, float]:
        """The window's rates over the data-parallel ranks (one collective)."""
        counts = window.counts()
        if self.parallel.dp_size > 1:
            all_reduce(counts, self.parallel.dp_group)
        return window.rates(*counts.tolist())

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        value = value.float().clone().to(self.parallel.device)
        if self.parallel.dp_size > 1:
            all_reduce(value, self.parallel.dp_group)
            value /= self.parallel.dp_size
        return value.item()

    # ----------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def outputs(self, features: Batches) -> np.ndarray:
        """Logits of every example, in file order (each DP rank computes a shard; all ranks get
        all). Examples are taken longest first, so that a batch pads little; token-level logits
        of a batch cut shorter (train.padding "longest") are padded back with zeros, at
        positions that are padding in every example of it."""
        p, t = self.parallel, self.cfg.train
        self.engine.eval()
        by_length = torch.argsort(-features.lengths, stable=True).tolist()
        mine = by_length[p.dp_rank::p.dp_size]
        local = []
        for i in range(0, len(mine), t.eval_batch_size):
            batch, _ = features.batch(mine[i:i + t.eval_batch_size], p.device, t.padding, self.pad_multiple)
            logits = self.engine(*batch).float().cpu()
            if logits.dim() == 3:  # [batch, width, outputs] of a token-level head: back to the full length
                logits = F.pad(logits, (0, 0, 0, features.input_ids.shape[-1] - logits.shape[1]))
            local.append(logits)
            self.watchdog.progress(f"evaluation batch {i // t.eval_batch_size + 1}")
        local = torch.cat(local).numpy() if local else None
        gathered = all_gather_object((mine, local), p.dp_group)
        shape = next(logits.shape[1:] for _, logits in gathered if logits is not None)
        result = np.zeros((len(features), *shape), dtype=np.float32)
        for indices, logits in gathered:
            if logits is not None:
                result[indices] = logits
        self.engine.train()
        return result

    def evaluate_all(self, epoch: int, step: int = 0) -> dict:
        """Metrics of every dev set. Their prediction files wait in `pending_files` until the
        caller knows whether this epoch is the best (`write_predictions`)."""
        metrics, self.pending_files = {}, {}
        for dev in self.dev_sets:
            self.watchdog.doing(f"evaluating {dev.name} after epoch {epoch}")
            evaluation = self.task.evaluate(dev, self.outputs(dev.features), self.cfg.task)
            self.pending_files.update(evaluation.files)
            prefix = f"{dev.name}/" if len(self.dev_sets) > 1 else ""
            metrics.update({f"{prefix}{k}": v for k, v in evaluation.metrics.items()})
        score = self.task.score(metrics)
        for k, v in metrics.items():
            self._scalar(f"eval/{k}", v, step)
            self._scalar(f"eval-vs-epoch/{k}", v, epoch)  # the dev metric per epoch (tools/plot_curves.py)
        logger.info(f"epoch {epoch} | " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return {"epoch": epoch, "step": step, "metrics": metrics, "score": score}

    def write_predictions(self) -> None:
        """The prediction files of the last evaluation (called for the best epoch only)."""
        if self.parallel.rank == self.parallel.logging_rank:
            write_files(os.path.join(self.cfg.train.output_dir, "predictions"), self.pending_files)
        self.pending_files = {}

    def predict_tests(self) -> None:
        for test in self.test_sets:
            self.watchdog.doing(f"predicting {test.name}")
            files = self.task.submission_files(test, self.outputs(test.features), self.cfg.task)
            if self.parallel.rank == self.parallel.logging_rank:
                write_files(os.path.join(self.cfg.train.output_dir, "submission"), files)

    # ----------------------------------------------------------------------------- best weights
    def _export_config(self) -> dict:
        """config.json entries beyond the encoder's: the task's (labels, ...), and a ModernBERT
        task class's pooling and head dropout as this run used them."""
        extra = self.task.export_config()
        if self.model_cfg.modern:
            extra.update(classifier_pooling=self.model_cfg.classifier_pooling,
                         classifier_dropout=self.cfg.model.classifier_dropout)
        return extra

    @torch.no_grad()
    def save_best(self, result: dict) -> None:
        """The best epoch's weights as a Hugging Face directory of the task's architecture."""
        from pretrain.checkpoint.hf import write_hf

        p = self.parallel
        self.watchdog.doing(f"saving the epoch-{result['epoch']} weights")
        weights = gathered_encoder_weights(self.model.bert, self.model_cfg, p)
        if p.rank != p.logging_rank:
            return
        head = {name: param.detach().float().cpu() for name, param in self.model.head.named_parameters()}
        # the length the exported tokenizer states: the longest the encoder saw, pretraining or here
        trained = longest(self.ckpt.trained_length, self.cfg.task.max_seq_length)
        ckpt = replace(self.ckpt, weights=weights, extra=head, trained_length=trained)
        target = os.path.join(self.cfg.train.output_dir, "best")

        def write(fresh: str) -> None:
            with tempfile.TemporaryDirectory() as vocab_dir:
                save_vocab(self.tokenizer.source, vocab_dir)  # the tokenizer this model was fine-tuned with
                write_hf(replace(ckpt, vocab_dir=vocab_dir), fresh,
                         architecture=self.task.exported_architecture(self.model_cfg),
                         config_extra=self._export_config())
            with open(os.path.join(fresh, "finetune_result.json"), "w") as f:
                json.dump(result, f, indent=2)

        replace_directory(target, write, f"the epoch-{result['epoch']} weights")
        self.watchdog.progress(f"the save of the epoch-{result['epoch']} weights")
        logger.info(f"saved the epoch-{result['epoch']} weights to {target}")


def adamw_engine(model, encoder, t, parallel, zero_stage: int, total_steps: int, batch: tuple[int, int, int]):
    """The DeepSpeed engine of a fine-tuning model: AdamW (no decay on biases and LayerNorm), linear
    warmup (t.warmup_ratio of total_steps) then linear decay, clipping by DeepSpeed. `t`: a train
    section (lr, weight_decay, grad_clip, precision, grad_accum_dtype, warmup_ratio); `batch`:
    DeepSpeed's (train_batch_size, micro batch per rank, accumulation steps)."""
    kinds = {id(lp.param): lp.kind for lp in logical_parameters(encoder)}
    trainable = [(param, "bias" if name.endswith("bias") else kinds.get(id(param), "weight"))
                 for name, param in model.named_parameters() if param.requires_grad]
    groups = [{"params": params, "weight_decay": t.weight_decay if decay else 0.0}
              for decay, _, params in group_by_kind(trainable, ("bias", "layernorm"), ())]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.999), eps=1e-6)
    warmup = int(t.warmup_ratio * total_steps)
    ds_config = deepspeed_settings(*batch, t.grad_clip, zero_stage, t.precision, grad_accum_dtype=t.grad_accum_dtype)
    # each parameter once: TP-sharded ones on every TP rank, replicated ones on TP rank 0
    counted = [param for param in model.parameters() if is_tp_sharded(param) or parallel.tp_rank == 0]
    engine, _ = initialize_engine(
        model, optimizer, ds_config, parallel, counted=counted, grad_clip=t.grad_clip, mpu=parallel.mpu,
        lr_scheduler=lambda opt: make_lr_scheduler(opt, t.lr, warmup, max(total_steps, warmup + 1), "linear"))
    return engine


@torch.no_grad()
def gathered_encoder_weights(encoder, model_cfg, parallel) -> dict[str, torch.Tensor]:
    """The encoder's whole weights by Hugging Face name (fp32, on the host), its TP shards gathered:
    a collective every rank of the TP group calls."""
    weights = {}
    for lp in logical_parameters(encoder):
        local = lp.param.detach().float()  # on the model's device: the TP gather runs there
        if lp.tp_partition_dim is not None and parallel.tp_size > 1:
            local = torch.cat(all_gather(local, parallel.tp_group), dim=lp.tp_partition_dim)
        weights[lp.hf_name] = unpad_vocab(lp.hf_name, to_host(local), model_cfg.vocab_size)
    return weights


def replace_directory(target: str, write, what: str) -> None:
    """`write(directory)` into a fresh sibling of `target`, then that put in target's place: a failed
    or interrupted write leaves the previous `target` as it was."""
    fresh = target + ".new"
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        with disk_full_named(fresh, what):
            write(fresh)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.replace(fresh, target)


def with_dropout(model_cfg, model_section):
    """The checkpoint's model config with model.hidden_dropout / model.attention_dropout where set."""
    return replace(model_cfg,
                   hidden_dropout=model_cfg.hidden_dropout if model_section.hidden_dropout is None
                   else model_section.hidden_dropout,
                   attention_dropout=model_cfg.attention_dropout if model_section.attention_dropout is None
                   else model_section.attention_dropout)


def checkpoint_tokenizer_of(ckpt, vocab_file: str | None):
    """The checkpoint's own tokenizer (or model.vocab_file); FinetuneError naming what is wrong."""
    try:
        return checkpoint_tokenizer(ckpt.vocab_dir, ckpt.config.model.vocab_size, ckpt.source, vocab_file,
                                    how_to_name_one="set model.vocab_file")
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None


def prepare_device(parallel, t) -> None:
    """train.tf32 on the device, and a refusal of a train.precision it cannot run."""
    configure_math(parallel.device, t.tf32)
    unsupported = precision_problem(parallel.device, t.precision)
    if unsupported:
        raise DeviceError(unsupported)


def read_init_from(path: str):
    """model.init_from, read (any native layout or a Hugging Face directory); FinetuneError naming it."""
    try:
        return read_any(path, with_optimizer=False)
    except CheckpointError as e:
        raise FinetuneError(str(e)) from None


def run(cfg: FinetuneConfig, parallel, checkpoint=None) -> dict:
    started = time.perf_counter()
    finetuner = Finetuner(cfg, parallel, checkpoint)
    try:
        summary = finetuner.train()
    finally:
        finetuner.close()
    summary["seconds"] = time.perf_counter() - started
    return summary
