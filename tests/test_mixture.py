"""Blends of corpora by samples, by tokens and by temperature (pretrain/data/samples/mixture.py),
measured on the samples the dataset builds: three corpora of short, middling and long samples,
10,000 samples each run, each sample's real tokens counted from its padding mask."""
import numpy as np
import pytest

from pretrain.config import ConfigError, load_config
from pretrain.data.preprocess.indexed import DataError
from pretrain.data.samples.bert_dataset import CorpusSpec, build_split_dataset
from pretrain.data.samples.mixture import MixtureSettings
from pretrain.data.samples.token_ids import WordPieceVocab
from test_bert_dataset import PIECES, SPECIALS, WORDS, settings, write_corpus

pytestmark = pytest.mark.slow  # 10,000 samples built per blend
SAMPLES = 10_000
# (documents, words per sentence): samples of about 14, 30 and 60 real tokens (rows of 64)
CORPORA = {"short": (300, (2, 4)), "middling": (200, (6, 10)), "long": (150, (18, 30))}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixture")
    (out / "vocab.txt").write_text("\n".join(SPECIALS + WORDS + PIECES) + "\n")
    vocab = WordPieceVocab.from_file(out / "vocab.txt")
    prefixes = []
    for seed, (name, (documents, words)) in enumerate(CORPORA.items()):
        prefix = out / f"{name}_text_sentence"
        write_corpus(prefix, vocab, documents, seed=seed, sentences=(1, 3), words=words)
        prefixes.append(str(prefix))
    return prefixes, vocab, out


def build(corpora, weights, mixture, num_samples=SAMPLES, report=None):
    prefixes, vocab, out = corpora
    specs = [CorpusSpec(p, w) for p, w in zip(prefixes, weights)]
    return build_split_dataset(specs, 0, "1,0,0", num_samples, settings(segment_pairs="none", short_seq_prob=0.0),
                               vocab, str(out / "cache"), True, None, mixture=mixture, report=report)


def measured(dataset) -> tuple[np.ndarray, np.ndarray]:
    """(sample shares, token shares) per corpus, from the samples themselves."""
    corpus = dataset.blend["corpus"][:len(dataset)]
    tokens = np.array([dataset[i]["padding_mask"].sum() for i in range(len(dataset))])
    samples = np.bincount(corpus, minlength=3) / corpus.size
    per_corpus = np.bincount(corpus, weights=tokens, minlength=3)
    return samples, per_corpus / per_corpus.sum()


@pytest.fixture(scope="module")
def corpus_tokens(corpora):
    """Each corpus's tokens over one epoch of its samples: every sample of a one-corpus dataset."""
    prefixes, vocab, out = corpora
    totals = []
    for prefix in prefixes:
        one = build_split_dataset([CorpusSpec(prefix, 1.0)], 0, "1,0,0", 1, settings(segment_pairs="none",
                                  short_seq_prob=0.0), vocab, str(out / "cache"), True, None)
        size = len(one.splits[0].table)
        totals.append(sum(int(one.build_sample(one.splits[0], row, 0)["padding_mask"].sum())
                          for row in range(size)))
    return np.array(totals, dtype=np.float64)


def test_shares_by_samples_and_by_tokens_are_what_was_asked(corpora):
    weights = [0.2, 0.3, 0.5]
    lines = []
    by_samples = build(corpora, weights, MixtureSettings("samples"))
    samples, tokens = measured(by_samples)
    assert samples == pytest.approx(weights, abs=0.01)
    assert tokens[2] > 0.6  # by samples, the long corpus takes far more than half the tokens
    by_tokens = build(corpora, weights, MixtureSettings("tokens"), report=lines.append)
    samples, tokens = measured(by_tokens)
    assert tokens == pytest.approx(weights, abs=0.01)
    assert samples[0] > 0.35  # by tokens, the short corpus needs the most samples
    # the start-up report: asked and achieved (the blend's own measurement), and the epochs read
    report = lines[0].splitlines()
    assert report[0] == "data mixture (data.weights as tokens): token shares asked and achieved on the first " \
                        "10,000 samples"
    for line, name, share, got in zip(report[1:], CORPORA, weights, tokens):
        assert line.startswith(f"  {name}_text_sentence: ") and f"(asked {share:.1%})" in line, line
        reported = float(line.split(": ")[1].split("%")[0]) / 100
        assert reported == pytest.approx(got, abs=0.002), line


