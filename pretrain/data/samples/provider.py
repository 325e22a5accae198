"""The trainer's datasets from the data config: synthetic, or BERT samples over indexed data."""
from __future__ import annotations

import dataclasses
import logging

import os
from typing import Callable

from ...config import Config
from ..preprocess.dataset_record import dataset_problems
from ..preprocess.groups import MANIFEST_SUFFIX, manifest_problems
from .token_ids import VocabError, Vocabulary

logger = logging.getLogger(__name__)


def data_file_problems(cfg: Config) -> list[str]:
    """Missing or unreadable data files, datasets of mostly special tokens, and datasets made with
    another vocabulary than data.vocab_file, found before any process group starts (one line each)."""
    d = cfg.data
    if d.kind != "indexed":
        return []
    problems = []
    vocab = None
    if d.vocab_file:
        try:
            vocab = Vocabulary.from_file(d.vocab_file)
        except VocabError as err:
            problems.append(f"data.vocab_file: {err}")
    if vocab is not None and cfg.model.vocab_size is not None and vocab.size > cfg.model.vocab_size:
        problems.append(_vocab_size_problem(d.vocab_file, vocab.size, cfg.model.vocab_size))
    problems += manifest_problems(d)
    for key in ("paths", "valid_paths", "test_paths"):
        for prefix in getattr(d, key):
            if prefix.endswith(MANIFEST_SUFFIX):
                continue  # not expanded: manifest_problems said why
            missing = [prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(prefix + suffix)]
            problems += [f"data.{key}: {path} does not exist (give prefixes without .bin/.idx, as "
                         "tools/preprocess_data.py prints them)" for path in missing]
            if not missing:
                problems += dataset_problems(prefix, f"data.{key}", vocab.tokens if vocab else None, d.vocab_file,
                                             d.accept_dataset_vocab, special_ids=vocab.special_ids if vocab else None,
                                             pad_id=vocab.pad_id if vocab else None)
    return problems


def _vocab_size_problem(vocab_file: str, tokens: int, vocab_size: int) -> str:
    return (f"data.vocab_file {vocab_file} has {tokens} tokens but model.vocab_size is {vocab_size}: set "
            f"model.vocab_size={tokens}, or null to take the tokenizer's size")


def vocab_size_from_tokenizer(tree: dict) -> dict:
    """The config's {section: {key: value}} tree with model.vocab_size null replaced by the size of
    data.vocab_file's tokenizer (every id it gives is below it); left null when there is no file to
    read (the model's check names that, the data checks an unreadable file). Torch-free: applied
    when the run's config is loaded (pretrain/checkpoint/starting_point.py: load_run_config)."""
    model, vocab_file = tree.get("model", {}), tree.get("data", {}).get("vocab_file")
    if "vocab_size" not in model or model["vocab_size"] is not None or not vocab_file:
        return tree
    try:
        size = Vocabulary.from_file(vocab_file).size
    except VocabError:
        return tree
    return {**tree, "model": {**model, "vocab_size": size}}


# What a separate validation or test corpus contributes: all of its documents, at its position
# (the split index also seeds its sampling).
WHOLE_CORPUS_AS = {1: "0,1,0", 2: "0,0,1"}


def pretraining_datasets(cfg: Config, is_builder: bool, barrier: Callable[[], None] | None):
    """(train, valid, test) datasets. Valid and test come from data.valid_paths / data.test_paths
    (every document of those corpora) when given, else from data.split's shares of data.paths;
    either is None when it has no documents (synthetic data has no test set).

    is_builder: this rank builds missing sample indices (one rank); barrier: waits for it.
    """
    d, t = cfg.data, cfg.train
    if d.kind == "synthetic":
        from .synthetic import SyntheticDataset

        shares = dict(mask_share=d.mask_token_share, random_share=d.random_token_share)
        train = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions(), d.num_samples, d.seed,
                                 d.masked_lm_prob, d.synthetic_min_fraction, **shares)
        valid = SyntheticDataset(cfg.model.vocab_size, d.seq_length, d.max_predictions(), d.num_samples,
                                 d.seed + 1, d.evaluation_masking_rate(), d.synthetic_min_fraction, **shares)
        return train, valid, None
    # here, not at the top: the configuration check (data_file_problems) must not wait for
    # torch's and megatron-core's imports
    from ..preprocess.indexed import DataError
    from .bert_dataset import CorpusSpec, SampleSettings, build_split_dataset
    from .mixture import MixtureSettings

    try:
        vocab = Vocabulary.from_file(d.vocab_file)
    except VocabError as err:
        raise DataError(f"data.vocab_file: {err}") from None
    if vocab.size > cfg.model.vocab_size:
        raise DataError(_vocab_size_problem(d.vocab_file, vocab.size, cfg.model.vocab_size))
    settings = SampleSettings(
        seq_length=d.seq_length, segment_pairs=d.segment_pairs, short_seq_prob=d.short_seq_prob,
        masked_lm_prob=d.masked_lm_prob, max_predictions=d.max_predictions(),
        mask_share=d.mask_token_share, random_share=d.random_token_share,
        whole_word_masking=d.whole_word_masking, max_ngram=d.max_ngram, dynamic_masking=d.masking == "dynamic",
        seed=d.seed)
    weights = d.weights or [1.0] * len(d.paths)
    corpora = [CorpusSpec(prefix, w) for prefix, w in zip(d.paths, weights)]
    stores: dict = {}
    common = dict(vocab=vocab, cache_dir=d.index_cache_dir, is_builder=is_builder, barrier=barrier, stores=stores)
    mixture = MixtureSettings(unit=d.weights_unit, alpha=d.sampling_exponent(), max_epochs=d.max_epochs)
    common["mixture"] = mixture
    train = build_split_dataset(corpora, 0, d.split, t.train_steps * t.global_batch_size, settings=settings,
                                report=logger.info if is_builder else None, **common)
    if train is None:
        raise DataError(f"data.split {d.split!r} leaves no training documents in {', '.join(d.paths)}")
    eval_samples = max(1, cfg.eval.steps) * t.global_batch_size

    # evaluation masks at its own rate (data.eval_masked_lm_prob), in batches of the training shape
    evaluated = dataclasses.replace(settings, masked_lm_prob=d.evaluation_masking_rate())

    def held_out(index: int, separate: list[str]):
        if separate:
            return build_split_dataset([CorpusSpec(prefix, 1.0) for prefix in separate], index,
                                       WHOLE_CORPUS_AS[index], eval_samples, settings=evaluated, **common)
        return build_split_dataset(corpora, index, d.split, eval_samples, settings=evaluated, **common)

    valid, test = held_out(1, d.valid_paths), held_out(2, d.test_paths)
    if valid is None and cfg.eval.interval:
        raise DataError(f"eval.interval is set but data.split {d.split!r} leaves no validation documents "
                        "(set data.valid_paths, or give the split a validation share)")
    return train, valid, test
