"""BERT pretraining samples over one or more Megatron indexed datasets.

Layers, each a pure function of what it is given:
- TokenStore: one `<prefix>.{bin,idx}` mapped read-only (sentences = items, documents).
- a segment table per (corpus, split): sentence ranges of A and B and the pair label
  (pretrain/data/samples/segments.py), built once and cached on disk (index_cache.py);
- corpus order per epoch: a keyed permutation (shuffle.py), epoch e of corpus c keyed by
  (seed, c, e), so no permutation is ever materialised;
- blending: megatron-core's compiled build_blending_indices (the greedy rule that keeps every
  prefix of the sample sequence closest to the weights), cached like the segment tables;
- the sample: tokens read, the pair truncated (longer side, random end), masked
  (masking.py), padded. Its random draws come from a generator seeded by (seed, corpus,
  segment row) for static masking, or (seed, corpus, epoch, segment row) for dynamic masking.

Sample i is therefore the same for every layout, worker count and restart.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .index_cache import cached_index, file_fingerprint, mapped_state, from_mapped_state
from ..preprocess.indexed import DataError, IndexedDataset, open_indexed_dataset
from .masking import MaskingConfig, mask_tokens
from .batches import SAMPLE_FIELDS
from .mixture import (MixtureSettings, describe, epochs_read, measured_token_shares, sample_tokens, sample_weights,
                      token_shares)
from .segments import SegmentSettings, build_segments
from .shuffle import FeistelPermutation
from .token_ids import Vocabulary

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class SampleSettings:
    seq_length: int
    segment_pairs: str  # nsp | sop | none
    short_seq_prob: float
    masked_lm_prob: float
    max_predictions: int
    whole_word_masking: bool
    max_ngram: int
    dynamic_masking: bool
    seed: int
    mask_share: float = 0.8  # a predicted token becomes [MASK] ...
    random_share: float = 0.1  # ... or a random token (else it stays)


class TokenStore:
    """Token ids of one indexed dataset: sentence s is tokens[offsets(s):offsets(s) + lengths[s]].

    Everything is a read-only view of the `.bin`/`.idx` mappings, never a copy: N ranks and their
    loader processes share one copy in the page cache. Pickled (for a loader process) it is its
    prefix alone, and the worker maps the files again.
    """

    def __init__(self, prefix: str, contiguous: bool | None = None, multimodal: bool = False):
        self.prefix = prefix
        # Kept alive: the arrays below are views of its .idx mapping, which it unmaps when collected.
        # Validated (a pass over the index) where first opened; a loader process maps it directly.
        self._index = open_indexed_dataset(prefix) if contiguous is None else \
            IndexedDataset(prefix, multimodal=multimodal, mmap=True)
        self.lengths = self._index.sequence_lengths  # int32 view
        self.document_bounds = self._index.document_indices  # int64 view
        self._pointers = self._index.index.sequence_pointers  # byte offsets into .bin, int64 view
        dtype = np.dtype(self._index.index.dtype)
        self._itemsize = dtype.itemsize
        # a plain ndarray view of the mapping: slicing a np.memmap costs a subclass round trip
        self.tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r").view(np.ndarray)
        # Items written in order (every writer we know) are contiguous: a range of sentences
        # is then one slice of the file. Checked once (a pass over the index), then passed on.
        if contiguous is None:
            contiguous = bool(np.array_equal(self._pointers[1:] // self._itemsize,
                                             self._pointers[:-1] // self._itemsize + self.lengths[:-1]))
        self.contiguous = contiguous

    def __getstate__(self):
        return {"prefix": self.prefix, "contiguous": self.contiguous, "multimodal": self._index.multimodal}

    def __setstate__(self, state):
        self.__init__(**state)

    def offset(self, sentence: int) -> int:
        return int(self._pointers[sentence]) // self._itemsize

    @property
    def num_documents(self) -> int:
        return len(self.document_bounds) - 1

    def span(self, begin: int, end: int) -> np.ndarray:
        if begin >= end:
            return np.zeros(0, dtype=np.int64)
        if self.contiguous:
            return self.tokens[self.offset(begin):self.offset(end - 1) + int(self.lengths[end - 1])].astype(np.int64)
        return np.concatenate([self.tokens[self.offset(s):self.offset(s) + int(self.lengths[s])]
                               for s in range(begin, end)]).astype(np.int64)

    def largest_token_id(self, first_doc: int, last_doc: int) -> int:
        """The largest id in documents [first_doc, last_doc) (-1 if they hold no tokens)."""
        begin, end = int(self.document_bounds[first_doc]), int(self.document_bounds[last_doc])
        tokens = self.span(begin, end) if end > begin else None
        return int(tokens.max()) if tokens is not None and tokens.size else -1


def split_document_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Megatron's split rule: "949,50,1" -> contiguous document ranges for train, valid, test."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        raise DataError(f"data.split {split!r}: expected comma-separated numbers such as '949,50,1'") from None
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise DataError(f"data.split {split!r}: expected up to three non-negative weights with a positive sum")
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class CorpusSplit:
    """The segment table of one corpus's split, and how its epochs are ordered."""

    def __init__(self, store: TokenStore, table: np.ndarray, counts: dict, corpus_id: int, seed: int):
        # seed: the data seed, offset per split so train and valid rows draw different masks
        self.store = store
        self.table = table
        self.counts = counts
        self.corpus_id = corpus_id
        self.seed = seed
        self._orders: dict[int, FeistelPermutation] = {}

    def __getstate__(self):  # the cached table travels as its file name (index_cache.mapped_state)
        return dict(self.__dict__, table=mapped_state(self.table), _orders={})

    def __setstate__(self, state):
        self.__dict__.update(state, table=from_mapped_state(state["table"]))

    def __len__(self) -> int:
        return int(self.table.shape[0])

    def locate(self, k: int) -> tuple[int, int]:
        """The k-th sample drawn from this split -> (epoch, segment row)."""
        epoch, position = divmod(k, len(self))
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = FeistelPermutation(len(self), key=(self.seed << 40) ^ (self.corpus_id << 24) ^ epoch)
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
        return epoch, order(position)


