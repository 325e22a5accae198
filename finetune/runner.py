"""Fine-tuning loop for sentence(-pair) classification and regression (GLUE), multiple choice
(SWAG) and span extraction (SQuAD 1.1/2.0): data and tensor parallelism through the pretraining
stack, AdamW with warmup and linear decay, evaluation each epoch, best-epoch weights, predictions,
submission files, TensorBoard and progress bars.

Every rank runs the same code. A global batch is cut into micro-batches exactly as in
pretraining (DP rank r takes the r-th slice of each accumulation step); TP ranks of a replica see
the same data. Evaluation shards the examples over DP ranks and gathers the outputs.
"""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from pretrain.checkpointing import CheckpointError, save_vocab
from pretrain.data.tokenizer import TokenizerError, load_tokenizer
from pretrain.device import (all_gather, all_gather_object, all_reduce, configure_math, describe, no_optimizer_steps,
                             to_host)
from pretrain.interop.apply import read_any
from pretrain.interop.native import LogicalCheckpoint
from pretrain.model.bert import logical_parameters
from pretrain.model.hf_interop import unpad_vocab
from pretrain.model.rng import RngTracker, seed_streams
from pretrain.optim import make_lr_scheduler
from pretrain.optim.groups import group_by_kind

from .config import FinetuneConfig
from .glue import AX_FILES, TASKS, GlueDataError, read_examples, write_submission
from .glue_metrics import METRICS
from .inputs import Batches, fixed_length_tokenizer
from .model import ClassifierHead, MultipleChoiceClassifier, SequenceClassifier, SpanHead, SpanModel, build_encoder, \
    classification_loss, load_encoder, load_head, span_loss
from .squad import SQUAD_TASKS, SquadTask, build_features, postprocess, read_squad
from .squad_metrics import evaluate_v1, evaluate_v2
from .swag import SWAG, choice_pairs, read_swag, write_swag_submission

MAIN_METRIC = {"matthews": "matthews_corr", "accuracy": "accuracy", "accuracy_f1": "accuracy",
               "pearson_spearman": "pearson"}


class FinetuneError(RuntimeError):
    """Bad input found after start-up (a data file, the checkpoint, the tokenizer)."""


def _tokenizer_source(cfg: FinetuneConfig, ckpt: LogicalCheckpoint) -> dict:
    if cfg.model.vocab_file:
        key = "tokenizer_json" if cfg.model.vocab_file.endswith(".json") else "vocab_file"
        return {key: cfg.model.vocab_file}
    if ckpt.vocab_dir:
        json_path = os.path.join(ckpt.vocab_dir, "tokenizer.json")
        if os.path.exists(json_path):
            return {"tokenizer_json": json_path}
        return {"vocab_file": os.path.join(ckpt.vocab_dir, "vocab.txt")}
    raise FinetuneError(f"{ckpt.source} carries no vocabulary: set model.vocab_file")


class Features(Batches):
    """Tokenised examples as tensors padded to max_seq_length: [N, S], or [N, choices, S]."""

    def __init__(self, tokenizer, texts: list, labels: torch.Tensor | None, max_length: int, choices: int = 1):
        encoded = fixed_length_tokenizer(tokenizer, max_length).encode_batch(texts)
        shape = (-1, choices, max_length) if choices > 1 else (-1, max_length)
        self.input_ids = torch.tensor([e.ids for e in encoded], dtype=torch.long).view(shape)
        self.token_type_ids = torch.tensor([e.type_ids for e in encoded], dtype=torch.long).view(shape)
        self.attention_mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long).view(shape)
        self.labels = labels

    @classmethod
    def for_task(cls, tokenizer, examples: list, max_length: int, task) -> "Features":
        if examples[0].label is None:
            labels = None
        elif task.is_regression:
            labels = torch.tensor([float(e.label) for e in examples], dtype=torch.float32)
        else:
            labels = torch.tensor([task.labels.index(e.label) for e in examples], dtype=torch.long)
        if task.name == SWAG.name:
            return cls(tokenizer, [pair for e in examples for pair in choice_pairs(e)], labels, max_length, task.choices)
        texts = [(e.text_a, e.text_b) if e.text_b is not None else e.text_a for e in examples]
        return cls(tokenizer, texts, labels, max_length)


