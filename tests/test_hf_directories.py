"""Real Hugging Face directories, as transformers 5 saves them: a BERT tokenizer is tokenizer.json +
tokenizer_config.json with no vocab.txt, and BertForMaskedLM / BertModel have no pooler or
next-sentence head. hf -> native TP2 -> hf (tools/convert_checkpoint.py) gives back the same
tensors under the same names, the same outputs, and a tokenizer that encodes identically."""
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import BPE, WordPiece
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertForPreTraining, BertModel, BertTokenizer

from test_checkpoint_interop import SPECIALS
from pretrain.data.preprocess.tokenizer import load_tokenizer
from pretrain.checkpoint.hf import PRETRAINING_ARCHITECTURES
from tools import convert_checkpoint

WORDS = ["the", "The", "cat", "##s", "play", "##ing", "##ed", "are", "in", "who", "Who", "hello", "Hello", "world",
         "cafe", "café", "naive", "un", "##known", "##é", ".", ",", "!", "?"]
VOCAB = SPECIALS + WORDS + [f"w{i}" for i in range(100 - len(SPECIALS) - len(WORDS))]  # 100 tokens
SENTENCES = ["The cats are playing.", "Hello, WORLD! Café naïve zebra unknown"]  # zebra: [UNK]
PAIR = ("Who played?", "The cat played in the café.")
TOKENIZER_CONFIG = "tokenizer_config.json"


def tiny_model(cls, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = cls(BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, attn_implementation="eager"), **kwargs)
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_directory(path, model, lowercase, with_vocab_txt=False):
    """What model.save_pretrained + tokenizer.save_pretrained write under transformers 5."""
    model.save_pretrained(path)
    vocab_file = path.parent / f"{path.name}-vocab.txt"
    vocab_file.write_text("\n".join(VOCAB) + "\n")
    # transformers 5 takes `vocab`: BertTokenizer(Fast)(vocab_file=...) silently keeps only the 5 specials
    tokenizer = BertTokenizer(vocab=str(vocab_file), do_lower_case=lowercase)
    assert len(tokenizer) == len(VOCAB)
    tokenizer.save_pretrained(path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "tokenizer.json", TOKENIZER_CONFIG]
    if with_vocab_txt:  # as hub directories saved by transformers 4 have it
        (path / "vocab.txt").write_text(vocab_file.read_text())
    return path


def convert(*argv):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # what convert_checkpoint.main sets, undone afterwards
        return convert_checkpoint.main([str(a) for a in argv])


def round_trip(source, tmp_path, capsys, *native_to_hf_args):
    assert convert("hf-to-native", "--input", source, "--output", tmp_path / "native", "--tp", 2, "--pp", 1) == 0
    meta = json.loads((tmp_path / "native" / "iter_0000000" / "meta.json").read_text())
    assert meta["layout"]["tensor_parallel"] == 2
    assert convert("native-to-hf", "--input", tmp_path / "native", "--output", tmp_path / "back", *native_to_hf_args) == 0
    return tmp_path / "back", capsys.readouterr().out


# what an export adds besides the model and the tokenizer: its sentence-transformers files
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                               "1_Pooling")


def tokenizer_files(path):
    return {name for name in os.listdir(path)
            if name not in ("config.json", "model.safetensors", *SENTENCE_TRANSFORMERS_FILES)}


