"""BERT pretraining samples over indexed data: statistics, structure, determinism, bad input.

The corpora are written with megatron-core's own IndexedDatasetBuilder (so this also shows that
files made by Megatron's tooling are read by our dataset) from a small made-up vocabulary in
which words have '##' continuations.
"""
import os
import signal

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from pretrain.data.samples.bert_dataset import (CorpusSpec, SampleSettings, TokenStore, build_split_dataset,
                                        split_document_ranges)
from pretrain.data.preprocess.indexed import DataError
from pretrain.data.samples.masking import MaskingConfig, mask_tokens
from pretrain.data.samples.batches import MicroBatchIterator
from pretrain.data.samples.segments import SegmentSettings, build_segments
from pretrain.data.samples.shuffle import FeistelPermutation
from pretrain.data.preprocess.tokenizer import bert_wordpiece_tokenizer
from pretrain.data.samples.token_ids import VocabError, WordPieceVocab

SPECIALS = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(150)]
PIECES = [f"##p{i}" for i in range(50)]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(SPECIALS + WORDS + PIECES) + "\n")
    return path


@pytest.fixture(scope="module")
def vocab(vocab_file):
    return WordPieceVocab.from_file(vocab_file)


def _sentence(rng, vocab: WordPieceVocab, words: int) -> list[int]:
    """Words of one or more pieces: a word id, then 0-2 '##' continuations."""
    first_word, first_piece = len(SPECIALS), len(SPECIALS) + len(WORDS)
    out = []
    for _ in range(words):
        out.append(first_word + int(rng.integers(len(WORDS))))
        out += [first_piece + int(p) for p in rng.integers(len(PIECES), size=int(rng.choice(3, p=[0.6, 0.3, 0.1])))]
    return out


