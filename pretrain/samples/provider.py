"""The trainer's datasets from the data config: synthetic, or BERT samples over indexed data."""
from __future__ import annotations

import os
from typing import Callable

from ..config import Config
from .bert_dataset import CorpusSpec, SampleSettings, build_split_dataset
from ..preprocess.indexed import DataError
from .synthetic import SyntheticDataset
from .token_ids import VocabError, WordPieceVocab


def data_file_problems(cfg: Config) -> list[str]:
    """Missing or unreadable data files, found before any process group starts (one line each)."""
    d = cfg.data
    if d.kind != "indexed":
        return []
    problems = []
    for prefix in d.paths:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                problems.append(f"data.paths: {prefix}{suffix} does not exist (give prefixes without .bin/.idx, "
                                "as tools/preprocess_data.py prints them)")
    if d.vocab_file:
        try:
            WordPieceVocab.from_file(d.vocab_file)
        except VocabError as err:
            problems.append(f"data.vocab_file: {err}")
    return problems


def pretraining_datasets(cfg: Config, is_builder: bool, barrier: Callable[[], None] | None,
                         log: Callable[[str], None]):
    """(train, valid) datasets; valid is None when the split leaves no validation documents.

    is_builder: this rank builds missing sample indices (one rank); barrier: waits for it.
    """
    d, t = cfg.data, cfg.train
    if d.kind == "synthetic":
        train = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions_per_seq, d.num_samples, d.seed,
                                 d.masked_lm_prob)
        valid = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions_per_seq, d.num_samples,
                                 d.seed + 1, d.masked_lm_prob)
        return train, valid
    try:
        vocab = WordPieceVocab.from_file(d.vocab_file)
    except VocabError as err:
        raise DataError(f"data.vocab_file: {err}") from None
    if vocab.size > cfg.model.vocab_size:
        raise DataError(f"data.vocab_file {d.vocab_file} has {vocab.size} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}: set model.vocab_size={vocab.size}")
    settings = SampleSettings(
        seq_length=d.seq_length, segment_pairs=d.segment_pairs, short_seq_prob=d.short_seq_prob,
        masked_lm_prob=d.masked_lm_prob, max_predictions=d.max_predictions_per_seq,
        whole_word_masking=d.whole_word_masking, max_ngram=d.max_ngram, dynamic_masking=d.masking == "dynamic",
        seed=d.seed)
    weights = d.weights or [1.0] * len(d.paths)
    corpora = [CorpusSpec(prefix, w) for prefix, w in zip(d.paths, weights)]
    stores: dict = {}
    common = dict(settings=settings, vocab=vocab, cache_dir=d.index_cache_dir, is_builder=is_builder,
                  barrier=barrier, log=log, stores=stores)
    train = build_split_dataset(corpora, 0, d.split, t.train_steps * t.global_batch_size, **common)
    if train is None:
        raise DataError(f"data.split {d.split!r} leaves no training documents in {', '.join(d.paths)}")
    valid = build_split_dataset(corpora, 1, d.split, max(1, t.eval_steps) * t.global_batch_size, **common)
    if valid is None and t.eval_interval:
        raise DataError(f"train.eval_interval is set but data.split {d.split!r} leaves no validation documents")
    return train, valid