def encodings(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [dict(tokenizer(text)) for text in SENTENCES] + [dict(tokenizer(*PAIR))]


def outputs(model, path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch)
    if hasattr(out, "logits"):
        return [out.logits]
    return [out.last_hidden_state] + ([out.pooler_output] if out.pooler_output is not None else [])


@pytest.mark.parametrize("cls, options, lowercase, with_vocab_txt", [
    (BertForMaskedLM, {}, True, False),
    (BertModel, {}, False, True),  # cased, and a vocab.txt beside tokenizer.json
    (BertModel, {"add_pooling_layer": False}, True, False),
], ids=["masked-lm", "base-cased-with-vocab-txt", "base-no-pooler"])
def test_transformers_directory_round_trips(tmp_path, capsys, cls, options, lowercase, with_vocab_txt):
    model = tiny_model(cls, **options)
    source = save_directory(tmp_path / "hf", model, lowercase, with_vocab_txt)
    back, report = round_trip(source, tmp_path, capsys)

    # the architecture that was trained, nothing initialised added (no pooler, no NSP head)
    before, after = load_file(source / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(after) == set(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    assert json.loads((back / "config.json").read_text())["architectures"] == [cls.__name__]
    loaded, info = cls.from_pretrained(back, output_loading_info=True, attn_implementation="eager", **options)
    assert all(not problems for problems in info.values()), info
    ours, theirs = outputs(loaded.eval(), back), outputs(model, source)
    assert len(ours) == len(theirs) == (2 if cls is BertModel and not options else 1)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() < 1e-5
    assert f"architecture {cls.__name__}" in report

    # every tokenizer file carried as it was, plus the vocab.txt tokenizer.json implies
    assert tokenizer_files(back) == tokenizer_files(source) | {"vocab.txt"}
    for name in tokenizer_files(source):
        assert (back / name).read_bytes() == (source / name).read_bytes(), name
    assert (back / "vocab.txt").read_text().splitlines() == VOCAB
    assert encodings(back) == encodings(source)
    ids = [e["input_ids"] for e in encodings(source)]
    assert 1 in ids[1] and 0 not in ids[1]  # an unknown word is [UNK], no padding sneaks in
    assert encodings(source)[2]["token_type_ids"].count(1) > 1  # the pair's second segment
    unk_free = [i for i in ids[0] if i > 4]
    assert len(unk_free) == len(ids[0]) - 2  # everything of "The cats are playing." is in the vocabulary
    # our own tokenizer, built from the derived vocab.txt with the same casing, encodes as transformers does
    ours = load_tokenizer(vocab_file=str(back / "vocab.txt"), allow_case_mismatch=True,
                          tokenizer_type="BertWordPieceLowerCase" if lowercase else "BertWordPieceCase")
    assert [ours.tokenizer.encode(text).ids for text in SENTENCES] == ids[:2]


def test_untrained_heads_only_on_request(tmp_path, capsys):
    """A converted BertForMaskedLM stays one through a reshard; --architecture BertForPreTraining
    writes the pooler and NSP head hf-to-native initialised, and says they are untrained. A
    pretraining checkpoint converts to BertForPreTraining by default."""
    source = save_directory(tmp_path / "mlm", tiny_model(BertForMaskedLM), lowercase=True)
    assert convert("hf-to-native", "--input", source, "--output", tmp_path / "tp2", "--tp", 2, "--pp", 1) == 0
    assert convert("reshard", "--input", tmp_path / "tp2", "--output", tmp_path / "tp1", "--tp", 1, "--pp", 1) == 0
    assert convert("native-to-hf", "--input", tmp_path / "tp1", "--output", tmp_path / "mlm-back") == 0
    assert set(load_file(tmp_path / "mlm-back" / "model.safetensors")) == set(load_file(source / "model.safetensors"))
    report = capsys.readouterr().out
    assert "architecture BertForMaskedLM: encoder, MLM head; left out pooler, next-sentence head (never trained; " \
           "--architecture BertForPreTraining writes them)" in report

    assert convert("native-to-hf", "--input", tmp_path / "tp2", "--output", tmp_path / "full",
                   "--architecture", "BertForPreTraining") == 0
    assert "untrained (initialised when converted from a directory without them): pooler, next-sentence head" \
        in capsys.readouterr().out
    written = set(load_file(tmp_path / "full" / "model.safetensors"))
    assert written - set(load_file(source / "model.safetensors")) == {
        "bert.pooler.dense.weight", "bert.pooler.dense.bias", "cls.seq_relationship.weight", "cls.seq_relationship.bias"}
    _, info = BertForPreTraining.from_pretrained(tmp_path / "full", output_loading_info=True)
    assert all(not problems for problems in info.values()), info

    pretraining = save_directory(tmp_path / "pt", tiny_model(BertForPreTraining), lowercase=True)
    back, report = round_trip(pretraining, tmp_path, capsys)
    assert set(load_file(back / "model.safetensors")) == set(load_file(pretraining / "model.safetensors"))
    assert "architecture BertForPreTraining: encoder, pooler, next-sentence head, MLM head" in report

    assert convert_checkpoint.PRETRAINING_ARCHITECTURES == PRETRAINING_ARCHITECTURES
    with pytest.raises(SystemExit):
        convert_checkpoint.parse_args(["native-to-hf", "--help"])
    assert "--architecture {BertForPreTraining,BertForMaskedLM,BertModel,ModernBertForMaskedLM,ModernBertModel}" \
        in capsys.readouterr().out


def bpe_tokenizer_without_mask(path):
    # a BPE tokenizer.json is carried as it is (no vocab.txt), but this one lacks the mask token
    # the directory's tokenizer_config.json names
    vocab = {token: i for i, token in enumerate([t for t in SPECIALS if t != "[MASK]"] + ["a", "b", "ab"])}
    Tokenizer(BPE(vocab, [("a", "b")], unk_token="[UNK]")).save(str(path / "tokenizer.json"))


def gapped_wordpiece_tokenizer(path):  # ids 0-4 and 6: no vocab.txt line numbering gives id 6
    vocab = {token: i for i, token in enumerate(SPECIALS)} | {"a": 6}
    Tokenizer(WordPiece(vocab, unk_token="[UNK]")).save(str(path / "tokenizer.json"))


def disagreeing_vocab_txt(path):
    tokens = VOCAB[:5] + [VOCAB[6], VOCAB[5]] + VOCAB[7:]
    (path / "vocab.txt").write_text("\n".join(tokens) + "\n")


@pytest.mark.parametrize("tokenizer, message", [
    (bpe_tokenizer_without_mask, "tokenizer.json: its mask token '[MASK]' (from tokenizer_config.json's mask_token) "
                                 "is not in its vocabulary"),
    (gapped_wordpiece_tokenizer, "tokenizer.json: 6 tokens with ids up to 6 (no token has id 5)"),
    (disagreeing_vocab_txt, "disagree on 2 token(s), e.g. 'The': id 5 in vocab.txt, 6 in tokenizer.json"),
], ids=["bpe", "id-gap", "vocab-txt-disagrees"])
def test_tokenizer_that_cannot_be_carried_is_named(tmp_path, capsys, tokenizer, message):
    """A tokenizer.json without a token its special tokens need, a WordPiece one that no vocab.txt
    can express, or a vocab.txt that contradicts it: exit 1 naming the file, and no output. Reading the directory to train or fine-tune from it still
    works (the tokenizer.json is used as it is there)."""
    source = save_directory(tmp_path / "hf", tiny_model(BertForMaskedLM), lowercase=True)
    tokenizer(source)
    capsys.readouterr()
    assert convert("hf-to-native", "--input", source, "--output", tmp_path / "native", "--tp", 1, "--pp", 1) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"convert_checkpoint: error: {source}/") and message in error, error
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf-vocab.txt"]  # no output, no temporary directory
    from pretrain.checkpoint.hf import read_hf

    assert read_hf(str(source)).vocab_dir == str(source)


def test_sigterm_during_conversion_leaves_nothing_behind(tmp_path, capsys, signum=signal.SIGTERM):
    """A scheduler's SIGTERM in the middle of writing the native checkpoint: the temporary output
    directory is removed, exit 143, one line saying so (as Ctrl-C: exit 130)."""
    source = save_directory(tmp_path / "hf", tiny_model(BertForPreTraining), lowercase=False)
    original, written = torch.save, []

    def save_then_signal(obj, f, *args, **kwargs):
        original(obj, f, *args, **kwargs)
        written.append(f)
        if len(written) == 2:  # some files of the output are on disk
            os.kill(os.getpid(), signum)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "save", save_then_signal)
        code = convert("hf-to-native", "--input", source, "--output", tmp_path / "native", "--tp", 2, "--pp", 1)
    assert len(written) == 2 and code == (143 if signum == signal.SIGTERM else 130)
    err = capsys.readouterr().err  # the save_pretrained progress bar, then our one line
    assert err.strip().splitlines()[-1] == ("convert_checkpoint: " + ("terminated (SIGTERM)" if signum == signal.SIGTERM
                                                                      else "interrupted") + "; no output written"), err
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf-vocab.txt"]  # neither the output nor a .tmp-<pid> directory
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler was the program's own, for its run