def test_temperature_shares_follow_the_formula(corpora, corpus_tokens):
    """tokens_i ^ alpha / sum_j tokens_j ^ alpha, alpha = 1 / T; T = 1 is proportional to size."""
    for alpha in (0.3, 1.0):
        dataset = build(corpora, [1.0] * 3, MixtureSettings(alpha=alpha))
        _, tokens = measured(dataset)
        expected = corpus_tokens ** alpha / (corpus_tokens ** alpha).sum()
        assert tokens == pytest.approx(expected, abs=0.01), alpha
    # alpha 0.3 flattens the shares towards uniform (mmBERT's last phase)
    flat = corpus_tokens ** 0.3 / (corpus_tokens ** 0.3).sum()
    assert flat.max() / flat.min() < (corpus_tokens.max() / corpus_tokens.min()) ** 0.5


def test_a_corpus_read_too_often_is_named(corpora):
    """The small corpora are read many times over: the one above the limit is named, alone."""
    with pytest.raises(DataError, match=r"the train blend reads long_text_sentence \(106.67 epochs\), more than "
                                        r"data.max_epochs \(50\): lower"):
        build(corpora, [0.1, 0.1, 0.8], MixtureSettings("samples", max_epochs=50.0), num_samples=20_000)


def test_mixture_settings_are_checked_and_define_the_sample_sequence(tmp_path):
    from pretrain.checkpoint.data_sequence import SEQUENCE_KEYS

    base = ["data.kind=indexed", "data.paths=[a,b]", "data.vocab_file=v.txt"]
    for extra, message in ((["data.weights_unit=bytes"], "data.weights_unit ('bytes') must be samples or tokens"),
                           (["data.sampling_temperature=2", "data.sampling_alpha=0.5"], "say the same"),
                           (["data.sampling_alpha=0.5", "data.weights=[1,2]"], "leave data.weights unset"),
                           (["data.sampling_temperature=0"], "data.sampling_temperature (0")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config("configs/bert-tiny.yaml", base + extra).validate()
    cfg = load_config("configs/bert-tiny.yaml", base + ["data.sampling_temperature=2"])
    assert cfg.data.sampling_exponent() == 0.5
    assert {"weights_unit", "sampling_temperature", "sampling_alpha"} <= set(SEQUENCE_KEYS)


def test_the_epochs_counted_without_a_scan_are_the_blends_own(corpora):
    """epochs_read from the weights equals the blend index's own counts (within one sample)."""
    from pretrain.data.samples.mixture import epochs_read, sample_tokens, sample_weights
    from pretrain.data.samples.segments import SegmentSettings

    dataset = build(corpora, [0.2, 0.3, 0.5], MixtureSettings("tokens"))
    max_tokens = SegmentSettings("none", 64, 0.0, 0).max_num_tokens
    tokens = [sample_tokens(s.table, s.store.lengths, max_tokens, False) for s in dataset.splits]
    sizes = [len(s.table) for s in dataset.splits]
    counted = np.bincount(dataset.blend["corpus"].astype(np.int64), minlength=3)
    for read, count, size in zip(epochs_read(sample_weights([0.2, 0.3, 0.5], tokens, MixtureSettings("tokens")),
                                             SAMPLES, sizes), counted, sizes):
        assert abs(read * size - count) <= 1, (read * size, count)


def test_a_report_of_many_corpora_names_the_largest_and_the_most_repeated():
    from pretrain.data.samples.mixture import SHOWN_CORPORA, describe

    n = SHOWN_CORPORA + 10
    names = [f"lang{i}" for i in range(n)]
    asked = [(i + 1) / sum(range(1, n + 1)) for i in range(n)]  # lang{n-1} largest
    epochs = [1.0] * n
    epochs[3] = 7.5  # a small corpus read most often
    lines = describe(names, asked, asked, epochs, 1000, "alpha 0.3").splitlines()
    assert len(lines) == 1 + SHOWN_CORPORA + 2
    assert lines[1].startswith(f"  lang{n - 1}: ") and lines[SHOWN_CORPORA].startswith("  lang10: ")
    assert lines[-2] == f"  ... 10 smaller corpora, {sum(asked[:10]):.1%} of the tokens asked; the one of them read " \
                        "most often:"
    assert lines[-1].startswith("  lang3: ") and "7.50 epochs" in lines[-1]