def write_corpus(prefix, vocab, documents: int, seed: int, sentences=(2, 10), words=(3, 14), extra_docs=()):
    """A megatron-core indexed dataset of random documents; returns the documents (lists of sentences)."""
    rng = np.random.default_rng(seed)
    docs = [[_sentence(rng, vocab, int(rng.integers(*words))) for _ in range(int(rng.integers(*sentences)))]
            for _ in range(documents)]
    docs += [list(d) for d in extra_docs]
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=DType.optimal_dtype(vocab.size))
    for doc in docs:
        for sentence in doc:
            builder.add_item(torch.tensor(sentence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return docs


def settings(**overrides) -> SampleSettings:
    base = dict(seq_length=64, segment_pairs="nsp", short_seq_prob=0.1, masked_lm_prob=0.15, max_predictions=20,
                whole_word_masking=True, max_ngram=1, dynamic_masking=False, seed=11)
    base.update(overrides)
    return SampleSettings(**base)


def make_dataset(prefixes, vocab, tmp_path, num_samples=4000, split="1,0,0", split_index=0, weights=None, **kw):
    corpora = [CorpusSpec(str(p), w) for p, w in zip(prefixes, weights or [1.0] * len(prefixes))]
    return build_split_dataset(corpora, split_index, split, num_samples, settings(**kw), vocab,
                               str(tmp_path / "cache"), True, None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, vocab):
    prefix = tmp_path_factory.mktemp("corpus") / "corpus_text_sentence"
    docs = write_corpus(prefix, vocab, 400, seed=1)
    return prefix, docs


def _samples(dataset, n):
    return [dataset[i] for i in range(n)]


def test_token_store_reads_megatron_files(corpus, vocab):
    prefix, docs = corpus
    store = TokenStore(str(prefix))
    assert store.num_documents == len(docs)
    s = 0
    for d, doc in enumerate(docs[:50]):
        assert store.document_bounds[d] == s
        for sentence in doc:
            assert store.span(s, s + 1).tolist() == sentence
            s += 1
    assert store.span(0, len(docs[0])).tolist() == sum(docs[0], [])


def test_masking_statistics(corpus, vocab, tmp_path):
    prefix, _ = corpus
    # max_predictions high enough that the 15% budget is never capped
    dataset = make_dataset([prefix], vocab, tmp_path, max_predictions=40)
    special = set(vocab.special_ids.tolist())
    candidates = predicted = masked = kept = 0
    cont = vocab.continuation_flags()
    for sample in _samples(dataset, 3000):
        n = int(sample["padding_mask"].sum())
        ids = sample["input_ids"][:n]
        k = int(sample["masked_weights"].sum())
        positions, labels = sample["masked_positions"][:k], sample["masked_labels"][:k]
        assert (positions > 0).all() and (positions < n).all() and len(set(positions.tolist())) == k
        assert not (set(labels.tolist()) & special), "a special token was chosen for prediction"
        original = ids.copy()
        original[positions] = labels
        assert original[0] == vocab.cls_id and original[n - 1] == vocab.sep_id
        candidates += sum(t not in special for t in original.tolist())
        predicted += k
        masked += int((ids[positions] == vocab.mask_id).sum())
        kept += int((ids[positions] == labels).sum())
        # whole words: a predicted position's neighbours in the same word are predicted too
        chosen = np.zeros(n, dtype=bool)
        chosen[positions] = True
        for p in range(1, n - 1):
            if cont[original[p]] and original[p - 1] not in special:
                assert chosen[p] == chosen[p - 1], "a word was masked partly"
        assert (sample["input_ids"][n:] == vocab.pad_id).all()
    assert abs(predicted / candidates - 0.15) < 0.01
    assert abs(masked / predicted - 0.8) < 0.02
    # unchanged: 10%, plus the rare random replacement that drew the original token
    assert abs(kept / predicted - 0.1) < 0.02
    assert abs((predicted - masked - kept) / predicted - 0.1) < 0.02


def test_masking_without_whole_words_masks_lone_pieces():
    tokens = np.array([3] + list(range(10, 60)) + [4])
    candidate = np.ones(tokens.size, dtype=bool)
    candidate[[0, -1]] = False
    continuation = np.zeros(tokens.size, dtype=bool)
    continuation[2::2] = True
    cfg = MaskingConfig(0.15, 20, False, 1, 5, np.arange(10, 60))
    lone = 0
    for seed in range(200):
        _, positions, _ = mask_tokens(tokens, candidate, continuation, np.random.default_rng(seed), cfg)
        chosen = set(positions.tolist())
        lone += sum(1 for p in chosen if continuation[p] and p - 1 not in chosen)
    assert lone > 0
    whole = MaskingConfig(0.15, 20, True, 1, 5, np.arange(10, 60))
    for seed in range(200):
        _, positions, _ = mask_tokens(tokens, candidate, continuation, np.random.default_rng(seed), whole)
        chosen = set(positions.tolist())
        assert all(p - 1 in chosen for p in chosen if continuation[p])


def test_ngram_masking_makes_spans_within_budget():
    tokens = np.array([3] + list(range(10, 110)) + [4])
    candidate = np.ones(tokens.size, dtype=bool)
    candidate[[0, -1]] = False
    cfg = MaskingConfig(0.15, 20, False, 3, 5, np.arange(10, 110))
    runs = []
    for seed in range(300):
        _, positions, _ = mask_tokens(tokens, candidate, np.zeros(tokens.size, bool), np.random.default_rng(seed), cfg)
        assert positions.size <= 15
        breaks = np.flatnonzero(np.diff(positions) != 1)
        runs += np.diff(np.concatenate([[-1], breaks, [positions.size - 1]])).tolist()
    assert max(runs) >= 3 and np.mean(runs) > 1.3


def _doc_of(bounds, sentence):
    return int(np.searchsorted(bounds, sentence, side="right")) - 1


def test_nsp_pairs(corpus, vocab):
    prefix, docs = corpus
    store = TokenStore(str(prefix))
    table, counts = build_segments(store.lengths, store.document_bounds, 0, len(docs),
                                   SegmentSettings("nsp", 64, 0.1, 3))
    labels = table[:, 4]
    assert abs(labels.mean() - 0.5) < 0.05
    for a0, a1, b0, b1, label in table:
        assert a0 < a1 and b0 < b1
        doc_a = _doc_of(store.document_bounds, a0)
        assert _doc_of(store.document_bounds, a1 - 1) == doc_a
        if label == 0:
            assert b0 == a1 and _doc_of(store.document_bounds, b1 - 1) == doc_a
        else:
            assert _doc_of(store.document_bounds, b0) != doc_a
    # every sentence appears in some segment A or actual-next B (random-next leftovers are put back)
    used = np.zeros(len(store.lengths), dtype=bool)
    for a0, a1, b0, b1, label in table:
        used[a0:a1] = True
        if label == 0:
            used[b0:b1] = True
    assert used.all() and counts["dropped_single_sentence_tails"] == 0
    assert counts["samples"] == len(table) and counts["random_next"] == int(labels.sum())


def test_sop_pairs(corpus, vocab):
    prefix, docs = corpus
    store = TokenStore(str(prefix))
    table, _ = build_segments(store.lengths, store.document_bounds, 0, len(docs), SegmentSettings("sop", 64, 0.1, 3))
    assert abs(table[:, 4].mean() - 0.5) < 0.05
    for a0, a1, b0, b1, label in table:
        assert (b0 == a1) if label == 0 else (a0 == b1)
        assert _doc_of(store.document_bounds, min(a0, b0)) == _doc_of(store.document_bounds, max(a1, b1) - 1)


def test_samples_fit_and_short_sequences_occur(corpus, vocab, tmp_path):
    prefix, _ = corpus
    dataset = make_dataset([prefix], vocab, tmp_path, num_samples=2000)
    lengths = np.array([int(dataset[i]["padding_mask"].sum()) for i in range(2000)])
    assert lengths.max() <= 64
    assert (lengths < 32).mean() > 0.05  # short_seq_prob 0.1 plus document ends
    none = make_dataset([prefix], vocab, tmp_path, num_samples=200, segment_pairs="none")
    for i in range(200):
        s = none[i]
        assert s["token_type_ids"].sum() == 0 and s["nsp_label"] == 0
        assert (s["input_ids"] == vocab.sep_id).sum() + (s["masked_labels"] == vocab.sep_id).sum() == 1


@pytest.mark.slow
def test_same_samples_across_runs_workers_and_layouts(corpus, vocab, tmp_path):
    prefix, _ = corpus
    first = make_dataset([prefix], vocab, tmp_path, num_samples=512)
    again = make_dataset([prefix], vocab, tmp_path / "fresh", num_samples=512)  # rebuilt, not cached
    for i in (0, 1, 77, 511):
        for key, value in first[i].items():
            assert np.array_equal(value, again[i][key]), key
    micro = 4

    def global_batches(dp, workers, consumed=0, steps=6):
        its = [MicroBatchIterator(first, consumed, micro, r, dp, torch.device("cpu"), num_workers=workers)
               for r in range(dp)]
        return [torch.cat([next(it)[0][0] for it in its]) for _ in range(steps * 4 // dp)]

    reference = torch.cat(global_batches(1, 0))
    assert torch.equal(torch.cat(global_batches(2, 0)), reference)
    assert torch.equal(torch.cat(global_batches(4, 2)), reference)
    # resuming at consumed samples continues the same sequence
    assert torch.equal(torch.cat(global_batches(2, 0, consumed=8, steps=5)), reference[8:88])


def test_dataset_pickles_as_file_references(corpus, vocab, tmp_path):
    """What a loader process receives: file names and settings, the token store, segment table and
    blend mapped again on arrival, never copied into the pickle."""
    import pickle

    prefix, _ = corpus
    other = tmp_path / "second"
    write_corpus(other, vocab, 50, seed=2)
    blended = make_dataset([prefix, other], vocab, tmp_path, num_samples=3000, weights=[0.7, 0.3])
    data = pickle.dumps(blended)
    arrays = sum(a.nbytes for a in (blended.blend, *(s.table for s in blended.splits),
                                    *(s.store.lengths for s in blended.splits)))
    assert len(data) < 10_000 < arrays, (len(data), arrays)  # the vocabulary and settings only
    copy = pickle.loads(data)
    assert isinstance(copy.blend, np.memmap) and isinstance(copy.splits[0].table, np.memmap)
    for i in (0, 5, 1234, 2999):
        for key, value in blended[i].items():
            assert np.array_equal(value, copy[i][key]), (i, key)


def test_epochs_reorder_and_dynamic_masking_redraws(corpus, vocab, tmp_path):
    prefix, _ = corpus
    static = make_dataset([prefix], vocab, tmp_path, num_samples=10**6)
    n = len(static.splits[0])
    rows = [static.splits[0].locate(k)[1] for k in range(n)]
    assert sorted(rows) == list(range(n)), "an epoch visits every segment once"
    assert rows != [static.splits[0].locate(n + k)[1] for k in range(n)], "epoch 2 has its own order"
    dynamic = make_dataset([prefix], vocab, tmp_path, num_samples=10**6, dynamic_masking=True)
    split = dynamic.splits[0]
    row = 5
    assert np.array_equal(static.build_sample(split, row, 0)["input_ids"], static.build_sample(split, row, 3)["input_ids"])
    differs = [not np.array_equal(dynamic.build_sample(split, r, 0)["masked_positions"],
                                  dynamic.build_sample(split, r, 1)["masked_positions"]) for r in range(20)]
    assert sum(differs) >= 15


def test_blending_follows_weights(corpus, vocab, tmp_path):
    prefix, _ = corpus
    other = tmp_path / "other_text_sentence"
    write_corpus(other, vocab, 100, seed=2)
    dataset = make_dataset([prefix, other], vocab, tmp_path, num_samples=4000, weights=[3.0, 1.0])
    share = (dataset.blend["corpus"] == 0).mean()
    assert abs(share - 0.75) < 0.01
    for prefix_len in (40, 400):
        assert abs((dataset.blend["corpus"][:prefix_len] == 0).mean() - 0.75) < 0.05
    dataset[3999]


def test_split_ranges_follow_megatron():
    assert split_document_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert split_document_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(DataError, match="data.split"):
        split_document_ranges(10, "a,b")


def test_feistel_is_a_permutation():
    for n in (1, 2, 3, 17, 1000, 4097):
        perm = FeistelPermutation(n, key=42)
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    assert [FeistelPermutation(1000, 1)(i) for i in range(10)] != [FeistelPermutation(1000, 2)(i) for i in range(10)]


# ------------------------------------------------------------------------------------------ bad input


def test_single_sentence_documents_are_skipped_and_counted(tmp_path, vocab):
    prefix = tmp_path / "mixed"
    write_corpus(prefix, vocab, 30, seed=4, extra_docs=[[[10, 11, 12]]] * 5 + [[]] * 2)
    store = TokenStore(str(prefix))
    _, counts = build_segments(store.lengths, store.document_bounds, 0, store.num_documents,
                               SegmentSettings("nsp", 64, 0.1, 1))
    assert counts["skipped_single_sentence_documents"] == 5 and counts["skipped_empty_documents"] == 2
    _, counts = build_segments(store.lengths, store.document_bounds, 0, store.num_documents,
                               SegmentSettings("none", 64, 0.1, 1))
    assert counts["skipped_single_sentence_documents"] == 0 and counts["documents_used"] == 35


def test_nsp_without_two_usable_documents_is_a_clear_error(tmp_path, vocab):
    prefix = tmp_path / "lonely"
    write_corpus(prefix, vocab, 0, seed=5, extra_docs=[[[10, 11], [12, 13]], [[14]]])
    with pytest.raises(DataError, match="lonely.*at least 2 usable documents"):
        make_dataset([prefix], vocab, tmp_path)


def test_long_sentences_are_truncated(tmp_path, vocab):
    prefix = tmp_path / "long"
    write_corpus(prefix, vocab, 20, seed=6, words=(60, 90))
    dataset = make_dataset([prefix], vocab, tmp_path, num_samples=100)
    assert dataset.splits[0].counts["sentences_longer_than_sequence"] > 0
    for i in range(100):
        s = dataset[i]
        # every sentence is longer than the sequence: each pair is trimmed to exactly fill it
        assert s["padding_mask"].sum() == 64 and s["input_ids"][63] == vocab.sep_id
        assert 0 < s["token_type_ids"].sum() < 62


def test_vocab_errors_name_the_file(tmp_path):
    bad = tmp_path / "vocab.txt"
    bad.write_text("[PAD]\n[UNK]\n[CLS]\nhello\n")
    with pytest.raises(VocabError, match=r"vocab.txt.*\[SEP\], \[MASK\]"):
        WordPieceVocab.from_file(bad)
    with pytest.raises(VocabError, match="does not exist"):
        WordPieceVocab.from_file(tmp_path / "missing.txt")
    tokenizer_json = tmp_path / "tokenizer.json"
    bert_wordpiece_tokenizer({t: i for i, t in enumerate(SPECIALS + WORDS)}, lowercase=True).save(str(tokenizer_json))
    from_json = WordPieceVocab.from_file(tokenizer_json)
    assert from_json.mask_id == 5 and from_json.size == len(SPECIALS + WORDS)


def test_data_from_another_vocabulary_is_refused(corpus, tmp_path):
    prefix, _ = corpus
    small = tmp_path / "small.txt"
    small.write_text("\n".join(SPECIALS + WORDS[:20]) + "\n")
    with pytest.raises(DataError, match=r"corpus_text_sentence.bin: token id \d+ is outside the vocabulary of 26"):
        make_dataset([prefix], WordPieceVocab.from_file(small), tmp_path)


def test_index_is_built_once_and_keyed_by_its_inputs(corpus, vocab, tmp_path, library_log):
    prefix, _ = corpus
    logged = library_log

    def build(**kw):
        corpora = [CorpusSpec(str(prefix), 1.0)]
        return build_split_dataset(corpora, 0, "1,0,0", 100, settings(**kw), vocab, str(tmp_path / "cache"), True,
                                   None)

    first = build()
    # said before it runs (a large corpus takes minutes), and after
    assert len(logged) == 2 and "building index" in logged[0] and "built index" in logged[1], logged
    again = build()
    assert len(logged) == 2, "the second build must come from the cache"
    assert np.array_equal(first.splits[0].table, again.splits[0].table)
    build(short_seq_prob=0.3)
    assert len(logged) == 4, "another setting is another index"
    assert len(list((tmp_path / "cache").glob("segments-*.npy"))) == 2
    assert not list((tmp_path / "cache").glob("*.tmp-*"))


class FailingDataset(torch.utils.data.Dataset):
    """Synthetic samples, except that sample `bad` raises (what a corrupt record does)."""

    description = "a test corpus"

    def __init__(self, bad: int):
        from pretrain.data.samples.synthetic import SyntheticDataset

        self.inner, self.bad = SyntheticDataset(200, 32, 5, 1000, seed=1), bad

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"record {index} is corrupt")
        return self.inner[index]


@pytest.mark.slow
def test_loader_process_that_raises_or_dies_names_the_samples():
    from pretrain.data.samples.batches import LoaderError

    raising = MicroBatchIterator(FailingDataset(bad=9), 0, 2, 0, 1, torch.device("cpu"), num_workers=2)
    for _ in range(4):
        next(raising)  # samples 0..7
    with pytest.raises(LoaderError, match=r"(?s)samples 8\.\.9 of a test corpus \(micro-batch 4 from sample 0\): "
                                          r"ValueError: .*record 9 is corrupt"):
        next(raising)
    raising.close()
    dying = MicroBatchIterator(FailingDataset(bad=-1), 0, 2, 0, 1, torch.device("cpu"), num_workers=1,
                               prefetch_factor=1)
    next(dying)
    os.kill(dying.worker_pids()[0], signal.SIGKILL)
    with pytest.raises(LoaderError, match=r"(?s)loader failed building samples \d+\.\.\d+ of a test corpus .*exited "
                                          r"unexpectedly"):
        for _ in range(10):
            next(dying)
    dying.close()


def _masking_shares(dataset, n, special, mask_id):
    """(predicted / candidate tokens, [MASK] / predicted, random / predicted) over n samples."""
    candidates = predicted = masked = kept = 0
    for i in range(n):
        sample = dataset[i]
        k = int(sample["masked_weights"].sum())
        ids = sample["input_ids"][:int(sample["padding_mask"].sum())]
        positions, labels = sample["masked_positions"][:k], sample["masked_labels"][:k]
        original = ids.copy()
        original[positions] = labels
        candidates += int((~np.isin(original, special)).sum())
        predicted += k
        masked += int((ids[positions] == mask_id).sum())
        kept += int((ids[positions] == labels).sum())
    return predicted / candidates, masked / predicted, (predicted - masked - kept) / predicted


def test_training_and_evaluation_mask_at_their_own_rates_and_shares(corpus, vocab_file, vocab, tmp_path):
    """data.masked_lm_prob 30% for training, data.eval_masked_lm_prob 15% for evaluation, a 70/20/10
    split, the masked-position budget following the higher rate: measured on 10,000 samples each."""
    from pretrain.config import Config
    from pretrain.data.samples.provider import pretraining_datasets

    prefix, _ = corpus
    cfg = Config.from_dict({
        "data": {"kind": "indexed", "paths": [str(prefix)], "vocab_file": str(vocab_file), "split": "80,20,0",
                 "seq_length": 64, "masked_lm_prob": 0.3, "eval_masked_lm_prob": 0.15, "mask_token_share": 0.7,
                 "random_token_share": 0.2, "index_cache_dir": str(tmp_path / "cache")},
        "model": {"vocab_size": vocab.size}, "train": {"global_batch_size": 100, "train_steps": 100},
        "eval": {"steps": 100}})
    assert cfg.data.max_predictions() == 20  # ceil(0.3 x 64)
    train, valid, _ = pretraining_datasets(cfg, True, None)
    special = vocab.special_ids
    rate, masked, random = _masking_shares(train, 10_000, special, vocab.mask_id)
    assert abs(rate - 0.30) < 0.005 and abs(masked - 0.7) < 0.01 and abs(random - 0.2) < 0.01, (rate, masked, random)
    rate, masked, random = _masking_shares(valid, 10_000, special, vocab.mask_id)
    assert abs(rate - 0.15) < 0.005 and abs(masked - 0.7) < 0.01 and abs(random - 0.2) < 0.01, (rate, masked, random)
    assert valid[0]["masked_positions"].shape == train[0]["masked_positions"].shape == (20,)


HANG_UP = """
import functools, multiprocessing.resource_sharer as sharer, os, socket, sys, time
from pretrain.data.samples.batches import quiet_when_the_rank_hangs_up
if sys.argv[1] == "loader":  # what a loader process installs (batches._loader_process_init)
    sys.excepthook = functools.partial(quiet_when_the_rank_hangs_up, sys.excepthook)
sharer.DupFd(os.pipe()[0])  # the sharer's thread starts, as at a loader process's first batch
client = socket.socket(socket.AF_UNIX)
client.connect(sharer._resource_sharer._address)
client.close()  # the rank, interrupted in the handshake for the batch's file descriptors
time.sleep(0.5)
raise ValueError("anything else is still reported")
"""


@pytest.mark.slow
@pytest.mark.parametrize("process", ["plain", "loader"])
def test_a_rank_hanging_up_on_a_loader_process_prints_no_traceback(process):
    """A Ctrl-C reaching a rank while it takes a batch's file descriptors from a loader process left
    multiprocessing's resource sharer thread there a closed connection, whose traceback landed in
    the job's output (seen in tests/test_signals.py's Ctrl-C test under load)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HANG_UP, process], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "ValueError: anything else is still reported" in done.stderr
    tracebacks = done.stderr.count("Traceback")
    assert tracebacks == (2 if process == "plain" else 1), done.stderr  # the plain process shows the scenario
    assert ("resource_sharer.py" in done.stderr) == (process == "plain"), done.stderr