class BertPretrainingDataset:
    """`num_samples` samples blended from the corpora's splits by weight (SAMPLE_FIELDS dicts)."""

    def __init__(self, splits: list[CorpusSplit], blend: np.ndarray | None, num_samples: int,
                 settings: SampleSettings, vocab: Vocabulary):
        self.splits = splits
        self.blend = blend  # structured [num_samples] (corpus, k) or None for one corpus
        self.num_samples = num_samples
        self.settings = settings
        self.vocab = vocab
        self.special = np.zeros(vocab.size, dtype=bool)
        self.special[vocab.special_ids] = True
        self.continuation = vocab.continuation_flags()
        # A word-start marker ('Ġ', '▁') is missing on a sentence's first word when the tokenizer
        # adds no prefix space: every sentence start then starts a word (special_tokens.py).
        self.sentences_start_words = vocab.words.kind == "marker"
        self.masking = MaskingConfig(settings.masked_lm_prob, settings.max_predictions, settings.whole_word_masking,
                                     settings.max_ngram, vocab.mask_id, vocab.replacement_ids(), settings.mask_share,
                                     settings.random_share)
        self.max_tokens = SegmentSettings(settings.segment_pairs, settings.seq_length, 0.0, 0).max_num_tokens

    def __getstate__(self):
        return dict(self.__dict__, blend=mapped_state(self.blend))

    def __setstate__(self, state):
        self.__dict__.update(state, blend=from_mapped_state(state["blend"]))

    @property
    def description(self) -> str:
        """What the samples are drawn from, for messages about them."""
        return ", ".join(f"{split.store.prefix}.bin" for split in self.splits)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside range({self.num_samples})")
        if self.blend is None:
            corpus, k = 0, index
        else:
            corpus, k = int(self.blend["corpus"][index]), int(self.blend["k"][index])
        split = self.splits[corpus]
        epoch, row = split.locate(k)
        return self.build_sample(split, row, epoch)

    def build_sample(self, split: CorpusSplit, row: int, epoch: int) -> dict[str, np.ndarray]:
        s = self.settings
        a_begin, a_end, b_begin, b_end, label = (int(v) for v in split.table[row])
        a, b = split.store.span(a_begin, a_end), split.store.span(b_begin, b_end)
        sample_rng = np.random.default_rng([split.seed, split.corpus_id, row])
        a_lo, a_hi, b_lo, b_hi = _truncation(a.size, b.size, self.max_tokens, sample_rng)
        if self.sentences_start_words:
            a_starts = _sentence_starts(split.store.lengths, a_begin, a_end, a_lo, a_hi)
            b_starts = _sentence_starts(split.store.lengths, b_begin, b_end, b_lo, b_hi)
        a, b = a[a_lo:a_hi], b[b_lo:b_hi]
        mask_rng = np.random.default_rng([split.seed, split.corpus_id, row, epoch]) if s.dynamic_masking else sample_rng

        vocab = self.vocab
        pair = s.segment_pairs != "none"
        n = a.size + 2 + (b.size + 1 if pair else 0)
        tokens = np.empty(n, dtype=np.int64)
        tokens[0] = vocab.cls_id
        tokens[1:1 + a.size] = a
        tokens[1 + a.size] = vocab.sep_id
        token_types = np.zeros(s.seq_length, dtype=np.int64)
        if pair:
            tokens[2 + a.size:n - 1] = b
            tokens[n - 1] = vocab.sep_id
            token_types[2 + a.size:n] = 1
        continuation = self.continuation[tokens]
        if self.sentences_start_words:
            continuation[1 + a_starts] = False
            if pair:
                continuation[2 + a.size + b_starts] = False
        corrupted, positions, labels = mask_tokens(tokens, ~self.special[tokens], continuation, mask_rng, self.masking)
        input_ids = np.full(s.seq_length, vocab.pad_id, dtype=np.int64)
        input_ids[:n] = corrupted
        padding_mask = np.zeros(s.seq_length, dtype=np.int64)
        padding_mask[:n] = 1
        masked_positions = np.zeros(s.max_predictions, dtype=np.int64)
        masked_labels = np.zeros(s.max_predictions, dtype=np.int64)
        masked_weights = np.zeros(s.max_predictions, dtype=np.float32)
        masked_positions[:positions.size] = positions
        masked_labels[:positions.size] = labels
        masked_weights[:positions.size] = 1.0
        return {"input_ids": input_ids, "token_type_ids": token_types, "padding_mask": padding_mask,
                "masked_positions": masked_positions, "masked_labels": masked_labels,
                "masked_weights": masked_weights, "nsp_label": np.array(label, dtype=SAMPLE_FIELDS["nsp_label"])}


