"""Contrastive training of an embedding model (`python -m finetune embed`): the pretraining stack's
encoder (tensor parallel) under a DeepSpeed engine (ZeRO 0-2, fp32 or bf16), pooled into sentence
embeddings and trained with the InfoNCE loss of loss.py over the global batch.

A step takes one global batch of contrastive_batches (duplicate-free, one source per batch); data-
parallel rank r embeds rows [r * share, (r + 1) * share) of it (TP ranks of a replica the same
rows), and the loss gathers every rank's embeddings with their gradients, so that each anchor is
scored against the whole global batch. When train.micro_batch_size is below the share, the step
is gradient-cached (gradcache.py): each column is embedded in mini-batches without gradients, the
loss's gradient taken at the embeddings, then each mini-batch re-run from the same random state
(dropout, both RNG streams) and back-propagated through engine.backward. DeepSpeed accumulates
those backward passes as micro-steps of one optimizer step (its gradient_accumulation_steps is the
number of mini-batches; each is unscaled), so the update is the uncached one.

Evaluation (before training, every eval.interval steps or at each epoch's end): retrieval by exact
cosine search (nDCG@10, MRR@10, Recall@100) and/or the Spearman correlation of scored pairs, the
texts sharded over data-parallel ranks. The best evaluation's weights (eval.metric) are written as
a sentence-transformers model (encoder, pooling, normalisation, the trained length) in
train.output_dir/best; metrics.json and TensorBoard as the other tasks.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from pretrain.checkpoint.format import head_of
from pretrain.checkpoint.tokenizer_files import save_vocab
from pretrain.checkpoint.trained_length import longest
from pretrain.common.atomic import atomic_outputs
from pretrain.data.samples.packing import PACKED_INPUTS, first_fit_decreasing
from pretrain.distributed.device import all_gather_object, all_reduce, describe
from pretrain.model.names import logical_parameters
from pretrain.model.rng import RngTracker, seed_streams
from pretrain.observability.console import progress
from pretrain.resilience.watchdog import Watchdog
from pretrain.training.metrics import ThroughputWindow

from ..finetuner import (FinetuneError, adamw_engine, checkpoint_tokenizer_of, gathered_encoder_weights,
                         notes_that_matter, prepare_device, read_init_from, replace_directory, with_dropout)
from ..inputs import fixed_length_tokenizer
from ..model import build_encoder, encoder_inputs, load_encoder
from .config import SIMILARITY_METRIC, EmbedConfig
from .data import Columns, ContrastiveDataError, contrastive_batches, read_examples
from .eval_data import read_retrieval_set, read_similarity_set
from .gradcache import TorchRandomState, cached_step
from .loss import ContrastiveLoss, pool, pool_packed
from .retrieval_metrics import retrieval_metrics, similarity_spearman

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling names our modes so
ST_POOLING = {"mean": "mean", "cls": "cls", "last": "lasttoken"}


class Embedder(nn.Module):
    """The encoder and its pooling: [texts, hidden] fp32 sentence embeddings, from padded rows
    (input_ids, token_type_ids, attention_mask) or packed ones (PACKED_INPUTS: several texts a row,
    each attending to itself, positions from 0)."""

    def __init__(self, bert: nn.Module, pooling: str, normalize: bool):
        super().__init__()
        self.bert, self.pooling, self.normalize = bert, pooling, normalize

    def forward(self, *inputs):
        if len(inputs) == len(PACKED_INPUTS):
            hidden, _ = self.bert.encode(inputs)
            return pool_packed(hidden.float(), inputs[2], inputs[5], self.pooling, self.normalize)
        input_ids, token_type_ids, attention_mask = inputs
        hidden, _ = self.bert.encode(encoder_inputs(input_ids, token_type_ids, attention_mask))
        return pool(hidden.float(), attention_mask, self.pooling, self.normalize)


def packed_inputs(rows: list[list[int]], capacity: int, multiple: int, device) -> tuple[torch.Tensor, ...]:
    """PACKED_INPUTS of token id lists (one text each), first-fit decreasing into rows of at most
    `capacity` tokens, cut to the fullest row's length rounded up to `multiple`; the texts keep
    their order as sample numbers."""
    placement = first_fit_decreasing([len(r) for r in rows], capacity)
    fullest = max(sum(len(rows[i]) for i in members) for members in placement)
    width = min(-(-fullest // multiple) * multiple, capacity)
    ids, samples, positions = (torch.zeros((len(placement), width), dtype=torch.long) for _ in range(3))
    starts = torch.zeros(len(rows), dtype=torch.long)
    for r, members in enumerate(placement):
        offset = 0
        for i in members:
            n = len(rows[i])
            ids[r, offset:offset + n] = torch.tensor(rows[i])
            samples[r, offset:offset + n] = i + 1
            positions[r, offset:offset + n] = torch.arange(n)
            starts[i] = r * width + offset
            offset += n
    predictions = starts[:, None]  # no MLM head runs: each text's slot points at its [CLS], as packing.py's unused ones
    return tuple(t.to(device) for t in (ids, torch.zeros_like(ids), samples, predictions, positions, starts))


class ContrastiveTrainer:
    def __init__(self, cfg: EmbedConfig, parallel):
        self.cfg, self.parallel = cfg, parallel
        t, p = cfg.train, parallel
        self.ckpt = read_init_from(cfg.model.init_from)
        for note in notes_that_matter(self.ckpt.notes):
            logger.info(note)
        m = self.ckpt.config.model
        self.model_cfg = with_dropout(m, cfg.model)
        too_wide = [d for d in cfg.loss.matryoshka_dims if d > m.hidden_size]
        if too_wide:
            raise FinetuneError(f"loss.matryoshka_dims {too_wide} exceed the model's hidden size ({m.hidden_size})")
        self.tokenizer = checkpoint_tokenizer_of(self.ckpt, cfg.model.vocab_file)
        self._read_data()
        prepare_device(p, t)
        self.share = t.global_batch_size // p.dp_size
        self.mini = min(t.micro_batch_size or self.share, self.share)
        self.columns = 2 + len(self.examples[0].negatives)
        cached = self.mini < self.share
        backward_calls = self.columns * math.ceil(self.share / self.mini) if cached else 1
        logger.info(f"{describe(p)}, ZeRO-{cfg.parallel.zero_stage}, {t.precision}; {t.global_batch_size} rows per step "
                    f"({self.share} per data-parallel rank, {self.columns} texts each), "
                    + (f"gradient-cached in mini-batches of {self.mini}" if cached else "embedded in one pass"))
        self.tracker = RngTracker(p.device)
        seed_streams(self.tracker, t.seed, p.tp_rank, 0, p.dp_rank)
        bert = build_encoder(self.model_cfg, p.tp_group, self.tracker)
        load_encoder(bert, self.ckpt.weights, self.model_cfg, p.tp_rank, p.tp_size)
        for lp in logical_parameters(bert):
            if head_of(lp.hf_name) is not None:
                lp.param.requires_grad_(False)  # the pooler and pretraining heads: no part of an embedding
        self.model = Embedder(bert, cfg.model.pooling, cfg.model.normalize)
        self.random_state = TorchRandomState(p.device, self.tracker) if cached else None
        self.loss = ContrastiveLoss(cfg.loss.scale, cfg.loss.symmetric, tuple(cfg.loss.matryoshka_dims),
                                    tuple(cfg.loss.matryoshka_weights),
                                    group=p.dp_group if p.dp_size > 1 else None, rank=p.dp_rank)
        self.pad_multiple = t.pad_to_multiple_of or (1 if p.device.type == "cpu" else 8)
        self.steps_per_epoch = len(self.first_epoch[0])
        self.total_steps = max(1, math.ceil(t.epochs * self.steps_per_epoch))
        # DeepSpeed's batch: each backward pass one micro-step of one row (an accounting figure only)
        self.engine = adamw_engine(self.model, bert, t, p, cfg.parallel.zero_stage, self.total_steps,
                                   (backward_calls * p.dp_size, 1, backward_calls))
        self.watchdog = Watchdog.for_job(t.hang_timeout_minutes, p, key="train.hang_timeout_minutes")
        self.metric = cfg.eval.selection_metric()  # what picks the best evaluation (None: the last step)
        self.best: dict | None = None
        self.writer = None
        if p.rank == p.logging_rank:
            os.makedirs(t.output_dir, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(t.tensorboard_dir or os.path.join(t.output_dir, "tensorboard"))

    # ----------------------------------------------------------------------------- data
    def _read_data(self) -> None:
        d, e = self.cfg.data, self.cfg.eval
        columns = Columns(d.anchor_column, d.positive_column, tuple(d.negative_columns), d.source_column)
        self.examples = []
        try:
            for path in d.train_files:
                examples, report = read_examples(path, columns)
                logger.info(report.summary())
                self.examples += examples
            widths = {len(example.negatives) for example in self.examples}
            if len(widths) > 1:
                raise ContrastiveDataError(f"data.train_files hold rows of {sorted(widths)} negatives; "
                                           "give every row the same number")
            self.retrieval = read_retrieval_set(e.queries, e.corpus, e.qrels) if e.retrieval() else None
            self.similarity = None
            if e.similarity_file:
                self.similarity = read_similarity_set(e.similarity_file, e.sentence1_column, e.sentence2_column,
                                                      e.score_column)
        except ContrastiveDataError as error:
            raise FinetuneError(str(error)) from None
        # the first epoch's batches (and leftovers), made once: its length is the epoch's steps
        self.first_epoch = contrastive_batches(self.examples, self.cfg.train.global_batch_size, self.cfg.train.seed, 0)
        if not self.first_epoch[0]:
            raise FinetuneError(f"data.train_files' {len(self.examples):,} rows fill no batch of "
                                f"train.global_batch_size {self.cfg.train.global_batch_size}: a batch takes rows that "
                                "share no text (and one source), and too few such rows were found")
        texts = {text for example in self.examples for text in example.texts()}
        if self.retrieval is not None:
            texts.update(self.retrieval.queries + self.retrieval.documents)
        if self.similarity is not None:
            texts.update(self.similarity.first + self.similarity.second)
        self.token_ids = self._tokenize(sorted(texts))

    def _tokenize(self, texts: list[str], report: bool = True) -> dict[str, list[int]]:
        """Every text's ids, [CLS] text [SEP], cut at data.max_seq_length (the cut ones counted)."""
        tokenizer = fixed_length_tokenizer(self.tokenizer.tokenizer, self.cfg.data.max_seq_length,
                                           self.tokenizer.specials)
        tokenizer.no_padding()
        encodings = tokenizer.encode_batch(texts)
        cut = sum(1 for encoding in encodings if encoding.overflowing)
        if report:
            logger.info(f"tokenized {len(texts):,} distinct texts; {cut:,} cut at data.max_seq_length "
                        f"{self.cfg.data.max_seq_length}")
        return {text: encoding.ids for text, encoding in zip(texts, encodings)}

    def _inputs(self, texts: list[str]) -> tuple[torch.Tensor, ...]:
        """The model's inputs for `texts`: packed several to a row of at most data.max_seq_length
        tokens (train.packing), or each padded to the longest; rounded up to train.pad_to_multiple_of."""
        rows = [self.token_ids[text] for text in texts]
        device = self.parallel.device
        if self.cfg.train.packing:
            return packed_inputs(rows, self.cfg.data.max_seq_length, self.pad_multiple, device)
        length = -(-max(len(r) for r in rows) // self.pad_multiple) * self.pad_multiple
        ids = torch.full((len(rows), length), self.tokenizer.specials.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        return ids.to(device), torch.zeros_like(ids, device=device), mask.to(device)

    # ----------------------------------------------------------------------------- training
    def _embed(self, texts: list[str], window: ThroughputWindow | None = None) -> torch.Tensor:
        inputs = self._inputs(texts)
        if window is not None:
            window.add(inputs[2])  # the padding mask, or the packed rows' sample ids: nonzero on real tokens
        return self.engine(*inputs)

    def _loss(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.loss(embeddings[0], embeddings[1], embeddings[2:])

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # each mini-batch a part of the one update
        self.engine.step()  # an optimizer step after the last of them (DeepSpeed's accumulation boundary)

    def _step(self, rows: list[int], window: ThroughputWindow) -> torch.Tensor:
        """One optimizer step on this rank's rows of the global batch; the loss (detached)."""
        columns = [[self.examples[i].anchor for i in rows], [self.examples[i].positive for i in rows]]
        columns += [[self.examples[i].negatives[j] for i in rows] for j in range(self.columns - 2)]
        if self.random_state is None:
            embeddings = [self._embed(column, window) for column in columns]
            loss = self._loss(embeddings)
            self._backward(loss)
            return loss.detach()
        minis = [[column[i:i + self.mini] for i in range(0, len(column), self.mini)] for column in columns]

        def embed(texts):  # tokens counted once: in the pass without gradients
            return self._embed(texts, None if torch.is_grad_enabled() else window)

        return cached_step(minis, embed, self._loss, self.random_state, backward=self._backward)

    def train(self) -> dict:
        self.watchdog.start()
        try:
            return self._train()
        finally:
            self.watchdog.stop()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.engine.destroy()

    def _train(self) -> dict:
        t, p, e = self.cfg.train, self.parallel, self.cfg.eval
        history, losses = [], []
        self._evaluate(0, 0, history)  # where the pretrained encoder stands
        bar = progress(self.total_steps, "contrastive training", enabled=t.progress and p.rank == p.logging_rank,
                       unit="step")
        window = ThroughputWindow(p.device, unit="texts")
        step, epoch, carried = 0, 0, []
        while step < self.total_steps:
            batches, carried = (self.first_epoch if epoch == 0 else
                                contrastive_batches(self.examples, t.global_batch_size, t.seed, epoch, carried))
            epoch += 1
            self.engine.train()
            for batch in batches[:self.total_steps - step]:
                lr = self.engine.get_lr()[0]
                self.watchdog.doing(f"step {step + 1}: embedding, loss, backward, optimizer", step)
                loss = self._step(batch[p.dp_rank * self.share:(p.dp_rank + 1) * self.share], window)
                step += 1
                self.watchdog.progress(f"step {step}", step)
                losses.append(self._mean_over_dp(loss))
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4f}", epoch=epoch)
                if step % t.log_interval == 0 or step == self.total_steps:
                    self._log_step(step, losses[-1], lr, window)
                if (e.interval and step % e.interval == 0) or step == self.total_steps:
                    self._evaluate(step, epoch, history)
                    window.restart()  # the evaluation's and the save's time is not training's
            if not e.interval and step < self.total_steps:
                self._evaluate(step, epoch, history)
                window.restart()
        bar.close()
        if self.metric is None:  # nothing to select by: the last step's weights
            self.best = history[-1]
            if t.keep_best:
                self.save_best(self.best)
        return self._finish(history, losses)

    def _evaluate(self, step: int, epoch: int, history: list[dict]) -> None:
        """An evaluation into `history`; the weights saved when it is the best so far by eval.metric
        (the earlier of two equal ones kept)."""
        result = self.evaluate(step, epoch)
        history.append(result)
        if self.metric is None:
            return
        if self.best is None or result["metrics"][self.metric] > self.best["metrics"][self.metric]:
            self.best = result
            if self.cfg.train.keep_best:
                self.save_best(result)

    def _log_step(self, step: int, loss: float, lr: float, window: ThroughputWindow) -> None:
        counts = window.counts()
        if self.parallel.dp_size > 1:
            all_reduce(counts, self.parallel.dp_group)
        rates = window.rates(*counts.tolist())
        rates["pairs_per_second"] = rates["texts_per_second"] / self.columns
        self._scalar("train/loss", loss, step)
        self._scalar("train/learning_rate", lr, step)
        for name, value in rates.items():
            self._scalar(f"perf/{name}", value, step)

    def _finish(self, history: list[dict], losses: list[float]) -> dict:
        best = self.best
        selected_by = self.metric or "the last step (no evaluation set)"
        summary = {"task": "embed", "selected_by": selected_by, "history": history, "best": best,
                   "train_losses": losses}
        if self.parallel.rank == self.parallel.logging_rank:
            path = os.path.join(self.cfg.train.output_dir, "metrics.json")
            with atomic_outputs([path]) as temporary, open(temporary[path], "w") as f:
                json.dump(summary, f, indent=2)
            self.writer.flush()
            logger.info(f"best: step {best['step']} by {selected_by}"
                        + "".join(f" {k} {v:.4f}" for k, v in best["metrics"].items()))
        return summary

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
    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """[texts, hidden] embeddings in order; each DP rank embeds a shard (longest first), all get all."""
        p, size = self.parallel, self.cfg.eval.batch_size
        new = sorted(set(texts).difference(self.token_ids))  # texts not among the data's (tokenized up front)
        if new:
            self.token_ids.update(self._tokenize(new, report=False))
        self.engine.eval()
        by_length = sorted(range(len(texts)), key=lambda i: -len(self.token_ids[texts[i]]))
        mine = by_length[p.dp_rank::p.dp_size]
        local = []
        for start in range(0, len(mine), size):
            local.append(self.engine(*self._inputs([texts[i] for i in mine[start:start + size]])).float().cpu())
            self.watchdog.progress(f"evaluation batch {start // size + 1}")
        local = torch.cat(local).numpy() if local else None
        gathered = all_gather_object((mine, local), p.dp_group)
        width = next(vectors.shape[1] for _, vectors in gathered if vectors is not None)
        result = np.zeros((len(texts), width), dtype=np.float32)
        for indices, vectors in gathered:
            if vectors is not None:
                result[indices] = vectors
        self.engine.train()
        return result

    def evaluate(self, step: int, epoch: int = 0) -> dict:
        metrics = {}
        if self.retrieval is not None:
            r = self.retrieval
            self.watchdog.doing(f"retrieval evaluation after step {step}")
            metrics.update(retrieval_metrics(self.embed_texts(r.queries), self.embed_texts(r.documents), r.query_ids,
                                             r.doc_ids, r.qrels))
        if self.similarity is not None:
            s = self.similarity
            self.watchdog.doing(f"similarity evaluation after step {step}")
            metrics[SIMILARITY_METRIC] = similarity_spearman(self.embed_texts(s.first), self.embed_texts(s.second),
                                                             s.scores)
        for name, value in metrics.items():
            self._scalar(f"eval/{name}", value, step)
        if metrics:
            logger.info(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return {"step": step, "epoch": epoch, "metrics": metrics}

    # ----------------------------------------------------------------------------- the export
    @torch.no_grad()
    def save_best(self, result: dict) -> None:
        """The weights as a sentence-transformers model (a Hugging Face encoder directory)."""
        from pretrain.checkpoint.hf import write_hf

        p, m = self.parallel, self.model_cfg
        self.watchdog.doing(f"saving the step-{result['step']} weights")
        weights = gathered_encoder_weights(self.model.bert, m, p)
        if p.rank != p.logging_rank:
            return
        length = self.cfg.data.max_seq_length
        ckpt = replace(self.ckpt, weights=weights, extra={}, trained_length=longest(self.ckpt.trained_length, length))
        target = os.path.join(self.cfg.train.output_dir, "best")
        embedding = {"pooling": ST_POOLING[self.cfg.model.pooling], "normalize": self.cfg.model.normalize,
                     "max_seq_length": min(length, m.max_position_embeddings)}

        def write(fresh: str) -> None:
            with tempfile.TemporaryDirectory() as vocab_dir:
                save_vocab(self.tokenizer.source, vocab_dir)
                write_hf(replace(ckpt, vocab_dir=vocab_dir), fresh,
                         architecture="ModernBertModel" if m.modern else "BertModel", sentence_embedding=embedding)
            with open(os.path.join(fresh, "embed_result.json"), "w") as f:
                json.dump(result, f, indent=2)

        replace_directory(target, write, f"the step-{result['step']} weights")
        self.watchdog.progress(f"the save of the step-{result['step']} weights")
        logger.info(f"saved the step-{result['step']} weights to {target}")


def run(cfg: EmbedConfig, parallel) -> dict:
    started = time.perf_counter()
    trainer = ContrastiveTrainer(cfg, parallel)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    summary["seconds"] = time.perf_counter() - started
    return summary
