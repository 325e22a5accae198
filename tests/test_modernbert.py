"""ModernBERT against transformers' ModernBertForMaskedLM (invariant 3), and its checkpoints
exchanged with transformers both ways.

Shapes: global attention every 2 and every 3 layers, windows (local_attention) smaller than the
sequence, biases off (ModernBERT's own setting) and on; transformers' eager and sdpa attention.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from distributed import REPO, run_python, run_ranks

VOCAB, SEQ = 300, 32  # byte-level BPE: 256 bytes + specials + merges
SHAPES = {
    # 4 layers, global on 0 and 2, the others +-4 tokens
    "every2-window8": dict(num_hidden_layers=4, global_attn_every_n_layers=2, local_attention=8),
    # 3 layers, global on 0, +-8 tokens, every bias there is
    "every3-window16-biases": dict(num_hidden_layers=3, global_attn_every_n_layers=3, local_attention=16,
                                   norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True),
}


def hf_config(shape: dict, implementation: str = "eager"):
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                            max_position_embeddings=128, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                            cls_token_id=2, sep_token_id=3, global_rope_theta=1000.0, local_rope_theta=100.0,
                            attn_implementation=implementation, **shape)


def randomise(model) -> None:
    """transformers initialises LayerNorms and biases to constants and the output projections
    small: make every tensor random and of order one, so that a mix-up shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0.0, 0.08)


