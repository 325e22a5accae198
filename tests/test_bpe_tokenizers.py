"""Tokenizers beyond WordPiece through the data layer: a byte-level BPE from
`tools/build_vocab.py --model bpe`, a RoBERTa-style one (<s> <pad> </s> <unk> at 0-3, <mask>
last) and a ModernBERT-style one (GPT-NeoX's <|endoftext|> <|padding|> first, [UNK] [CLS] [SEP]
[PAD] [MASK] after the learnt entries), all built here with `tokenizers` (nothing downloads).

What it shows: the special tokens are read by role from each tokenizer (its tokenizer_config.json,
its post-processor, its registered special tokens), never assumed; a tokenizer without a mask or
cls/sep token is refused naming the file and the role; preprocessing writes what megatron-core's
IndexedDataset reads, in the dtype the vocabulary size asks for; samples carry the tokenizer's
cls/sep/pad ids, never predict or draw a special token, and mask whole words along 'Ġ' (a sentence's
first word, which has no 'Ġ', starts a word); a checkpoint carries a BPE tokenizer.json without a
vocab.txt.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import blingfire
import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from _preprocess_helpers import documents, write_jsonl
from pretrain.data.preprocess.dataset_record import dataset_problems
from pretrain.data.preprocess.pipeline import PreprocessOptions, preprocess
from pretrain.data.preprocess.special_tokens import WordBoundaries, word_boundaries
from pretrain.data.preprocess.tokenizer import TokenizerError, load_tokenizer, read_special_tokens
from pretrain.data.samples.bert_dataset import CorpusSpec, SampleSettings, build_split_dataset
from pretrain.data.samples.token_ids import Vocabulary

REPO = Path(__file__).resolve().parent.parent
SPECIAL_ROLES = ("pad", "unk", "cls", "sep", "mask")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _texts() -> list[str]:
    return documents(300, seed=7)


def _byte_level_bpe(texts, vocab_size: int, special_tokens=()) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(special_tokens), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    write_jsonl(str(root / "corpus.jsonl"), _texts())
    return root


@pytest.fixture(scope="module")
def built(root) -> Path:
    """tools/build_vocab.py --model bpe: ModernBERT's layout, 512 entries exactly."""
    out = root / "built"
    assert _tool("build_vocab").main(["--input", str(root / "corpus.jsonl"), "--output-dir", str(out),
                                      "--model", "bpe", "--vocab-size", "512"]) in (0, None)
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def roberta(root) -> Path:
    """RoBERTa's layout: <s>=0 <pad>=1 </s>=2 <unk>=3, the learnt entries, <mask> last; a
    RobertaProcessing post-processor; no tokenizer_config.json."""
    tokenizer = _byte_level_bpe(_texts(), 400, ["<s>", "<pad>", "</s>", "<unk>"])
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    (root / "roberta").mkdir()
    tokenizer.save(str(root / "roberta" / "tokenizer.json"))
    return root / "roberta" / "tokenizer.json"


@pytest.fixture(scope="module")
def modernbert(root) -> Path:
    """ModernBERT's layout on a small base vocabulary: <|endoftext|>=0 <|padding|>=1 (GPT-NeoX's),
    the learnt entries, then [UNK] [CLS] [SEP] [PAD] [MASK] and [unused0-2]; a TemplateProcessing
    "[CLS]:0 $A:0 [SEP]:0"; the roles also named by a tokenizer_config.json."""
    tokenizer = _byte_level_bpe(_texts(), 350, ["<|endoftext|>", "<|padding|>"])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=t == "[MASK]")
                                  for t in ("[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]")])
    tokenizer.add_special_tokens([AddedToken(f"[unused{i}]", special=True) for i in range(3)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:0 [SEP]:0",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    (root / "modernbert").mkdir()
    tokenizer.save(str(root / "modernbert" / "tokenizer.json"))
    (root / "modernbert" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
         "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": {"content": "[MASK]", "lstrip": True}}))
    return root / "modernbert" / "tokenizer.json"


EXPECTED = {  # role -> token text; the ids are looked up in each tokenizer, never written here
    "built": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "roberta": {"pad": "<pad>", "unk": "<unk>", "cls": "<s>", "sep": "</s>", "mask": "<mask>"},
    "modernbert": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
}
KINDS = tuple(EXPECTED)