def _truncate_pair(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator):
    """google-research/bert's truncate_seq_pair: trim the longer side (B on ties), one token at a
    time from its front or its back (a fair coin each), until the pair fits."""
    a_lo, a_hi, b_lo, b_hi = _truncation(a.size, b.size, max_tokens, rng)
    return a[a_lo:a_hi], b[b_lo:b_hi]


def _truncation(a_size: int, b_size: int, max_tokens: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """_truncate_pair's cut as (a_lo, a_hi, b_lo, b_hi): the kept slices of A and B."""
    excess = a_size + b_size - max_tokens
    if excess <= 0:
        return 0, a_size, 0, b_size
    la, lb = a_size, b_size
    a_front = a_back = b_front = b_back = 0
    for from_front in rng.random(excess) < 0.5:
        if la > lb:
            la -= 1
            a_front, a_back = (a_front + 1, a_back) if from_front else (a_front, a_back + 1)
        else:
            lb -= 1
            b_front, b_back = (b_front + 1, b_back) if from_front else (b_front, b_back + 1)
    return a_front, a_size - a_back, b_front, b_size - b_back


def _sentence_starts(lengths: np.ndarray, begin: int, end: int, lo: int, hi: int) -> np.ndarray:
    """Positions, within the kept slice [lo, hi) of sentences [begin, end) laid end to end, of the
    sentences' first tokens (a sentence whose start was cut off has none)."""
    if end <= begin:
        return np.zeros(0, dtype=np.int64)
    starts = np.zeros(end - begin, dtype=np.int64)
    np.cumsum(lengths[begin:end - 1], out=starts[1:])
    return starts[(starts >= lo) & (starts < hi)] - lo


# ----------------------------------------------------------------------------------------------- building


@dataclass(frozen=True)
class CorpusSpec:
    prefix: str
    weight: float


def build_split_dataset(corpora: list[CorpusSpec], split_index: int, split: str, num_samples: int,
                        settings: SampleSettings, vocab: Vocabulary, cache_dir: str | None, is_builder: bool,
                        barrier: Callable[[], None] | None,
                        stores: dict[str, TokenStore] | None = None,
                        mixture: MixtureSettings = MixtureSettings(),
                        report: Callable[[str], None] | None = None) -> BertPretrainingDataset | None:
    """The dataset of one split (0 train, 1 valid, 2 test) blending `corpora` by `mixture`
    (mixture.py); None when the split holds no documents in any corpus. `report`: where the
    blend's shares asked and achieved are said (the training split's, on one rank)."""
    stores = {} if stores is None else stores
    segment_settings = SegmentSettings(settings.segment_pairs, settings.seq_length, settings.short_seq_prob,
                                       settings.seed)
    splits, weights = [], []
    for corpus_id, spec in enumerate(corpora):
        store = stores.get(spec.prefix)
        if store is None:
            store = stores[spec.prefix] = TokenStore(spec.prefix)
        first, last = split_document_ranges(store.num_documents, split)[split_index]
        if last <= first:
            continue
        description = {"kind": "segments", "idx": file_fingerprint(spec.prefix + ".idx"),
                       "documents": [first, last], "settings": segment_settings.__dict__}

        def build(store=store, first=first, last=last):
            try:
                table, counts = build_segments(store.lengths, store.document_bounds, first, last, segment_settings)
            except ValueError as err:
                raise DataError(f"{spec.prefix} ({SPLIT_NAMES[split_index]} split): {err}") from None
            # Read once by the building rank and cached, not by every rank at every start-up.
            counts["largest_token_id"] = store.largest_token_id(first, last)
            return table, counts

        table, counts = cached_index(cache_dir or _default_cache_dir(spec.prefix), "segments", description, build,
                                     is_builder, barrier)
        if counts["largest_token_id"] >= vocab.size:  # a dataset made with another vocabulary
            raise DataError(f"{spec.prefix}.bin: token id {counts['largest_token_id']} is outside the vocabulary of "
                            f"{vocab.size} tokens (preprocessed with another vocabulary?)")
        if len(table) == 0:
            raise DataError(f"{spec.prefix} ({SPLIT_NAMES[split_index]} split, documents [{first}, {last})): no "
                            f"samples could be made ({counts})")
        splits.append(CorpusSplit(store, table, counts, corpus_id, settings.seed + 7919 * split_index))
        weights.append(spec.weight)
    if not splits:
        return None
    blend = None
    if len(splits) > 1:
        max_tokens = SegmentSettings(settings.segment_pairs, settings.seq_length, 0.0, 0).max_num_tokens
        tokens = [sample_tokens(s.table, s.store.lengths, max_tokens, settings.segment_pairs != "none")
                  for s in splits]
        drawn = sample_weights(weights, tokens, mixture)
        description = {"kind": "blend", "weights": drawn, "num_samples": num_samples,
                       "corpora": [file_fingerprint(s.store.prefix + ".idx") for s in splits]}
        blend, _ = cached_index(cache_dir or _default_cache_dir(corpora[0].prefix), "blend", description,
                                lambda: (_blending_indices(drawn, num_samples), {"weights": drawn}),
                                is_builder, barrier)
        names = [Path(s.store.prefix).name for s in splits]
        epochs = epochs_read(drawn, num_samples, [len(s.table) for s in splits])
        if mixture.max_epochs is not None:
            over = [f"{name} ({read:.2f} epochs)" for name, read in zip(names, epochs) if read > mixture.max_epochs]
            if over:
                raise DataError(f"the {SPLIT_NAMES[split_index]} blend reads {', '.join(over)}, more than "
                                f"data.max_epochs ({mixture.max_epochs:g}): lower its share, or raise data.max_epochs")
        if report is not None:
            got, measured = measured_token_shares(blend["corpus"], blend["k"], tokens,
                                                  lambda c, k: splits[c].locate(k)[1])
            how = (f"sampling alpha {mixture.alpha:g}" if mixture.alpha is not None else
                   f"data.weights as {mixture.unit}")
            report(describe(names, token_shares(weights, tokens, mixture), got, epochs, measured, how))
    return BertPretrainingDataset(splits, blend, num_samples, settings, vocab)


def _blending_indices(weights: list[float], size: int) -> np.ndarray:
    from ...distributed.megatron_core import dataset_helpers

    helpers_cpp = dataset_helpers()
    normalized = np.asarray(weights, dtype=np.float64) / sum(weights)
    corpus = np.zeros(size, dtype=np.int16)
    k = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(corpus, k, normalized, len(weights), size, False)
    out = np.empty(size, dtype=[("corpus", np.int16), ("k", np.int64)])
    out["corpus"], out["k"] = corpus, k
    return out


def _default_cache_dir(prefix: str) -> str:
    return str(Path(prefix).parent / "index-cache")
