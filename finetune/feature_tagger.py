"""The feature-based approach to token classification (BERT paper section 5.3, Table 7): the
encoder stays frozen; the hidden states of chosen layers (default: the last four, concatenated)
at every word's first sub-token, taken from the window where the word has the most context, are
computed once and cached on disk; a randomly initialised two-layer bidirectional LSTM with a
linear layer on top is trained on them, sentence by sentence, and scored with the fine-tuned
task's own metrics and prediction files.

The cache (<features.cache_dir>/<file stem>-<key>.safetensors, float16) is keyed by the data
file's bytes, the checkpoint's files (names, sizes, modification times), the layers and the
window settings: a second run with the same inputs reads it instead of running the encoder.
The encoder runs tensor-parallel over the world (no data parallelism: the world is the TP
group); the tagger trains on the logging rank, on the model's device.
"""
from __future__ import annotations

import logging

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from pretrain.checkpoint.format import CheckpointError
from pretrain.checkpoint.load import read_any
from pretrain.checkpoint.tokenizer_files import checkpoint_tokenizer
from pretrain.observability.console import progress
from pretrain.distributed.device import configure_math, describe, reduce_floats
from pretrain.model.rng import RngTracker, seed_streams
from pretrain.common.atomic import atomic_outputs

from .config import FinetuneConfig
from .model import build_encoder, encoder_inputs, load_encoder
from .official_metrics import official_metric
from .tasks import TASKS
from .tasks.base import Dataset, TaskDataError
from .finetuner import FinetuneError, write_files

logger = logging.getLogger(__name__)


@dataclass
class WordFeatures:
    """A file's documents and the feature vector of each of their words, in order."""

    data: Dataset
    vectors: torch.Tensor  # [words, len(layers) x hidden], float16 on the host

    def sentences(self) -> list[torch.Tensor]:
        """The vectors of each sentence of each document, in file order."""
        lengths = [len(s.words) for d in self.data.examples for s in d.sentences]
        return list(torch.split(self.vectors, lengths))

    def sentence_labels(self, label_id: dict[str, int]) -> list[torch.Tensor]:
        from .tasks.tagging import to_iob2

        return [torch.tensor([label_id[t] for t in to_iob2(s.tags)]) for d in self.data.examples for s in d.sentences]


class BiLstmTagger(nn.Module):
    """Dropout, a bidirectional LSTM and a linear layer over a sentence's word vectors."""

    def __init__(self, features: int, hidden: int, layers: int, dropout: float, labels: int):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, bidirectional=True, batch_first=True,
                            dropout=dropout if layers > 1 else 0.0)
        self.classifier = nn.Linear(2 * hidden, labels)

    def forward(self, vectors: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.dropout(vectors), lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        hidden, _ = self.lstm(packed)
        hidden, _ = nn.utils.rnn.pad_packed_sequence(hidden, batch_first=True, total_length=vectors.shape[1])
        return self.classifier(self.dropout(hidden))


def _padded(sequences: list[torch.Tensor], device, value=0.0) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=value).to(device)