@pytest.fixture(scope="module")
def tokenizers_by_kind(built, roberta, modernbert) -> dict[str, Path]:
    return {"built": built, "roberta": roberta, "modernbert": modernbert}


# --------------------------------------------------------------------------------------------
# The tokenizer: build_vocab --model bpe, roles read, refusals
# --------------------------------------------------------------------------------------------


def test_build_vocab_bpe_writes_a_modernbert_style_tokenizer(built):
    out = built.parent
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]  # no vocab.txt: BPE has none
    tokenizer = Tokenizer.from_file(str(built))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 512  # exactly the size asked for
    config = json.loads(built.read_text())
    assert config["model"]["type"] == "BPE" and config["pre_tokenizer"]["type"] == "ByteLevel"
    specials = [t for t in config["added_tokens"] if t["special"]]
    # ModernBERT's order after the learnt entries, then [unused*] up to the size asked for
    assert [t["content"] for t in specials[:5]] == ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    first = specials[0]["id"]
    assert [t["id"] for t in specials] == list(range(first, 512)) and first > 256
    assert all(t["content"].startswith("[unused") for t in specials[5:])
    encoding = tokenizer.encode("The cat sat.", "It is [MASK].")
    assert encoding.tokens[0] == "[CLS]" and encoding.tokens.count("[SEP]") == 2
    before_mask = encoding.ids.index(tokenizer.token_to_id("[MASK]")) - 1
    assert encoding.tokens[before_mask] != "Ġ"  # [MASK] takes the space before it, as ModernBERT's does
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == "[MASK]"


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_read_from_the_tokenizer(tokenizers_by_kind, kind):
    path = tokenizers_by_kind[kind]
    raw = Tokenizer.from_file(str(path))
    info = load_tokenizer(tokenizer_json=str(path))
    specials = info.specials
    for role in SPECIAL_ROLES:
        assert specials.token(role) == EXPECTED[kind][role]
        assert specials.ids[role] == raw.token_to_id(EXPECTED[kind][role]), role
    assert (specials.pad_id, specials.cls_id, specials.sep_id, specials.mask_id) == tuple(
        raw.token_to_id(EXPECTED[kind][r]) for r in ("pad", "cls", "sep", "mask"))
    if kind == "roberta":
        assert (specials.cls_id, specials.pad_id, specials.sep_id, specials.unk_id) == (0, 1, 2, 3)
        assert specials.mask_id == raw.get_vocab_size() - 1
    # every added special token is a control token, and no learnt piece is
    added = {t["id"] for t in json.loads(path.read_text())["added_tokens"] if t["special"]}
    assert set(specials.control_ids) == added
    assert info.words == WordBoundaries("marker", info.words.markers) and "Ġ" in info.words.markers
    assert read_special_tokens(str(path)) == specials


def test_word_boundaries_follow_the_model_and_pre_tokenizer():
    wordpiece = word_boundaries({"model": {"type": "WordPiece", "continuing_subword_prefix": "##"}})
    metaspace = word_boundaries({"model": {"type": "Unigram"},
                                 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                                     {"type": "WhitespaceSplit"}, {"type": "Metaspace", "replacement": "▁"}]}})
    byte_level = word_boundaries({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}})
    plain = word_boundaries({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}})
    tokens = ["[CLS]", "hello", "##lo", "▁wor", "ld", "Ġwor", "Ċx", ""]
    flags = {name: rule.continuation_flags(tokens, [0]).tolist()
             for name, rule in [("wp", wordpiece), ("ms", metaspace), ("bl", byte_level), ("none", plain)]}
    assert flags["wp"] == [False, False, True, False, False, False, False, False]
    assert flags["ms"] == [False, True, True, False, True, True, True, False]
    assert flags["bl"] == [False, True, True, True, True, False, False, False]
    assert flags["none"] == [False] * len(tokens)


