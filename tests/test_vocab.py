"""Vocabulary building and BERT tokenizers: Google's vocab.txt format, a complete tokenizer.json,
tokenization equal to transformers' BertTokenizer, case checks, and clear errors."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys

import pytest
import zstandard

from _preprocess_helpers import documents, write_jsonl
from pretrain.data.preprocess.corpus import CorpusError, expand_inputs, iter_documents
from pretrain.data.preprocess.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerError,
    bert_wordpiece_tokenizer,
    load_tokenizer,
    read_vocab,
)
from pretrain.data.preprocess.vocab_builder import VocabOptions, build_vocab

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = [
    "Hello, World! This is BERT's tokenizer.",
    "Café naïve RÔLE façade Zürich Ångström résumé",
    "東京と北京 mixed with English",
    "Numbers 1816, 3.14 and £5 (20%) — well-known e-mails can't wait.",
    "Antidisestablishmentarianism " + "x" * 120 + " done",  # a word longer than 100 characters is [UNK]
    "tabs\tand\nnewlines  and\u00a0non-breaking\u200bzero-width\x00control",
    "emoji 🙂 and unseen characters ∮ ⅞",
]


def _build(tmp_path, lowercase: bool, vocab_size: int = 200, name: str = "v"):
    corpus = write_jsonl(str(tmp_path / f"{name}.jsonl"), documents(400, seed=1))
    out = tmp_path / name
    out.mkdir()
    report = build_vocab([corpus], "jsonl", ["text"], VocabOptions(vocab_size=vocab_size, lowercase=lowercase),
                         str(out / "vocab.txt"), str(out / "tokenizer.json"))
    return out, report


@pytest.fixture(scope="module")
def uncased(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("uncased"), lowercase=True)[0]


@pytest.fixture(scope="module")
def cased(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("cased"), lowercase=False)[0]


def test_vocab_txt_is_google_format(uncased):
    lines = (uncased / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""  # newline-terminated
    tokens = lines[:-1]
    assert tokens[:5] == list(SPECIAL_TOKENS)  # [PAD] = 0 like Google's
    assert len(tokens) == len(set(tokens)) == 200
    assert any(t.startswith("##") for t in tokens)
    assert not any(t != t.lower() for t in tokens if not t.startswith("["))  # uncased: no uppercase
    assert sorted(os.listdir(uncased)) == ["tokenizer.json", "vocab.txt"]  # no temporary leftovers


def test_tokenizer_json_is_a_complete_bert_tokenizer(uncased):
    config = json.loads((uncased / "tokenizer.json").read_text())
    assert config["normalizer"]["type"] == "BertNormalizer" and config["normalizer"]["lowercase"] is True
    assert config["pre_tokenizer"]["type"] == "BertPreTokenizer"
    assert config["model"]["type"] == "WordPiece" and config["model"]["unk_token"] == "[UNK]"
    assert config["decoder"]["type"] == "WordPiece"
    assert config["post_processor"]["type"] == "TemplateProcessing"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(uncased / "tokenizer.json"))
    vocab = read_vocab(str(uncased / "vocab.txt"))
    assert tok.get_vocab() == vocab
    enc = tok.encode("Emma was here.", "She left!")
    assert enc.tokens[0] == "[CLS]" and enc.tokens.count("[SEP]") == 2 and enc.tokens[-1] == "[SEP]"
    assert enc.type_ids[-1] == 1 and enc.type_ids[0] == 0
    assert tok.decode(tok.encode("Emma was here.").ids) == "emma was here."


@pytest.mark.parametrize("lowercase", [True, False])
def test_tokenizes_like_transformers_bert_tokenizer(uncased, cased, lowercase):
    from transformers.models.bert import BertTokenizer, BertTokenizerLegacy
    vocab_file = str((uncased if lowercase else cased) / "vocab.txt")
    ours = load_tokenizer(vocab_file=vocab_file,
                          tokenizer_type="BertWordPieceLowerCase" if lowercase else "BertWordPieceCase").tokenizer
    from_json = load_tokenizer(tokenizer_json=str((uncased if lowercase else cased) / "tokenizer.json")).tokenizer
    references = [BertTokenizer(vocab=vocab_file, do_lower_case=lowercase),
                  BertTokenizerLegacy(vocab_file=vocab_file, do_lower_case=lowercase)]  # Google's algorithm in Python
    for text in SAMPLES:
        for reference in references:
            expected = reference(text, add_special_tokens=False)["input_ids"]
            assert ours.encode(text, add_special_tokens=False).ids == expected, (text, type(reference).__name__)
            assert from_json.encode(text, add_special_tokens=False).ids == expected
            assert ours.encode(text).ids == reference(text)["input_ids"]  # with [CLS] ... [SEP]
    assert len(set(ours.encode(SAMPLES[1]).ids)) > 3  # not all [UNK]


def test_compressed_inputs_and_globs_read_the_same_text(tmp_path):
    docs = documents(300, seed=2)
    plain = write_jsonl(str(tmp_path / "a.jsonl"), docs)
    data = open(plain, "rb").read()
    half = data.index(b"\n", len(data) // 2) + 1
    (tmp_path / "parts").mkdir()
    with gzip.open(tmp_path / "parts" / "p1.jsonl.gz", "wb") as f:
        f.write(data[:half])
    (tmp_path / "parts" / "p2.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data[half:]))
    (tmp_path / "b.jsonl.bz2").write_bytes(bz2.compress(data))
    (tmp_path / "c.jsonl.xz").write_bytes(lzma.compress(data))
    for inputs in ([plain], [str(tmp_path / "parts" / "p*")], [str(tmp_path / "b.jsonl.bz2")],
                   [str(tmp_path / "c.jsonl.xz")]):
        texts = [d[0] for _, parsed in iter_documents(expand_inputs(inputs), "jsonl", ["text"], chunk_bytes=997)
                 for d in parsed.documents]
        assert texts == docs, inputs
        report = build_vocab(inputs, "jsonl", ["text"], VocabOptions(vocab_size=200), str(tmp_path / "v.txt"), None)
        assert report.documents == 300 and report.text_chars == sum(map(len, docs))
        assert read_vocab(str(tmp_path / "v.txt"))["[PAD]"] == 0
    # Note: two trainings on the same text may differ in a few entries: tokenizers' WordPiece
    # trainer breaks ties between equally frequent pairs in hash-map order (huggingface/tokenizers#1794).


def test_malformed_lines_are_counted_or_fatal(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": d}) for d in documents(20, seed=3)]
    lines = good[:5] + ["{not json"] + good[5:10] + [json.dumps({"other": "x"})] + good[10:] + [json.dumps({"text": 5})]
    path.write_bytes("\n".join(lines).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    report = build_vocab([str(path)], "jsonl", ["text"], VocabOptions(vocab_size=300), str(tmp_path / "v.txt"), None)
    assert report.documents == 20
    assert report.problem_counts == {"bad JSON": 1, "missing key": 1, "non-string value": 1, "invalid UTF-8": 1}
    assert report.problems[0].startswith(f"{path}:6: bad JSON")
    assert report.problems[1] == f"{path}:12: missing key 'text'"
    with pytest.raises(CorpusError, match=rf"{path}:6: bad JSON"):
        build_vocab([str(path)], "jsonl", ["text"], VocabOptions(vocab_size=300), str(tmp_path / "w.txt"), None,
                    strict=True)
    assert not os.path.exists(tmp_path / "w.txt")
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_read_vocab_errors_name_the_file_and_token(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\n[CLS]\nhello\n##lo\n")
    with pytest.raises(TokenizerError, match=rf"{path}: vocabulary lacks the special tokens \[SEP\], \[MASK\]"):
        read_vocab(str(path))
    path.write_text("".join(t + "\n" for t in SPECIAL_TOKENS) + "a\nb\na\n")
    with pytest.raises(TokenizerError, match=rf"{path}:8: token 'a' repeats line 6"):
        read_vocab(str(path))
    path.write_text("".join(t + "\n" for t in SPECIAL_TOKENS) + "a\n\nb\n")
    with pytest.raises(TokenizerError, match=rf"{path}:7: empty line"):
        read_vocab(str(path))
    with pytest.raises(TokenizerError, match="does not exist"):
        read_vocab(str(tmp_path / "missing.txt"))
    tokenizer_json = tmp_path / "t.json"
    tok = bert_wordpiece_tokenizer({t: i for i, t in enumerate(SPECIAL_TOKENS + ("a", "b"))}, True)
    tok.save(str(tokenizer_json))
    config = json.loads(tokenizer_json.read_text())
    del config["model"]["vocab"]["[MASK]"]
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != "[MASK]"]
    tokenizer_json.write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=rf"{tokenizer_json}: vocabulary lacks the special token \[MASK\]"):
        load_tokenizer(tokenizer_json=str(tokenizer_json))


def test_case_mismatch_is_an_error(uncased, cased):
    uncased_vocab, cased_vocab = str(uncased / "vocab.txt"), str(cased / "vocab.txt")
    with pytest.raises(TokenizerError, match="capitalised words would become \\[UNK\\]"):
        load_tokenizer(vocab_file=uncased_vocab, tokenizer_type="BertWordPieceCase")
    with pytest.raises(TokenizerError, match="built from cased text"):
        load_tokenizer(vocab_file=cased_vocab, tokenizer_type="BertWordPieceLowerCase")
    with pytest.raises(TokenizerError, match="normalizer lowercases"):
        load_tokenizer(tokenizer_json=str(uncased / "tokenizer.json"), tokenizer_type="BertWordPieceCase")
    info = load_tokenizer(vocab_file=cased_vocab, tokenizer_type="BertWordPieceLowerCase", allow_case_mismatch=True)
    assert info.lowercase and any("built from cased text" in w for w in info.warnings)
    # without a type, the vocabulary decides
    assert load_tokenizer(vocab_file=uncased_vocab).lowercase is True
    assert load_tokenizer(vocab_file=cased_vocab).lowercase is False
    assert load_tokenizer(tokenizer_json=str(cased / "tokenizer.json")).lowercase is False


def test_cli(tmp_path):
    corpus = write_jsonl(str(tmp_path / "c.jsonl"), documents(100, seed=4))
    env = dict(os.environ, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "build_vocab.py"), "--input", corpus,
                          "--output-dir", str(tmp_path / "out"), "--vocab-size", "300", "--cased"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "vocabulary: 300 entries" in run.stdout and "cased" in run.stdout
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenizer.json", "vocab.txt"]
    run = subprocess.run([sys.executable, os.path.join(REPO, "tools", "build_vocab.py"), "--input",
                          str(tmp_path / "nope*.jsonl"), "--output-dir", str(tmp_path / "out2")],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert f"input glob '{tmp_path}/nope*.jsonl' matches no file" in run.stderr
    assert "Traceback" not in run.stderr


def test_nothing_read_is_an_error_and_writes_nothing(tmp_path):
    """A plain-text corpus read as JSON lines (the default), a wrong --json-keys, an empty input:
    one error naming the file, the skips and the likely fix; nothing written (a 5-entry vocabulary
    of special tokens only used to be written, exit 0)."""
    text = tmp_path / "emma.txt"
    text.write_text("\n".join(documents(30, seed=5)) + "\n")
    out = str(tmp_path / "v.txt")
    with pytest.raises(CorpusError, match=r"no text read from .*emma.txt \(--input-format jsonl, --json-keys text\): "
                                          r"30 line\(s\) skipped \(bad JSON 30\).*needs --input-format text-lines"):
        build_vocab([str(text)], "jsonl", ["text"], VocabOptions(vocab_size=300), out, None)
    keyed = write_jsonl(str(tmp_path / "c.jsonl"), documents(10, seed=6))
    with pytest.raises(CorpusError, match=r"missing key 10\).*--json-keys names the key"):
        build_vocab([keyed], "jsonl", ["body"], VocabOptions(vocab_size=300), out, None)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(CorpusError, match=r"the input is empty"):
        build_vocab([str(tmp_path / "empty.txt")], "text-lines", ["text"], VocabOptions(vocab_size=300), out, None)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl", "emma.txt", "empty.txt"]


def test_a_vocabulary_is_not_replaced_by_a_smaller_one_unless_asked(tmp_path):
    corpus = write_jsonl(str(tmp_path / "c.jsonl"), documents(100, seed=4))
    tiny = write_jsonl(str(tmp_path / "tiny.jsonl"), ["a b a b"])
    out = str(tmp_path / "vocab.txt")
    size = build_vocab([corpus], "jsonl", ["text"], VocabOptions(vocab_size=300), out, None).vocab_size
    before = open(out).read()
    with pytest.raises(CorpusError, match=rf"vocab.txt holds {size} entries and this corpus gives 7 .*not replaced"):
        build_vocab([tiny], "jsonl", ["text"], VocabOptions(vocab_size=300), out, None)
    assert open(out).read() == before
    report = build_vocab([tiny], "jsonl", ["text"], VocabOptions(vocab_size=300), out, None, replace_larger=True)
    assert sum(1 for _ in open(out)) == report.vocab_size == 7
    build_vocab([corpus], "jsonl", ["text"], VocabOptions(vocab_size=300), out, None)  # as large again: replaced