class Finetuner:
    def __init__(self, cfg: FinetuneConfig, parallel, log=print):
        self.cfg, self.parallel = cfg, parallel
        self._pending_writes = []  # prediction files of the last evaluation, written if it is the best
        self.log = log if parallel.rank == parallel.logging_rank else (lambda *a, **k: None)
        self.task = SWAG if cfg.task.name == SWAG.name else SQUAD_TASKS.get(cfg.task.name) or TASKS[cfg.task.name]
        self.squad = isinstance(self.task, SquadTask)
        t = cfg.train
        try:
            self.ckpt = read_any(cfg.model.init_from, with_optimizer=False)
        except CheckpointError as e:
            raise FinetuneError(str(e)) from None
        for note in self.ckpt.notes:
            self.log(note)
        m = self.ckpt.config.model
        self.model_cfg = replace(m, hidden_dropout=m.hidden_dropout if cfg.model.hidden_dropout is None
                                 else cfg.model.hidden_dropout,
                                 attention_dropout=m.attention_dropout if cfg.model.attention_dropout is None
                                 else cfg.model.attention_dropout)
        try:
            self.tokenizer = load_tokenizer(**_tokenizer_source(cfg, self.ckpt))
        except TokenizerError as e:
            raise FinetuneError(str(e)) from None
        if self.tokenizer.vocab_size > self.model_cfg.vocab_size:
            raise FinetuneError(f"the tokenizer ({self.tokenizer.source}) has {self.tokenizer.vocab_size} tokens, the "
                                f"checkpoint's vocabulary {self.model_cfg.vocab_size}: they do not belong together")
        self._read_data()

        configure_math(parallel.device, t.tf32)
        self.log(f"{describe(parallel)}, ZeRO-{cfg.parallel.zero_stage}, {t.precision}")
        self.tracker = RngTracker(parallel.device)
        seed_streams(self.tracker, t.seed, parallel.tp_rank, 0, parallel.dp_rank)
        bert = build_encoder(self.model_cfg, parallel.tp_group, self.tracker)
        load_encoder(bert, self.ckpt.weights, self.model_cfg, parallel.tp_rank, parallel.tp_size)
        choices = self.task.name == SWAG.name
        if self.squad:
            head = SpanHead(self.model_cfg.hidden_size, self.model_cfg.init_std, t.seed)
        else:
            outputs = 1 if self.task.is_regression or choices else len(self.task.labels)
            head = ClassifierHead(self.model_cfg.hidden_size, outputs, cfg.model.classifier_dropout,
                                  self.model_cfg.init_std, t.seed)
        try:
            if load_head(head, self.ckpt.extra, self.ckpt.source):
                self.log(f"task head ({', '.join(n for n, _ in head.named_parameters())}) taken from {self.ckpt.source}")
        except ValueError as e:
            raise FinetuneError(str(e)) from None
        if self.squad:
            self.model = SpanModel(bert, head)
        else:
            self.model = (MultipleChoiceClassifier if choices else SequenceClassifier)(bert, head)
        self.micro_per_step = t.global_batch_size // (t.micro_batch_size * parallel.dp_size)
        self.steps_per_epoch = max(1, math.ceil(len(self.train_features) / t.global_batch_size)) \
            if self.train_features is not None else 0
        self.total_steps = max(1, math.ceil(t.epochs * self.steps_per_epoch))
        self.engine = self._build_engine()
        self.writer = None
        if parallel.rank == parallel.logging_rank:
            os.makedirs(t.output_dir, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(t.tensorboard_dir or os.path.join(t.output_dir, "tensorboard"))

    # ----------------------------------------------------------------------------- data
    def _read_data(self) -> None:
        c, task = self.cfg.task, self.task
        named = {k: v for k, v in (("text_a", c.text_a_column), ("text_b", c.text_b_column),
                                   ("label", c.label_column)) if v}

        def load(path, split):
            try:
                if self.squad:
                    examples, data, report = read_squad(path, task.version, training=split == "train")
                    self.squad_data[path] = data
                elif task.name == SWAG.name:
                    examples, report = read_swag(path, split)
                else:
                    examples, report = read_examples(task, path, split, **({} if path.endswith(".tsv") else named))
            except GlueDataError as e:
                raise FinetuneError(str(e)) from None
            self.log(report.summary())
            return examples

        def default(name):
            return os.path.join(c.data_dir, name) if c.data_dir else None

        self.squad_data = {}
        train_path = c.train_file or default(task.train_file)
        self.train_features = None
        if not self.cfg.train.eval_only:
            if not train_path or not os.path.exists(train_path):
                raise FinetuneError(f"no training file: {train_path} (set task.train_file, or train.eval_only)")
            self.train_features = self._features(load(train_path, "train"), training=True)
        dev_paths = c.dev_files or [default(f) for f in task.dev_files]
        self.dev_sets = []
        for path in dev_paths:
            if path and os.path.exists(path):
                examples = load(path, "dev")
                self.dev_sets.append((os.path.splitext(os.path.basename(path))[0], self._features(examples),
                                      examples, self.squad_data.get(path)))
            elif path:
                self.log(f"{path}: not found; this dev set is left out")
        if not self.dev_sets:
            raise FinetuneError(f"no dev file for {task.name} (looked for {', '.join(map(str, dev_paths))})")
        test_paths = [(p, "") for p in c.test_files] or [(default(f), suffix) for f, suffix in task.test_files]
        if task.name == "mnli" and c.data_dir:  # the diagnostic set is predicted by the MNLI model
            test_paths += [(default(f), "AX") for f in AX_FILES]
        self.test_sets = []
        for path, suffix in test_paths:
            if path and not os.path.exists(path) and suffix != "AX":  # AX: either of two names
                self.log(f"{path}: not found; no predictions for it")
            if path and os.path.exists(path):
                examples = load(path, "test")
                name = "AX" if suffix == "AX" else task.submission + suffix
                self.test_sets.append((name, examples, self._features(examples)))

    def _features(self, examples, training: bool = False):
        c = self.cfg.task
        if self.squad:
            features = build_features(self.tokenizer.tokenizer, examples, c.max_seq_length, c.doc_stride,
                                      c.max_query_length, training)
            longer = sum(n > 1 for n in features.windows_per_example)
            self.log(f"  {len(examples):,} questions -> {len(features):,} windows ({longer:,} contexts need more than "
                     f"one); {features.truncated_questions:,} questions truncated to {c.max_query_length} tokens")
            return features
        return Features.for_task(self.tokenizer.tokenizer, examples, c.max_seq_length, self.task)

    # ----------------------------------------------------------------------------- engine
    def _build_engine(self):
        import deepspeed

        t, p = self.cfg.train, self.parallel
        kinds = {id(lp.param): lp.kind for lp in logical_parameters(self.model.bert)}
        trainable = [(param, "bias" if name.endswith("bias") else kinds.get(id(param), "weight"))
                     for name, param in self.model.named_parameters() if param.requires_grad]
        groups = [{"params": params, "weight_decay": t.weight_decay if decay else 0.0}
                  for decay, _, params in group_by_kind(trainable, ("bias", "layernorm"), ())]
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.999), eps=1e-6)
        warmup = int(t.warmup_ratio * self.total_steps)
        ds_config = {
            "train_batch_size": t.global_batch_size,
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": self.micro_per_step,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": self.cfg.parallel.zero_stage},
            "bf16": {"enabled": t.precision == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
        }
        with no_optimizer_steps(optimizer):  # the bf16 wrapper at ZeRO-0 steps once at construction
            engine, _, _, _ = deepspeed.initialize(
                model=self.model, optimizer=optimizer, config=ds_config, mpu=p.mpu,
                lr_scheduler=lambda opt: make_lr_scheduler(opt, t.lr, warmup, max(self.total_steps, warmup + 1),
                                                           "linear"))
        return engine

    # ----------------------------------------------------------------------------- training
    def _epoch_order(self, epoch: int) -> list[int]:
        """A seeded permutation, wrapped around to whole global batches."""
        n, batch = len(self.train_features), self.cfg.train.global_batch_size
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.train.seed + epoch)).tolist()
        return (order * math.ceil(self.steps_per_epoch * batch / n + 1))[: self.steps_per_epoch * batch]

    def _micro_batches(self, order: list[int], step: int):
        t, p = self.cfg.train, self.parallel
        start = step * t.global_batch_size
        for a in range(self.micro_per_step):
            offset = start + (a * p.dp_size + p.dp_rank) * t.micro_batch_size
            yield order[offset: offset + t.micro_batch_size]

    def train(self) -> dict:
        t = self.cfg.train
        history, best, self.train_losses = [], None, []
        if t.eval_only:
            result = self.evaluate_all(epoch=0)
            self.write_predictions()
            self.predict_tests()
            return self._finish(history=[result], best=result)
        step, progress = 0, self._progress(self.total_steps)
        epochs = math.ceil(t.epochs)
        for epoch in range(epochs):
            order = self._epoch_order(epoch)
            self.engine.train()
            steps_this_epoch = min(self.steps_per_epoch, self.total_steps - step)
            for s in range(steps_this_epoch):
                lr = self.engine.get_lr()[0]
                losses = []
                for indices in self._micro_batches(order, s):
                    inputs, labels = self.train_features.batch(indices, self.parallel.device)
                    logits = self.engine(*inputs)
                    loss = span_loss(logits, labels) if self.squad else \
                        classification_loss(logits, labels, self.task.is_regression)
                    self.engine.backward(loss)
                    self.engine.step()
                    losses.append(loss.detach())
                step += 1
                loss_value = self._mean_over_dp(torch.stack(losses).mean())
                self.train_losses.append(loss_value)
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.4f}", epoch=epoch + 1)
                if step % t.log_interval == 0 or step == self.total_steps:
                    self._scalar("train/loss", loss_value, step)
                    self._scalar("train/learning_rate", lr, step)
            result = self.evaluate_all(epoch + 1, step)
            history.append(result)
            if best is None or result["score"] > best["score"]:
                best = result
                if t.keep_best:
                    self.save_best(result)
                self.write_predictions()
                self.predict_tests()
        progress.close()
        return self._finish(history, best)

    def _finish(self, history, best) -> dict:
        summary = {"task": self.task.name, "history": history, "best": best, "train_losses": self.train_losses}
        if self.parallel.rank == self.parallel.logging_rank:
            path = os.path.join(self.cfg.train.output_dir, "metrics.json")
            with open(path + ".tmp", "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(path + ".tmp", path)
            self.writer.flush()
            self.log(f"best: epoch {best['epoch']} " + " ".join(f"{k} {v:.4f}" for k, v in best["metrics"].items()))
        return summary

    def _progress(self, total: int):
        from tqdm import tqdm

        enabled = self.cfg.train.progress and self.parallel.rank == self.parallel.logging_rank
        return tqdm(total=total, desc=f"fine-tuning {self.task.name}", disable=not enabled, dynamic_ncols=True)

    def _scalar(self, name, value, step) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def _mean_over_dp(self, value: torch.Tensor) -> float:
        value = value.float().clone().to(self.parallel.device)
        if self.parallel.dp_size > 1:
            all_reduce(value, self.parallel.dp_group)
            value /= self.parallel.dp_size
        return value.item()

    # ----------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def outputs(self, features: Features) -> np.ndarray:
        """Logits of every example (each DP rank computes a shard; all ranks get all)."""
        p, size = self.parallel, self.cfg.train.eval_batch_size
        self.engine.eval()
        mine = list(range(p.dp_rank, len(features), p.dp_size))
        local = [self.engine(*features.batch(mine[i:i + size], p.device)[0]).float().cpu()
                 for i in range(0, len(mine), size)]
        local = torch.cat(local).numpy() if local else None
        gathered = all_gather_object((mine, local), p.dp_group)
        shape = next(logits.shape[1:] for _, logits in gathered if logits is not None)
        result = np.zeros((len(features), *shape), dtype=np.float32)
        for indices, logits in gathered:
            if logits is not None:
                result[indices] = logits
        self.engine.train()
        return result

    def predictions(self, logits: np.ndarray) -> np.ndarray:
        return logits[:, 0] if self.task.is_regression else logits.argmax(-1)

    def evaluate_all(self, epoch: int, step: int = 0) -> dict:
        """Metrics of every dev set. Their prediction files wait in `_pending_writes` until the
        caller knows whether this epoch is the best (`write_predictions`)."""
        metrics, self._pending_writes = {}, []
        for name, features, examples, squad_data in self.dev_sets:
            logits = self.outputs(features)
            if self.squad:
                values = self._squad_metrics(name, examples, features, squad_data, logits)
            else:
                predicted = self.predictions(logits)
                values = METRICS[self.task.metric](features.labels.numpy(), predicted)
                self._pending_writes.append(functools.partial(self._write_dev_predictions, name, predicted))
            prefix = f"{name}/" if len(self.dev_sets) > 1 else ""
            metrics.update({f"{prefix}{k}": v for k, v in values.items()})
        main = "f1" if self.squad else MAIN_METRIC[self.task.metric]
        score = float(np.mean([v for k, v in metrics.items() if k.split("/")[-1] == main]))
        for k, v in metrics.items():
            self._scalar(f"eval/{k}", v, step)
        self.log(f"epoch {epoch} | " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
        return {"epoch": epoch, "step": step, "metrics": metrics, "score": score}

    def _squad_metrics(self, name, examples, features, squad_data, logits) -> dict:
        """Answers from the logits, the official evaluation, and the prediction files."""
        c = self.cfg.task
        predictions, nbest, null_odds = postprocess(examples, features, logits, self.task.version, c.n_best_size,
                                                    c.max_answer_length, c.null_score_diff_threshold)
        if self.task.version == "1.1":
            values = evaluate_v1(squad_data, predictions)
        else:
            values = evaluate_v2(squad_data, predictions, null_odds)
        outputs = {"predictions.json": predictions, "nbest_predictions.json": nbest}
        if self.task.version == "2.0":
            outputs["null_odds.json"] = null_odds
        self._pending_writes.append(functools.partial(self._write_squad_predictions, name, outputs))
        return {k: float(v) for k, v in values.items() if not k.endswith("total")}

    def write_predictions(self) -> None:
        """The prediction files of the last evaluation (called for the best epoch only)."""
        for write in self._pending_writes:
            write()
        self._pending_writes = []

    def _write_squad_predictions(self, name, outputs: dict) -> None:
        if self.parallel.rank != self.parallel.logging_rank:
            return
        directory = os.path.join(self.cfg.train.output_dir, "predictions", name)
        os.makedirs(directory, exist_ok=True)
        for file, content in outputs.items():
            with open(os.path.join(directory, file), "w") as f:
                json.dump(content, f, indent=1)

    def _write_dev_predictions(self, name, predicted) -> None:
        if self.parallel.rank != self.parallel.logging_rank:
            return
        directory = os.path.join(self.cfg.train.output_dir, "predictions")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{name}.tsv"), "w") as f:
            f.write("index\tprediction\n")
            for i, value in enumerate(predicted):
                f.write(f"{i}\t{value:.4f}\n" if self.task.is_regression else f"{i}\t{self.task.labels[int(value)]}\n")

    def predict_tests(self) -> None:
        for name, examples, features in self.test_sets:
            predicted = self.predictions(self.outputs(features))
            if self.parallel.rank == self.parallel.logging_rank:
                directory = os.path.join(self.cfg.train.output_dir, "submission")
                os.makedirs(directory, exist_ok=True)
                if self.task.name == SWAG.name:
                    write_swag_submission(os.path.join(directory, f"{name}.csv"), examples, predicted)
                else:
                    write_submission(self.task, os.path.join(directory, f"{name}.tsv"), examples, predicted)

    # ----------------------------------------------------------------------------- best weights
    @torch.no_grad()
    def save_best(self, result: dict) -> None:
        """The best epoch's weights as a Hugging Face BertForSequenceClassification directory."""
        from pretrain.interop.hf import write_hf

        p = self.parallel
        weights = {}
        for lp in logical_parameters(self.model.bert):
            local = lp.param.detach().float()  # on the model's device: the TP gather runs there
            if lp.tp_partition_dim is not None and p.tp_size > 1:
                local = torch.cat(all_gather(local, p.tp_group), dim=lp.tp_partition_dim)
            weights[lp.hf_name] = unpad_vocab(lp.hf_name, to_host(local), self.model_cfg.vocab_size)
        if p.rank != p.logging_rank:
            return
        head = {name: param.detach().float().cpu() for name, param in self.model.head.named_parameters()}
        ckpt = replace(self.ckpt, weights=weights, extra=head)
        labels = self.task.labels or ("score",)
        if self.squad:
            architecture, extra_config = "BertForQuestionAnswering", {"finetuning_task": self.task.name}
        elif self.task.name == SWAG.name:
            architecture, extra_config = "BertForMultipleChoice", {"finetuning_task": self.task.name}
        else:
            architecture = "BertForSequenceClassification"
            extra_config = {"num_labels": len(labels), "finetuning_task": self.task.name,
                            "id2label": dict(enumerate(labels)), "label2id": {l: i for i, l in enumerate(labels)},
                            "problem_type": "regression" if self.task.is_regression else "single_label_classification"}
        target = os.path.join(self.cfg.train.output_dir, "best")
        fresh = target + ".new"
        shutil.rmtree(fresh, ignore_errors=True)
        with tempfile.TemporaryDirectory() as vocab_dir:
            save_vocab(self.tokenizer.source, vocab_dir)  # the tokenizer this model was fine-tuned with
            write_hf(replace(ckpt, vocab_dir=vocab_dir), fresh, architecture=architecture, config_extra=extra_config)
        with open(os.path.join(fresh, "finetune_result.json"), "w") as f:
            json.dump(result, f, indent=2)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(fresh, target)
        self.log(f"saved the epoch-{result['epoch']} weights to {target}")


def run(cfg: FinetuneConfig, parallel, log=print) -> dict:
    started = time.perf_counter()
    summary = Finetuner(cfg, parallel, log).train()
    summary["seconds"] = time.perf_counter() - started
    return summary