def _renamed(path: Path, out: Path, names: dict[str, str], roberta_ids: dict[str, int] | None = None) -> Path:
    """The tokenizer at `path` alone in `out`, its tokens renamed everywhere (vocabulary, added
    tokens, post-processor), a RobertaProcessing's ids replaced by `roberta_ids`."""
    text = path.read_text()
    for old, new in names.items():
        text = text.replace(json.dumps(old), json.dumps(new))
    config = json.loads(text)
    for role, i in (roberta_ids or {}).items():
        config["post_processor"][role][1] = i
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(config))
    return out / "tokenizer.json"


def test_cls_and_sep_come_from_the_post_processor(roberta, built, tmp_path):
    """Tokens no convention names: only the post-processor (RobertaProcessing, TemplateProcessing)
    says which are cls and sep."""
    renamed = _renamed(roberta, tmp_path / "roberta", {"<s>": "<bos>", "</s>": "<eos>"})
    specials = read_special_tokens(str(renamed))
    assert (specials.token("cls"), specials.cls_id, specials.token("sep"), specials.sep_id) == ("<bos>", 0, "<eos>", 2)
    assert specials.found_by["cls"] == "the post-processor's template"
    # build_vocab's tokenizer without its tokenizer_config.json, [CLS]/[SEP] renamed
    renamed = _renamed(built, tmp_path / "built", {"[CLS]": "<start>", "[SEP]": "<end>"})
    raw = Tokenizer.from_file(str(renamed))
    specials = read_special_tokens(str(renamed))
    assert (specials.cls_id, specials.sep_id) == (raw.token_to_id("<start>"), raw.token_to_id("<end>"))
    assert raw.token_to_id("<start>") > 256 and specials.found_by["sep"] == "the post-processor's template"
    wrong = _renamed(roberta, tmp_path / "wrong-id", {}, roberta_ids={"cls": 5})
    with pytest.raises(TokenizerError, match=rf"{wrong}: the post-processor's template gives '<s>' \(cls\) id 5, "
                                             "its vocabulary id 0"):
        read_special_tokens(str(wrong))


def _without(path: Path, out: Path, drop: str, post_processor=True) -> Path:
    config = json.loads(path.read_text())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != drop]
    config["model"]["vocab"].pop(drop, None)
    if not post_processor:
        config["post_processor"] = None
    out.mkdir()
    (out / "tokenizer.json").write_text(json.dumps(config))
    return out / "tokenizer.json"