class FeatureTagger:
    def __init__(self, cfg: FinetuneConfig, parallel):
        self.cfg, self.parallel = cfg, parallel
        self.task = TASKS[cfg.task.name].configured(cfg.task)
        f = cfg.features
        self.output_dir = f.output_dir or os.path.join(cfg.train.output_dir, "feature_based")
        self.cache_dir = f.cache_dir or os.path.join(cfg.train.output_dir, "feature_cache")
        try:
            self.ckpt = read_any(cfg.model.init_from, with_optimizer=False)
            self.tokenizer = checkpoint_tokenizer(self.ckpt.vocab_dir, self.ckpt.config.model.vocab_size,
                                                  self.ckpt.source, cfg.model.vocab_file,
                                                  how_to_name_one="set model.vocab_file")
        except CheckpointError as e:
            raise FinetuneError(str(e)) from None
        layers = self.ckpt.config.model.num_layers
        bad = [layer for layer in f.layers if not -layers - 1 <= layer <= layers]
        if bad:
            raise FinetuneError(f"features.layers {bad}: the model has layers 0 (embeddings) to {layers} "
                                f"(or -1 to -{layers + 1})")
        self._bert = None
        configure_math(parallel.device, cfg.train.tf32)  # the encoder's and the tagger's matmuls, as fine-tuning's
        logger.info(f"{describe(parallel)}; the encoder frozen, the tagger trains on {parallel.device} (rank "
                    f"{parallel.logging_rank})")

    # ----------------------------------------------------------------------------- features
    def _encoder(self) -> nn.Module:
        """The frozen encoder, built at the first file the cache does not hold."""
        if self._bert is None:
            p, m = self.parallel, self.ckpt.config.model
            tracker = RngTracker(p.device)
            seed_streams(tracker, self.cfg.train.seed, p.tp_rank, 0, p.dp_rank)
            self._bert = build_encoder(m, p.tp_group, tracker)
            load_encoder(self._bert, self.ckpt.weights, m, p.tp_rank, p.tp_size)
            self._bert.to(p.device).eval().requires_grad_(False)
        return self._bert

    def _cache_path(self, path: str) -> str:
        digest = hashlib.sha256()
        with open(path, "rb") as data:
            for block in iter(lambda: data.read(1 << 20), b""):
                digest.update(block)
        source = self.cfg.model.init_from
        listing = [(os.path.relpath(os.path.join(d, n), source), os.path.getsize(os.path.join(d, n)),
                    int(os.path.getmtime(os.path.join(d, n)))) for d, _, names in sorted(os.walk(source))
                   for n in sorted(names)] if os.path.isdir(source) else [(source, os.path.getsize(source))]
        t = self.cfg.task
        digest.update(json.dumps([os.path.realpath(source), listing, self.cfg.model.vocab_file, self.cfg.features.layers,
                                  t.max_seq_length, t.doc_stride, t.context]).encode())
        stem = os.path.splitext(os.path.basename(path))[0]
        return os.path.join(self.cache_dir, f"{stem}-{digest.hexdigest()[:16]}.safetensors")

    def word_features(self, name: str, path: str, split: str) -> WordFeatures:
        from safetensors.torch import load_file, save_file

        try:
            read = self.task.read(path, split, self.cfg.task)
        except TaskDataError as e:
            raise FinetuneError(str(e)) from None
        logger.info(read.report.summary())
        features = self.task.encode(self.tokenizer.tokenizer, read.examples, self.cfg.task, False, self.tokenizer.specials)
        data = Dataset(name, read.examples, features, read.reference)
        cache = self._cache_path(path)
        shape = (sum(features.words_per_example), len(self.cfg.features.layers) * self.ckpt.config.model.hidden_size)
        vectors = None
        if os.path.exists(cache):
            try:
                vectors = load_file(cache)["vectors"]
            except Exception as e:  # unreadable: computed again and rewritten, said in the log
                logger.info(f"  {cache}: not readable ({e}); computing the features again")
            if vectors is not None and tuple(vectors.shape) != shape:
                logger.info(f"  {cache}: holds {tuple(vectors.shape)} values, {shape} expected; computing them again")
                vectors = None
        # one decision for the TP group (a node-local cache may exist on some ranks only)
        if reduce_floats([vectors is not None], self.parallel.device, self.parallel.tp_group, "min")[0]:
            logger.info(f"  features from the cache {cache}")
            return WordFeatures(data, vectors)
        started = time.perf_counter()
        vectors = self._compute(features)
        if self.parallel.rank == self.parallel.logging_rank:
            os.makedirs(self.cache_dir, exist_ok=True)
            with atomic_outputs([cache]) as temporary:
                save_file({"vectors": vectors}, temporary[cache])
            logger.info(f"  features of layers {self.cfg.features.layers} for {vectors.shape[0]:,} words "
                        f"({vectors.shape[1]} values each) in {time.perf_counter() - started:.1f} s, cached in {cache}")
        return WordFeatures(data, vectors)

    @torch.no_grad()
    def _compute(self, features) -> torch.Tensor:
        """Each word's layers, concatenated, at its first sub-token in the window that predicts it."""
        bert, p, layers = self._encoder(), self.parallel, self.cfg.features.layers
        offsets = np.cumsum([0] + features.words_per_example).tolist()
        width = len(layers) * self.ckpt.config.model.hidden_size
        vectors = torch.zeros((offsets[-1], width), dtype=torch.float16)
        size = self.cfg.train.eval_batch_size
        for start in range(0, len(features), size):
            window_ids = list(range(start, min(start + size, len(features))))
            inputs, _ = features.batch(window_ids, p.device)
            states = bert.hidden_states(encoder_inputs(*inputs))
            stacked = torch.cat([states[layer] for layer in layers], dim=-1).to(torch.float16).cpu()
            for row, window in enumerate(window_ids):
                base = offsets[features.example_index[window]]
                for word, position in features.predicts[window]:
                    vectors[base + word] = stacked[row, position]
        return vectors

    # ----------------------------------------------------------------------------- the tagger
    def _predict(self, model: nn.Module, sentences: list[torch.Tensor]) -> list[torch.Tensor]:
        model.eval()
        out, size, device = [], self.cfg.features.batch_size, self.parallel.device
        with torch.no_grad():
            for i in range(0, len(sentences), size):
                batch = sentences[i:i + size]
                lengths = torch.tensor([len(s) for s in batch])
                logits = model(_padded([s.float() for s in batch], device), lengths).argmax(-1).cpu()
                out += [row[:n] for row, n in zip(logits, lengths.tolist())]
        model.train()
        return out

    def _by_document(self, data: WordFeatures, predicted: list[torch.Tensor]) -> list[list[int]]:
        sentences, out = iter(predicted), []
        for document in data.data.examples:
            out.append([int(t) for _ in document.sentences for t in next(sentences)])
        return out

    def run(self) -> dict:
        c, task = self.cfg.task, self.task
        train_path = c.train_file or os.path.join(c.data_dir, task.train_file)
        dev_paths = c.dev_files or [os.path.join(c.data_dir, name) for name in task.dev_files]
        if not os.path.exists(train_path):
            raise FinetuneError(f"no training file: {train_path} (set task.train_file)")
        train = self.word_features("train", train_path, "train")
        devs, tests = [], []
        for path in dev_paths:
            if os.path.exists(path):
                devs.append(self.word_features(os.path.splitext(os.path.basename(path))[0], path, "dev"))
            else:
                logger.info(f"{path}: not found; this dev set is left out")
        if not devs:
            raise FinetuneError(f"no dev file (looked for {', '.join(dev_paths)})")
        for test in task.test_inputs(c):
            if os.path.exists(test.path):
                tests.append(self.word_features(test.submission, test.path, "test"))
            else:
                logger.info(f"{test.path}: not found; no predictions for it")
        if self.parallel.rank != self.parallel.logging_rank:
            return {}
        return self._train(train, devs, tests)

    def _train(self, train: WordFeatures, devs: list[WordFeatures], tests: list[WordFeatures]) -> dict:
        f, t, device = self.cfg.features, self.cfg.train, self.parallel.device
        label_id = {tag: i for i, tag in enumerate(self.task.labels)}
        inputs, targets = train.sentences(), train.sentence_labels(label_id)
        torch.manual_seed(t.seed)
        model = BiLstmTagger(train.vectors.shape[1], f.lstm_hidden, f.lstm_layers, f.dropout,
                             len(self.task.labels)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=f.lr)
        order_generator = torch.Generator().manual_seed(t.seed)
        history, best, best_state, losses = [], None, None, []
        bar = progress(f.epochs, f"feature-based {self.task.name}", enabled=t.progress, unit="epoch")
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(self.output_dir, "tensorboard"))
        for epoch in range(1, f.epochs + 1):
            order = torch.randperm(len(inputs), generator=order_generator).tolist()
            epoch_losses = []
            for i in range(0, len(order), f.batch_size):
                batch = order[i:i + f.batch_size]
                lengths = torch.tensor([len(inputs[j]) for j in batch])
                logits = model(_padded([inputs[j].float() for j in batch], device), lengths)
                labels = _padded([targets[j] for j in batch], device, value=-100)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                optimizer.step()
                epoch_losses.append(loss.detach())
            losses.append(float(torch.stack(epoch_losses).mean()))
            metrics, files = {}, {}
            for dev in devs:
                evaluation = self.task.evaluate_words(dev.data, self._by_document(dev, self._predict(model, dev.sentences())))
                prefix = f"{dev.data.name}/" if len(devs) > 1 else ""
                metrics.update({prefix + k: v for k, v in evaluation.metrics.items()})
                files.update(evaluation.files)
            score = self.task.score(metrics)
            result = {"epoch": epoch, "metrics": metrics, "score": score, "train_loss": losses[-1]}
            history.append(result)
            logger.info(f"epoch {epoch} | loss {losses[-1]:.4f} | "
                        + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            bar.update(1)
            writer.add_scalar("train/loss", losses[-1], epoch)
            for key, value in metrics.items():
                writer.add_scalar(f"eval/{key}", value, epoch)
            if best is None or score > best["score"]:
                best, best_state = result, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                write_files(os.path.join(self.output_dir, "predictions"), files)
        bar.close()
        writer.close()
        model.load_state_dict(best_state)
        for test in tests:
            write_files(os.path.join(self.output_dir, "submission"),
                         self.task.submission_words(test.data, self._by_document(test, self._predict(model, test.sentences()))))
        self._save(best_state, train.vectors.shape[1])
        summary = {"task": self.task.name, "approach": "feature-based", "layers": f.layers,
                   "selected_by": official_metric(self.task.name).description, "history": history,
                   "best": best}
        with atomic_outputs([os.path.join(self.output_dir, "metrics.json")]) as temporary:
            with open(next(iter(temporary.values())), "w") as out:
                json.dump(summary, out, indent=2)
        logger.info(f"best: epoch {best['epoch']} " + " ".join(f"{k} {v:.4f}" for k, v in best["metrics"].items()))
        return summary

    def _save(self, state: dict, width: int) -> None:
        """The best tagger's weights and what rebuilding it needs."""
        from safetensors.torch import save_file

        f = self.cfg.features
        path = os.path.join(self.output_dir, "tagger.safetensors")
        with atomic_outputs([path, path.replace(".safetensors", ".json")]) as temporary:
            save_file({k: v.contiguous() for k, v in state.items()}, temporary[path])
            with open(temporary[path.replace(".safetensors", ".json")], "w") as out:
                json.dump({"features": width, "labels": list(self.task.labels), "checkpoint": self.cfg.model.init_from,
                           **asdict(f)}, out, indent=2)


def run(cfg: FinetuneConfig, parallel) -> dict:
    started = time.perf_counter()
    summary = FeatureTagger(cfg, parallel).run()
    summary["seconds"] = time.perf_counter() - started
    return summary