def tiny_tokenizer_json(path) -> None:
    """A byte-level BPE tokenizer.json of < VOCAB entries with ModernBERT's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 10, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    tokenizer.save(str(path))


def saved_model(tmp_path, shape_name: str, implementation: str = "eager"):
    from transformers import ModernBertForMaskedLM

    torch.manual_seed(0)
    model = ModernBertForMaskedLM(hf_config(SHAPES[shape_name], implementation)).eval()
    randomise(model)
    path = tmp_path / f"hf-{shape_name}"
    model.save_pretrained(path)
    tiny_tokenizer_json(path / "tokenizer.json")
    return model, path


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(tmp_path, tp):
    out = tmp_path / "parity.json"
    run_ranks(["tests/_modern_parity_worker.py", str(out)], tp, timeout=600)
    result = json.loads(out.read_text())
    assert result["tp"] == tp
    assert set(result["results"]) == {f"{s}/{i}" for s in SHAPES for i in ("eager", "sdpa")}
    for case, r in result["results"].items():
        assert r["scale"] > 1.0, case  # logits are not trivially small
        assert r["padded_max_abs"] < 1e-5, (case, r)
        assert r["packed_max_abs"] < 1e-5, (case, r)  # each packed document as transformers runs it alone
        assert r["local_heads"] == 4 // tp, case  # the heads really are split over TP
        shape = SHAPES[case.split("/")[0]]
        every, layers = shape["global_attn_every_n_layers"], shape["num_hidden_layers"]
        assert r["global_layers"] == [i for i in range(layers) if i % every == 0], case
        assert r["windows"] == [shape["local_attention"] // 2], case


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_round_trip_through_every_layout_is_bit_identical(tmp_path, shape_name):
    """transformers -> native TP2 x PP2 -> reshard TP1 -> transformers: the very tensors, and a
    config.json both transformers generations read as the same model."""
    from transformers import ModernBertForMaskedLM

    from pretrain.checkpoint.hf import read_hf, write_hf
    from pretrain.checkpoint.logical import read_native, write_native

    original, path = saved_model(tmp_path, shape_name)
    ckpt = read_hf(str(path))
    assert ckpt.config.model.architecture == "modernbert" and ckpt.initialised_heads == []
    write_native(ckpt, str(tmp_path / "tp2pp2"), tp=2, pp=2)
    layouts = read_native(str(tmp_path / "tp2pp2"))
    write_native(layouts, str(tmp_path / "tp1"), tp=1, pp=1)
    back = read_native(str(tmp_path / "tp1"))
    for name, tensor in ckpt.weights.items():
        assert torch.equal(back.weights[name], tensor), name
    write_hf(back, str(tmp_path / "out"))

    theirs = load_file(path / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs.pop("decoder.weight", None)  # tied to the token embedding
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    shape = SHAPES[shape_name]
    assert config["architectures"] == ["ModernBertForMaskedLM"]
    assert config["global_attn_every_n_layers"] == shape["global_attn_every_n_layers"]  # transformers 4 keys
    assert config["global_rope_theta"] == 1000.0 and config["local_rope_theta"] == 100.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000.0  # transformers 5 keys
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 100.0
    assert config["layer_types"][0] == "full_attention" and len(config["layer_types"]) == shape["num_hidden_layers"]
    assert config["pad_token_id"] == 0 and config["cls_token_id"] == 2 and config["sep_token_id"] == 3

    reloaded, info = ModernBertForMaskedLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(5, VOCAB, (2, SEQ))
    with torch.no_grad():
        # (transformers picks its default attention for the reloaded model: equal up to rounding)
        difference = (reloaded.eval()(input_ids=ids).logits - original(input_ids=ids).logits).abs().max().item()
    assert difference < 1e-5, difference


def test_either_generation_of_config_keys_reads_as_the_same_model(tmp_path):
    """transformers 4.48+ writes global_attn_every_n_layers / *_rope_theta, transformers 5
    layer_types / rope_parameters (and fills a missing theta with 160k / 10k)."""
    from pretrain.checkpoint.hf_config import config_from_hf

    legacy = {"model_type": "modernbert", "num_hidden_layers": 6, "global_attn_every_n_layers": 3,
              "global_rope_theta": 5000.0, "local_rope_theta": 500.0, "local_attention": 64}
    new = {"model_type": "modernbert", "num_hidden_layers": 6, "sliding_window": 32,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention"] * 2,
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}
    a, b = config_from_hf(legacy, "legacy").model, config_from_hf(new, "new").model
    assert a == b and a.modern and a.global_attn_every_n_layers == 3 and a.local_attention == 64
    defaults = config_from_hf({"model_type": "modernbert", "layer_types": ["full_attention"] * 2,
                               "num_hidden_layers": 2}, "defaults").model
    assert (defaults.global_rope_theta, defaults.local_rope_theta, defaults.global_attn_every_n_layers) == \
        (160000.0, 10000.0, 1)
    from pretrain.checkpoint.errors import CheckpointError

    with pytest.raises(CheckpointError, match="layer_types .* is not 'full attention every n layers"):
        config_from_hf({**new, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"] * 2}, "odd")
    with pytest.raises(CheckpointError, match="hidden_activation is 'silu'"):
        config_from_hf({**legacy, "hidden_activation": "silu"}, "silu")


@pytest.mark.slow
def test_transformers_fill_mask_on_our_export_gives_our_fill_mask(tmp_path):
    """transformers' own pipeline('fill-mask'), in a fresh process, loads a directory we wrote
    (model and tokenizer) and predicts what our tools/fill_mask.py predicts from the source."""
    from pretrain.checkpoint.hf import read_hf, write_hf

    _, path = saved_model(tmp_path, "every2-window8")
    write_hf(read_hf(str(path)), str(tmp_path / "out"))
    sentence = "the cat [MASK] on the mat"
    script = ("import json, sys; from transformers import pipeline; "
              "p = pipeline('fill-mask', model=sys.argv[1], top_k=5); "
              "print(json.dumps([r['token'] for r in p(sys.argv[2])]))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    theirs = run_python(["-c", script, str(tmp_path / "out"), sentence], env, timeout=300)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = run_python(["tools/fill_mask.py", "--checkpoint", str(path), "--json", sentence], env, timeout=300)
    assert ours.returncode == 0, ours.stderr[-3000:]
    predictions = json.loads(ours.stdout)["masks"][0]["predictions"]
    assert [p["id"] for p in predictions] == json.loads(theirs.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_an_export_states_the_length_it_was_trained_at_to_transformers_and_sentence_transformers(tmp_path):
    """A model trained at 32 tokens (configured for 128 positions): the export's tokenizer says 32
    (transformers' model_max_length), so does its sentence-transformers config, through a native
    round trip; sentence-transformers loads a ModernBertModel export offline with no load report,
    at that length, and its embedding is the mean of the encoder's token states; config.json keeps
    the 128 positions the model addresses."""
    import logging

    from transformers import AutoModel, AutoTokenizer

    from pretrain.checkpoint.hf import read_hf, write_hf
    from pretrain.checkpoint.logical import read_native, write_native

    _, path = saved_model(tmp_path, "every2-window8")
    source = read_hf(str(path))
    assert source.trained_length is None  # a directory stating no length
    source.trained_length = 32
    native = write_native(source, str(tmp_path / "native"), tp=1, pp=1)
    assert json.loads((tmp_path / "native" / "iter_0000000" / "meta.json").read_text())["trained_seq_length"] == 32
    back = read_native(native)
    assert back.trained_length == 32
    for architecture in ("ModernBertForMaskedLM", "ModernBertModel"):
        out = tmp_path / architecture
        write_hf(back, str(out), architecture=architecture)
        assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 32
        assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == 32
        assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 128
        assert read_hf(str(out)).trained_length == 32  # and back again
    assert AutoTokenizer.from_pretrained(tmp_path / "ModernBertModel").model_max_length == 32

    from sentence_transformers import SentenceTransformer

    reports = []

    class Collect(logging.Handler):
        def emit(self, record):
            reports.append(record.getMessage())

    handler = Collect()
    logging.getLogger("transformers").addHandler(handler)
    try:
        st = SentenceTransformer(str(tmp_path / "ModernBertModel"), device="cpu", local_files_only=True)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [r for r in reports if "UNEXPECTED" in r or "MISSING" in r], reports
    assert st.max_seq_length == 32
    sentences = ["the cat sat on the mat", "a dog ran in the park " * 10]  # the second is cut at 32 tokens
    ours = st.encode(sentences, convert_to_tensor=True)
    encoder = AutoModel.from_pretrained(tmp_path / "ModernBertModel").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ModernBertModel")
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=32, return_tensors="pt")
    assert batch["input_ids"].shape[1] == 32
    with torch.no_grad():
        states = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    assert torch.allclose(ours, (states * mask).sum(1) / mask.sum(1), atol=1e-5)
