"""tools/fill_mask.py: top-k [MASK] predictions equal transformers' BertForMaskedLM softmax, from a
Hugging Face directory and from its native conversion at TP2 on two processes; checkpoints
without an MLM head and bad input are refused with exit 1 and a message naming the problem."""
import json
import re
import shutil

import pytest
import torch

from distributed import free_port, run_ranks
from tools import convert_checkpoint, fill_mask

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# 200 tokens: at TP2 the vocabulary is padded to 256, so rank 0 holds ids 0-127, rank 1 ids 128-199 + padding
VOCAB = SPECIALS + [f"w{i}" for i in range(12)] + ["play", "##ing", "##ed"] + [f"x{i}" for i in range(180)]
SENTENCES = ["w1 w2 [MASK] w4", "[MASK] w5 W6 playing [MASK] w7 w8 w9"]  # one mask; two (and case, a wordpiece)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """hf/: a random tiny BertForPreTraining (biases and LayerNorms random too, weights large
    enough that predictions depend on the context); base/: a BertModel; native-tp2/: hf's
    conversion at TP2; native-base/: base's conversion (an initialised MLM head)."""
    from transformers import BertConfig, BertForPreTraining, BertModel

    root = tmp_path_factory.mktemp("fill-mask")
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, initializer_range=0.2)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "hf")
    BertModel(config).save_pretrained(root / "base")
    for name in ("hf", "base"):
        (root / name / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")  # what convert_checkpoint.main sets, undone afterwards
        assert convert_checkpoint.main(["hf-to-native", "--input", str(root / "hf"), "--output",
                                        str(root / "native-tp2"), "--tp", "2", "--pp", "1"]) == 0
        assert convert_checkpoint.main(["hf-to-native", "--input", str(root / "base"), "--output",
                                        str(root / "native-base"), "--tp", "1", "--pp", "1"]) == 0
    return root


@pytest.fixture
def run(monkeypatch, capsys):
    """fill_mask.main in this process as a one-rank job; returns (exit status, stdout, stderr)."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("DS_ACCELERATOR", "cpu")):
        monkeypatch.setenv(key, value)  # init_parallel writes them: restored after the test

    def call(*argv):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        capsys.readouterr()
        status = fill_mask.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return status, out, err
    return call


def reference(root, sentence, k):
    """transformers' tokens and, per [MASK], its position, top-k ids and whole softmax (BertForMaskedLM)."""
    from transformers import AutoTokenizer, BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(root / "hf", attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    encoded = tokenizer(sentence, return_tensors="pt")
    with torch.no_grad():
        probabilities = model(**encoded).logits.softmax(-1)[0]
    ids = encoded["input_ids"][0]
    positions = (ids == tokenizer.mask_token_id).nonzero()[:, 0].tolist()
    masks = [(p, probabilities[p].topk(k).indices.tolist(), probabilities[p].tolist()) for p in positions]
    return tokenizer.convert_ids_to_tokens(ids), masks


def tokenizer_of(root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(root / "hf")


def test_predictions_are_shown_as_transformers_shows_them():
    """Issue 52, item 6: a byte-level BPE token is shown decoded (' man', as transformers' token_str),
    not as its vocabulary entry ('Ġman'); the JSON keeps both."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models

    bpe = Tokenizer(models.BPE(vocab={"Ġman": 0, "man": 1, "<mask>": 2}, merges=[]))
    bpe.decoder = decoders.ByteLevel()
    info = SimpleNamespace(tokenizer=bpe)
    assert (fill_mask.token_name(info, 0), fill_mask.token_text(info, 0)) == ("Ġman", " man")
    assert fill_mask.token_text(info, 1) == "man" and fill_mask.token_text(info, 7) == "[id 7]"


def check_against_transformers(root, records, k, ordered=None):
    """Our top-k ids are transformers' (in order: the first `ordered` of them, default all), with
    the probabilities transformers gives those ids (1e-5)."""
    assert [r["sentence"] for r in records] == SENTENCES
    for record in records:
        tokens, masks = reference(root, record["sentence"], k)
        assert record["tokens"] == tokens
        assert [m["mask"] for m in record["masks"]] == list(range(1, len(masks) + 1))
        for ours, (position, ids, probabilities) in zip(record["masks"], masks, strict=True):
            assert ours["position"] == position
            got = [p["id"] for p in ours["predictions"]]
            assert got[:ordered] == ids[:ordered] and sorted(got) == sorted(ids)
            assert [p["token"] for p in ours["predictions"]] == [VOCAB[i] for i in got]
            assert [p["token_str"] for p in ours["predictions"]] == [tokenizer_of(root).decode([i]) for i in got]
            assert [p["probability"] for p in ours["predictions"]] == pytest.approx([probabilities[i] for i in got],
                                                                                     abs=1e-5)


def test_hugging_face_directory_gives_transformers_predictions(models, run):
    status, out, err = run("--checkpoint", models / "hf", "--json", "--top-k", 4, *SENTENCES)
    assert status == 0, err
    records = [json.loads(line) for line in out.splitlines()]  # stdout holds the JSON lines only
    assert len(records[0]["masks"]) == 1 and len(records[1]["masks"]) == 2
    assert records[1]["tokens"][3:5] == ["w6", "play"]  # lowercased as the uncased vocabulary implies
    check_against_transformers(models, records, 4)
    # the two masks of one sentence get their own lists
    assert records[1]["masks"][0]["predictions"] != records[1]["masks"][1]["predictions"]

    # the human-readable form, sentences from a file
    lines = models / "lines.txt"
    lines.write_text("\n".join(SENTENCES) + "\n")
    status, out, err = run("--checkpoint", models / "hf", "--input-file", lines, "--top-k", 4)
    assert status == 0, err
    text = out.splitlines()
    assert text[0] == SENTENCES[0] and text[2] == SENTENCES[1] and len(text) == 5
    best = records[1]["masks"][1]["predictions"]
    assert text[4] == "  [MASK] #2: " + " | ".join(f"{p['token_str']} {p['probability']:.3f}" for p in best)
    prediction = r"\S+ \d\.\d{3}"
    assert all(re.fullmatch(rf"  \[MASK\] #\d: {prediction}( \| {prediction}){{3}}", line)
               for line in text[1::2] + [text[4]])


@pytest.mark.slow
def test_native_tp2_on_two_processes_gives_the_same(models):
    # --top-k above the vocabulary: every real token from both ranks' shards, never a padding row
    outputs = run_ranks(["tools/fill_mask.py", "--checkpoint", str(models / "native-tp2"), "--tp", "2", "--json",
                         "--top-k", "300", *SENTENCES], 2, timeout=300)
    records = [json.loads(line) for line in outputs[0].stdout.splitlines() if line.startswith("{")]
    assert not [line for line in outputs[1].stdout.splitlines() if line.startswith("{")]  # rank 0 prints
    for record in records:
        for mask in record["masks"]:
            assert sorted(p["id"] for p in mask["predictions"]) == list(range(len(VOCAB)))
            assert sum(p["probability"] for p in mask["predictions"]) == pytest.approx(1.0, abs=1e-5)
    check_against_transformers(models, records, len(VOCAB), ordered=10)
    assert any(p["id"] >= 128 for r in records for m in r["masks"] for p in m["predictions"][:10])  # rank 1's shard


def test_bad_input_is_refused(models, run, tmp_path):
    status, out, err = run("--checkpoint", models / "hf", "w1 [MASK]", "w2 w3")
    assert status == 1 and "fill_mask: error: sentence 2 'w2 w3': no [MASK] to fill" in err and not out
    lines = tmp_path / "lines.txt"
    lines.write_text("w1 [MASK]\nw2\n")
    status, _, err = run("--checkpoint", models / "hf", "--input-file", lines)
    assert status == 1 and f"{lines}:2 'w2': no [MASK]" in err

    status, _, err = run("--checkpoint", models / "base", "[MASK] w1")
    assert status == 1 and "has no MLM head" in err and "BertModel" in err
    status, _, err = run("--checkpoint", models / "native-base", "[MASK] w1")
    assert status == 1 and "no trained MLM head" in err
    status, _, err = run("--checkpoint", tmp_path / "missing", "[MASK] w1")
    assert status == 1 and f"fill_mask: error: {tmp_path / 'missing'}: no such checkpoint directory" in err
    assert "Traceback" not in err

    bare = tmp_path / "no-vocab"
    shutil.copytree(models / "hf", bare)
    (bare / "vocab.txt").unlink()
    status, _, err = run("--checkpoint", bare, "[MASK] w1")
    assert status == 1 and "carries no vocabulary: pass --vocab-file" in err
    status, _, err = run("--checkpoint", models / "hf", "--tp", 2, "[MASK] w1")
    assert status == 2 and "--tp 2 needs a multiple of 2 processes" in err
    with pytest.raises(SystemExit) as usage:
        run("--checkpoint", models / "hf")  # neither sentences nor --input-file
    assert usage.value.code == 2