def test_a_tokenizer_without_a_mask_or_cls_is_refused(roberta, tmp_path):
    no_mask = _without(roberta, tmp_path / "no-mask", "<mask>")
    with pytest.raises(TokenizerError, match=rf"{no_mask}: the tokenizer has no mask token \(.*<mask>"):
        load_tokenizer(tokenizer_json=str(no_mask))
    with pytest.raises(TokenizerError, match="no mask token"):
        Vocabulary.from_file(no_mask)
    # the post-processor names cls/sep: without it (and with <s> unregistered) there is no cls
    no_cls = _without(roberta, tmp_path / "no-cls", "<s>", post_processor=False)
    with pytest.raises(TokenizerError, match=rf"{no_cls}: the tokenizer has no cls token \(.*post-processor"):
        load_tokenizer(tokenizer_json=str(no_cls))
    # a tokenizer_config.json naming a token the vocabulary lacks
    bad = tmp_path / "bad-config"
    bad.mkdir()
    (bad / "tokenizer.json").write_bytes(roberta.read_bytes())
    (bad / "tokenizer_config.json").write_text(json.dumps({"mask_token": "[MASK]"}))
    with pytest.raises(TokenizerError, match=r"its mask token '\[MASK\]' \(from tokenizer_config.json's mask_token\) "
                                             "is not in its vocabulary"):
        load_tokenizer(tokenizer_json=str(bad / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="--tokenizer-type BertWordPieceCase names a BERT WordPiece one"):
        load_tokenizer(tokenizer_json=str(roberta), tokenizer_type="BertWordPieceCase")


# --------------------------------------------------------------------------------------------
# Preprocessing
# --------------------------------------------------------------------------------------------


def _preprocess(root: Path, tokenizer_json: Path, name: str) -> str:
    prefix = root / "data" / name
    preprocess(PreprocessOptions(inputs=(str(root / "corpus.jsonl"),), output_prefix=str(prefix),
                                 tokenizer_json=str(tokenizer_json), split_sentences=True, workers=1,
                                 progress=False))
    return f"{prefix}_text_sentence"


@pytest.fixture(scope="module")
def datasets(root, tokenizers_by_kind) -> dict[str, str]:
    return {kind: _preprocess(root, path, kind) for kind, path in tokenizers_by_kind.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_preprocessing_writes_what_megatron_reads(tokenizers_by_kind, datasets, kind):
    tokenizer = Tokenizer.from_file(str(tokenizers_by_kind[kind]))
    expected = []
    for doc in _texts():
        sentences = [tokenizer.encode(s, add_special_tokens=False).ids
                     for s in blingfire.text_to_sentences(doc).split("\n") if s.strip()]
        expected.append([s for s in sentences if s])
    dataset = IndexedDataset(datasets[kind])
    assert dataset.index.dtype == np.uint16
    bounds = dataset.document_indices
    got = [[dataset[s].tolist() for s in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]
    assert got == [doc for doc in expected if doc]
    vocab = Vocabulary.from_file(tokenizers_by_kind[kind])
    record = json.loads(Path(datasets[kind] + ".fingerprint.json").read_text())
    assert record["vocabulary"]["size"] == vocab.size and record["token_counts"]["special"] == 0
    assert dataset_problems(datasets[kind], "data.paths", vocab.tokens, str(tokenizers_by_kind[kind]), False,
                            special_ids=vocab.special_ids, pad_id=vocab.pad_id) == []


@pytest.mark.slow
def test_a_vocabulary_past_65500_ids_writes_int32(root):
    out = root / "large"
    assert _tool("build_vocab").main(["--input", str(root / "corpus.jsonl"), "--output-dir", str(out),
                                      "--model", "bpe", "--vocab-size", "70000"]) in (0, None)
    prefix = _preprocess(root, out / "tokenizer.json", "large")
    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == np.int32 and len(dataset) > 0
    specials = read_special_tokens(str(out / "tokenizer.json"))
    assert specials.mask_id < 1000  # the specials follow the learnt entries; [unused*] fill the rest
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size(with_added_tokens=True) == 70000
    assert Vocabulary.from_file(out / "tokenizer.json").replacement_ids().max() < specials.unk_id


# --------------------------------------------------------------------------------------------
# Samples and masking
# --------------------------------------------------------------------------------------------


def _samples(prefix: str, vocab: Vocabulary, cache: Path, count: int = 400, **overrides):
    settings = dict(seq_length=128, segment_pairs="none", short_seq_prob=0.1, masked_lm_prob=0.15, max_predictions=20,
                    whole_word_masking=True, max_ngram=1, dynamic_masking=False, seed=5)
    settings.update(overrides)
    dataset = build_split_dataset([CorpusSpec(prefix, 1.0)], 0, "1,0,0", count, SampleSettings(**settings), vocab,
                                  str(cache), True, None)
    return dataset, [dataset[i] for i in range(count)]


def _sentence_starts(dataset, index: int) -> tuple[set[int], int]:
    """(positions in sample `index` of the first tokens of segment A's sentences, A's length
    before any truncation)."""
    split = dataset.splits[0]
    _, row = split.locate(index)
    a_begin, a_end = (int(v) for v in split.table[row][:2])
    lengths = split.store.lengths[a_begin:a_end]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) + 1
    return set(starts.tolist()), int(lengths.sum())


@pytest.mark.parametrize("kind", KINDS)
def test_samples_use_the_tokenizers_ids_and_mask_whole_words(tokenizers_by_kind, datasets, tmp_path, kind):
    vocab = Vocabulary.from_file(tokenizers_by_kind[kind])
    raw = Tokenizer.from_file(str(tokenizers_by_kind[kind]))
    ids = {role: raw.token_to_id(token) for role, token in EXPECTED[kind].items()}
    control = set(vocab.special_ids.tolist())
    assert {ids[r] for r in SPECIAL_ROLES} <= control
    dataset, samples = _samples(datasets[kind], vocab, tmp_path)
    predicted = with_mask = replaced = multi_token_units = unspaced_sentence_starts = checked = 0
    for index, sample in enumerate(samples):
        tokens, n = sample["input_ids"], int(sample["padding_mask"].sum())
        k = int(sample["masked_weights"].sum())
        positions, labels = sample["masked_positions"][:k], sample["masked_labels"][:k]
        original = tokens.copy()
        original[positions] = labels
        # [CLS] A [SEP] [PAD]... with the tokenizer's ids
        assert tokens[0] == ids["cls"] and original[n - 1] == ids["sep"]
        assert (tokens[n:] == ids["pad"]).all() and not np.isin(original[1:n - 1], list(control)).any()
        # never a special position predicted; a random replacement never a special token
        predicted += k  # (a short sample of long words may have none: a word never exceeds the budget)
        assert not set(labels.tolist()) & control
        assert not {0, n - 1} & set(positions.tolist())
        with_mask += int((tokens[positions] == ids["mask"]).sum())
        for p, label in zip(positions.tolist(), labels.tolist()):
            if tokens[p] not in (ids["mask"], label):
                replaced += 1
                assert tokens[p] not in control, (p, tokens[p])
        # whole words: a unit starts at a 'Ġ' token, a sentence start or after [CLS]
        starts, length = _sentence_starts(dataset, index)
        if length != n - 2:
            continue  # truncated: its sentence starts moved
        checked += 1
        chosen = set(positions.tolist())
        unit_start = [p in starts or vocab.tokens[original[p]].startswith("Ġ") for p in range(n)]
        unit = []
        for p in range(1, n):
            if p == n - 1 or unit_start[p]:
                if unit:
                    assert len({q in chosen for q in unit}) == 1, (index, unit, sorted(chosen))
                    multi_token_units += len(unit) > 1 and unit[0] in chosen
                unit = [p]
            else:
                unit.append(p)
        # a later sentence's first word (no 'Ġ' before it) was masked without the sentence before
        unspaced_sentence_starts += sum(1 for p in starts if p > 1 and p in chosen and p - 1 not in chosen
                                        and not vocab.tokens[original[p]].startswith("Ġ"))
    assert predicted > 0.1 * sum(int(s["padding_mask"].sum()) for s in samples)
    assert checked > len(samples) // 2  # most samples untruncated: the word check ran on them
    assert 0.75 < with_mask / predicted < 0.85 and 0 < replaced / predicted < 0.15  # 80% mask, 10% random
    assert multi_token_units > 0 and unspaced_sentence_starts > 0


def test_random_replacements_draw_only_ordinary_tokens(tokenizers_by_kind):
    for kind, path in tokenizers_by_kind.items():
        vocab = Vocabulary.from_file(path)
        replacements = set(vocab.replacement_ids().tolist())
        control = set(vocab.special_ids.tolist())
        assert replacements == set(range(vocab.size)) - control, kind
        assert vocab.mask_id in control and vocab.cls_id in control and vocab.pad_id in control


# --------------------------------------------------------------------------------------------
# Checkpoints carry a BPE tokenizer.json without a vocab.txt
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ("built", "roberta"))
def test_checkpoint_carries_a_bpe_tokenizer_without_vocab_txt(tokenizers_by_kind, tmp_path, kind):
    from pretrain.checkpoint.tokenizer_files import (checkpoint_tokenizer, copy_vocab_files, save_vocab,
                                                     tokenizer_vocabulary)

    source = tokenizers_by_kind[kind]
    tag = tmp_path / "iter_0000010"
    tag.mkdir()
    save_vocab(str(source), str(tag))
    expected = {"built": ["tokenizer.json", "tokenizer_config.json"], "roberta": ["tokenizer.json"]}[kind]
    assert sorted(os.listdir(tag)) == expected
    vocab = Tokenizer.from_file(str(source)).get_vocab(with_added_tokens=True)
    assert tokenizer_vocabulary(str(tag)) == vocab
    copied = tmp_path / "copied"
    copied.mkdir()
    assert copy_vocab_files(str(tag), str(copied)) == vocab
    assert sorted(os.listdir(copied)) == expected  # no vocab.txt derived
    info, original = checkpoint_tokenizer(str(copied), len(vocab), "the checkpoint"), read_special_tokens(str(source))
    assert (info.specials.tokens, info.specials.ids) == (original.tokens, original.ids)
