"""What a dataset records about how it was made (issue 37, items 1, 2 and 7), with real files made
here: a sentence-transformers-style tokenizer.json (padding and truncation Fixed 128) built with
`tokenizers` from a small WordPiece vocabulary, and two vocabularies of equal size.

- preprocessing switches a tokenizer.json's padding and truncation off, and says so;
- a dataset of mostly padding or special tokens is refused at preprocessing (nothing written)
  and before training starts (from the record, or from a sample of a file without one);
- the fingerprint records the vocabulary (SHA-256 of its tokens, size, case) and the token
  counts; merging carries them over or refuses two vocabularies; the pre-start check compares the
  record with data.vocab_file (data.accept_dataset_vocab overrides);
- hard-wrapped text given as text-lines (and unbroken text as text-blank-lines) is pointed out.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from _preprocess_helpers import documents, hard_wrap, write_jsonl
from pretrain.config import load_config
from pretrain.data.preprocess.dataset_record import (TokenCounts, count_tokens, read_record, record_members,
                                                     sampled_token_counts, special_table)
from pretrain.data.preprocess.indexed import DataError, StreamingIndexedDatasetBuilder
from pretrain.data.preprocess.merge import merge_datasets
from pretrain.data.preprocess.pipeline import PreprocessError, PreprocessOptions, preprocess
from pretrain.data.preprocess.vocab_builder import VocabOptions, build_vocab
from pretrain.data.samples.provider import data_file_problems
from pretrain.data.samples.token_ids import WordPieceVocab

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory):
    """vocab.txt and tokenizer.json (a), the same tokens with ids 100 and 101 swapped (b, equal
    size), and a sentence-transformers tokenizer.json of (a) that pads and truncates to 128."""
    out = tmp_path_factory.mktemp("vocabs")
    corpus = write_jsonl(str(out / "c.jsonl"), documents(400, seed=1))
    build_vocab([corpus], "jsonl", ["text"], VocabOptions(vocab_size=200), str(out / "a.txt"), str(out / "a.json"))
    tokens = (out / "a.txt").read_text(encoding="utf-8").splitlines()
    tokens[100], tokens[101] = tokens[101], tokens[100]
    (out / "b.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    config = json.loads((out / "a.json").read_text(encoding="utf-8"))
    config["padding"] = {"strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}
    config["truncation"] = {"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0}
    (out / "st.json").write_text(json.dumps(config), encoding="utf-8")
    return {name: str(out / file) for name, file in
            (("a", "a.txt"), ("a_json", "a.json"), ("b", "b.txt"), ("st", "st.json"))}


def run(inputs, prefix, split_sentences=True, **kwargs):
    return preprocess(PreprocessOptions(inputs=tuple(map(str, inputs)), output_prefix=str(prefix), progress=False,
                                        split_sentences=split_sentences, **kwargs))


def fingerprint(prefix) -> dict:
    with open(f"{prefix}.fingerprint.json", encoding="utf-8") as f:
        return json.load(f)


def check(vocab_file: str, *paths: str, extra: tuple[str, ...] = ()) -> list[str]:
    """data_file_problems, the check --check-config and every launch run."""
    cfg = load_config(os.path.join(REPO, "configs", "bert-tiny.yaml"),
                      ["data.kind=indexed", f"data.paths=[{','.join(paths)}]", f"data.vocab_file={vocab_file}", *extra])
    return data_file_problems(cfg)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("corpus") / "in.jsonl"), documents(80, seed=2))


# --------------------------------------------------------------------------------------------
# item 1: a tokenizer.json's padding; datasets of mostly special tokens
# --------------------------------------------------------------------------------------------


def test_a_tokenizer_json_that_pads_to_128_writes_the_sentences_tokens_and_says_so(tmp_path, vocabs, corpus,
                                                                                    capsys):
    from tools import preprocess_data

    assert preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "st"), "--tokenizer-json",
                                 vocabs["st"], "--split-sentences", "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{vocabs['st']}: its padding to 128 and truncation at 128 switched off: every sentence is written " \
           "with its own tokens, none cut off or added" in out, out
    run([corpus], tmp_path / "plain", vocab_file=vocabs["a"])
    for ext in ("bin", "idx"):  # the same ids as with the vocab.txt: no [PAD] added
        assert (tmp_path / f"st_text_sentence.{ext}").read_bytes() == \
            (tmp_path / f"plain_text_sentence.{ext}").read_bytes()
    counts = fingerprint(tmp_path / "st_text_sentence")["token_counts"]
    assert counts["pad"] == 0 and counts["total"] > 1000
    # a tokenizer.json without padding: no line
    assert preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "j"), "--tokenizer-json",
                                 vocabs["a_json"], "--workers", "1", "--quiet"]) == 0
    assert "switched off" not in capsys.readouterr().out


def test_text_the_vocabulary_cannot_spell_is_refused_at_preprocessing_and_nothing_written(tmp_path, vocabs):
    # Cyrillic text with a vocabulary of Latin text: every word is [UNK]
    text = "Пример текста на другом языке\nЕщё одна строка текста\n" * 30
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    (tmp_path / "out").mkdir()
    with pytest.raises(PreprocessError) as caught:
        run([tmp_path / "in.txt"], tmp_path / "out" / "ru", input_format="text-lines", vocab_file=vocabs["a"])
    message = str(caught.value)
    assert message.startswith(f"{tmp_path}/out/ru_text_sentence.bin (key 'text', tokenized with {vocabs['a']}): "
                              "100.0% of its 270 tokens are padding or special tokens (0 [PAD], 270 others such as "
                              "[UNK], [CLS], [SEP], [MASK]; more than 50% is refused)"), message
    assert message.endswith("nothing written"), message
    assert os.listdir(tmp_path / "out") == []


def _padded_dataset(prefix: str, vocab: WordPieceVocab, sentences: int = 300) -> np.ndarray:
    """What Megatron-LM's preprocessing writes with a tokenizer that pads to 128: real ids, then [PAD]s."""
    rng = np.random.default_rng(0)
    builder = StreamingIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rows = []
    for _ in range(sentences):
        row = np.full(128, vocab.pad_id, dtype=np.uint16)
        row[:20] = rng.integers(20, vocab.size, 20)
        rows.append(row)
    ids = np.concatenate(rows)
    builder.add_sequences(ids, np.full(sentences, 128, dtype=np.int32), np.full(sentences // 3, 3, dtype=np.int64))
    builder.finalize(prefix + ".idx")
    builder.close()
    return ids


def test_a_padded_dataset_is_refused_before_training_from_its_record_or_a_sample(tmp_path, vocabs):
    vocab = WordPieceVocab.from_file(vocabs["a"])
    prefix = str(tmp_path / "padded")
    ids = _padded_dataset(prefix, vocab)
    problems = check(vocabs["a"], prefix)  # no record (Megatron-LM's file): a sample, here the whole file
    assert problems == [f"data.paths: {prefix}.bin (a sample of 38,400 tokens read over the file): 84.4% of its 38,400 "
                        "tokens are padding or special tokens (32,400 [PAD], 0 others such as [UNK], [CLS], [SEP], [MASK]; "
                        "more than 50% is refused): a model learns nothing from them; make it again with "
                        "tools/preprocess_data.py (which switches a tokenizer.json's padding off)"], problems
    # with a record, its counts decide (here: as preprocessing would have counted them)
    from pretrain.data.preprocess.fingerprint import write_fingerprint

    write_fingerprint(prefix + ".bin", prefix + ".idx", prefix + ".fingerprint.json",
                      record_members(None, count_tokens(ids, special_table(vocab.tokens), vocab.pad_id)))
    assert check(vocabs["a"], prefix)[0].startswith(f"data.paths: {prefix}.bin: 84.4% of its 38,400 tokens")
    write_fingerprint(prefix + ".bin", prefix + ".idx", prefix + ".fingerprint.json",
                      record_members(None, TokenCounts(38400, 100, 0)))
    assert check(vocabs["a"], prefix) == []


def test_a_sample_spreads_over_the_file(tmp_path, vocabs):
    vocab = WordPieceVocab.from_file(vocabs["a"])
    prefix = str(tmp_path / "half")
    builder = StreamingIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    ids = np.concatenate([np.full(50_000, vocab.pad_id, np.uint16), np.full(50_000, 150, np.uint16)])
    builder.add_sequences(ids, np.full(100, 1000, dtype=np.int32), np.full(1, 100, dtype=np.int64))
    builder.finalize(prefix + ".idx")
    builder.close()
    counts = sampled_token_counts(prefix, special_table(vocab.tokens), vocab.pad_id, budget=8192, pieces=16)
    assert counts.total == 4096 and counts.pad == counts.special == 2048  # 16 pieces of 256 tokens, half each side


# --------------------------------------------------------------------------------------------
# item 2: the vocabulary record
# --------------------------------------------------------------------------------------------


def test_the_fingerprint_records_the_vocabulary_and_token_counts(tmp_path, vocabs, corpus):
    report = run([corpus], tmp_path / "a", vocab_file=vocabs["a"])
    saved = fingerprint(tmp_path / "a_text_sentence")
    sha = hashlib.sha256(open(vocabs["a"], "rb").read()).hexdigest()  # the tokens, one per line: vocab.txt's own
    assert saved["vocabulary"] == {"file": vocabs["a"], "size": 200, "sha256": sha, "lowercase": True}
    stats = report.keys["text"]
    assert saved["token_counts"] == {"total": stats.tokens, "special": stats.counts.special, "pad": 0}
    run([corpus], tmp_path / "j", tokenizer_json=vocabs["a_json"])  # the same tokens from a tokenizer.json
    assert fingerprint(tmp_path / "j_text_sentence")["vocabulary"]["sha256"] == sha
    assert check(vocabs["a_json"], str(tmp_path / "a_text_sentence")) == []
    from tools import inspect_dataset

    assert inspect_dataset.main([str(tmp_path / "a_text_sentence")]) == 0


def test_data_made_with_another_vocabulary_of_the_same_size_is_refused_before_training(tmp_path, vocabs, corpus):
    run([corpus], tmp_path / "a", vocab_file=vocabs["a"])
    prefix = str(tmp_path / "a_text_sentence")
    assert check(vocabs["a"], prefix) == []
    tokens = WordPieceVocab.from_file(vocabs["a"]).tokens
    expected = (f"data.paths: {prefix} was preprocessed with another vocabulary than data.vocab_file {vocabs['b']}: "
                f"{vocabs['a']}; 2 of the ids have another token (e.g. id 100: {tokens[101]!r} in data.vocab_file, "
                f"{tokens[100]!r} in the dataset's); preprocess it with data.vocab_file, or set "
                "data.accept_dataset_vocab=true to train on it deliberately")
    assert check(vocabs["b"], prefix) == [expected]
    assert check(vocabs["b"], prefix, extra=("data.accept_dataset_vocab=true",)) == []
    # through the command every launch runs first: one line in the problems list, exit 2
    from pretrain.main import main

    status = main(["--check-config", "--world-size", "1", "--config", os.path.join(REPO, "configs", "bert-tiny.yaml"),
                   "data.kind=indexed", f"data.paths=[{prefix}]", f"data.vocab_file={vocabs['b']}"])
    assert status == 2


def test_a_record_whose_vocabulary_file_is_gone_still_finds_the_change_and_old_fingerprints_pass(tmp_path, vocabs,
                                                                                                  corpus):
    local = tmp_path / "vocab.txt"
    local.write_bytes(open(vocabs["a"], "rb").read())
    run([corpus], tmp_path / "a", vocab_file=str(local))
    prefix = str(tmp_path / "a_text_sentence")
    local.unlink()
    problems = check(vocabs["b"], prefix)
    assert len(problems) == 1
    assert f"{local}; 200 tokens in data.vocab_file, 200 in the dataset's (SHA-256 " in problems[0], problems
    # a fingerprint written before datasets recorded their vocabulary: today's checks only
    saved = fingerprint(prefix)
    del saved["vocabulary"], saved["token_counts"]
    with open(prefix + ".fingerprint.json", "w", encoding="utf-8") as f:
        json.dump(saved, f)
    assert read_record(prefix) == (None, None)
    assert check(vocabs["b"], prefix) == []


def test_merge_carries_the_record_and_refuses_two_vocabularies(tmp_path, vocabs, corpus):
    docs = documents(60, seed=3)
    write_jsonl(str(tmp_path / "x.jsonl"), docs)
    run([corpus], tmp_path / "a", vocab_file=vocabs["a"])
    run([tmp_path / "x.jsonl"], tmp_path / "x", vocab_file=vocabs["a"])
    run([tmp_path / "x.jsonl"], tmp_path / "b", vocab_file=vocabs["b"])
    a, x, b = (str(tmp_path / f"{name}_text_sentence") for name in "axb")
    merge_datasets([a, x], str(tmp_path / "ax"))
    merged = fingerprint(tmp_path / "ax")
    assert merged["vocabulary"] == fingerprint(a)["vocabulary"]
    totals = [fingerprint(p)["token_counts"]["total"] for p in (a, x)]
    assert merged["token_counts"]["total"] == sum(totals) > 0
    with pytest.raises(DataError) as caught:
        merge_datasets([a, b], str(tmp_path / "ab"))
    assert str(caught.value) == (f"{a} and {b} were made with different vocabularies ({vocabs['a']} (200 tokens, "
                                 f"lowercased) and {vocabs['b']} (200 tokens, lowercased)): their ids mean different "
                                 "tokens; preprocess them with one")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ab")]
    # an input without a record (Megatron-LM's): the merge records no vocabulary
    os.remove(x + ".fingerprint.json")
    merge_datasets([a, x], str(tmp_path / "ax2"))
    assert "vocabulary" not in fingerprint(tmp_path / "ax2") and "token_counts" not in fingerprint(tmp_path / "ax2")


# --------------------------------------------------------------------------------------------
# item 7: which plain-text format fits
# --------------------------------------------------------------------------------------------


def _hard_wrapped(path, paragraphs: int = 12) -> str:
    text = "\n\n".join(hard_wrap(doc, 72) for doc in documents(paragraphs, seed=4))
    path.write_text(text + "\n", encoding="utf-8")
    return str(path)


def test_hard_wrapped_text_read_as_text_lines_is_pointed_out(tmp_path, vocabs, capsys):
    from tools import preprocess_data

    book = _hard_wrapped(tmp_path / "book.txt", paragraphs=30)
    assert preprocess_data.main(["--input", book, "--input-format", "text-lines", "--output-prefix",
                                 str(tmp_path / "lines"), "--vocab-file", vocabs["a"], "--workers", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"{book} looks hard-wrapped: " in err and ("--input-format text-lines makes every line a document; "
                                                       "--input-format text-blank-lines makes every block (paragraph) one"
                                                       in err), err
    assert preprocess_data.main(["--input", book, "--input-format", "text-blank-lines", "--output-prefix",
                                 str(tmp_path / "blocks"), "--vocab-file", vocabs["a"], "--workers", "1", "--quiet"]) == 0
    assert "looks hard-wrapped" not in capsys.readouterr().err
    # the vocabulary builder says it too (issue 52, item 6)
    from tools import build_vocab

    assert build_vocab.main(["--input", book, "--input-format", "text-lines", "--vocab-size", "120",
                             "--output-dir", str(tmp_path / "vocab")]) == 0
    assert f"warning: {book} looks hard-wrapped: " in capsys.readouterr().err
    assert build_vocab.main(["--input", book, "--input-format", "text-blank-lines", "--vocab-size", "120",
                             "--output-dir", str(tmp_path / "vocab2")]) == 0
    assert "looks hard-wrapped" not in capsys.readouterr().err


def test_the_layout_hints_stay_quiet_on_what_fits(tmp_path):
    from pretrain.data.preprocess.corpus import layout_hint

    per_line = tmp_path / "lines.txt"  # one paragraph per line (the first-run guide's corpus)
    per_line.write_text("\n".join(documents(60, seed=5)) + "\n", encoding="utf-8")
    assert layout_hint(str(per_line), "text-lines") is None
    hint = layout_hint(str(per_line), "text-blank-lines")
    assert hint == (f"{per_line} has no blank line in its first 60 lines: --input-format text-blank-lines reads them "
                    "all as one document (documents end at blank lines); if every line is a document, "
                    "--input-format text-lines fits")
    book = _hard_wrapped(tmp_path / "book.txt")
    assert layout_hint(book, "text-blank-lines") is None and layout_hint(book, "jsonl") is None
    assert layout_hint(book, "text-lines").startswith(f"{book} looks hard-wrapped: ")


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch_and_null_takes_its_size(tmp_path, vocabs, corpus,
                                                                                             capsys):
    """Issue 52, item 1: a tokenizer with more entries than model.vocab_size is named by the pre-start
    check (not after the ranks started); model.vocab_size null (the ModernBERT demo's) takes the
    tokenizer's size."""
    from pretrain.checkpoint.starting_point import load_run_config
    from pretrain.config import ConfigError
    from pretrain.main import main

    run([corpus], tmp_path / "a", vocab_file=vocabs["a"])
    prefix = str(tmp_path / "a_text_sentence")
    size = WordPieceVocab.from_file(vocabs["a"]).size
    too_small = (f"data.vocab_file {vocabs['a']} has {size} tokens but model.vocab_size is {size - 50}: set "
                 f"model.vocab_size={size}, or null to take the tokenizer's size")
    assert check(vocabs["a"], prefix, extra=(f"model.vocab_size={size - 50}",)) == [too_small]
    assert check(vocabs["a"], prefix, extra=(f"model.vocab_size={size}",)) == []
    demo = ["--config", os.path.join(REPO, "configs", "modernbert-demo.yaml"), f"data.paths=[{prefix}]",
            f"data.vocab_file={vocabs['a']}"]
    assert main(["--check-config", "--world-size", "4", *demo, f"model.vocab_size={size - 50}"]) == 2
    assert too_small in capsys.readouterr().err
    assert main(["--check-config", "--world-size", "4", *demo]) == 0
    assert load_run_config(*demo[1:2], demo[2:]).model.vocab_size == size
    # null with no tokenizer to read it from: named, not a crash deep inside
    no_file = load_run_config(os.path.join(REPO, "configs", "modernbert-demo.yaml"), ["data.kind=synthetic"])
    with pytest.raises(ConfigError, match="model.vocab_size is null .* no readable data.vocab_file"):
        no_file.validate(world_size=4)
