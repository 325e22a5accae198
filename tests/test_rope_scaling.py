"""model.rope_scaling (pretrain/config/rope_scaling.py, pretrain/model/rotary.py) against
transformers' ModernBertForMaskedLM with the same rope_parameters: linear, dynamic NTK and YaRN (its
default attention factor and an explicit one with betas), for both layer kinds and per kind; the
scaling round-trips through config.json both ways; BERT refuses it; a bad spec is one line naming
the key. Each case also checks that the scaling took effect (the logits move against the unscaled
model).
"""
import json

import pytest
import torch

from test_modernbert import VOCAB, hf_config, randomise, tiny_tokenizer_json

SEQ = 40
CASES = {
    "linear": {"full_attention": {"rope_type": "linear", "factor": 4.0}},
    # max_position_embeddings 16 below: a 40-token row grows the base
    "dynamic": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                "sliding_attention": {"rope_type": "dynamic", "factor": 2.0}},
    "yarn": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "yarn-explicit": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
                                         "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
                      "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
}


def hf_model(rope: dict | None, max_positions: int):
    from transformers import ModernBertForMaskedLM

    config = hf_config(dict(num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=8))
    config.max_position_embeddings = max_positions
    for layer_type in ("full_attention", "sliding_attention"):
        params = {"rope_type": "default", **((rope or {}).get(layer_type) or {})}
        config.rope_parameters[layer_type] = {**params, "rope_theta": config.rope_parameters[layer_type]["rope_theta"]}
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(config).eval()
    randomise(model)
    return model


def our_logits(tp_group, path, ids, mask):
    from pretrain.checkpoint.hf import read_hf
    from pretrain.checkpoint.sharding import load_hf_state_dict
    from pretrain.model.bert import build_model
    from pretrain.model.rng import RngTracker, seed_streams

    ckpt = read_hf(str(path))
    m = ckpt.config.model
    padded = m.padded_vocab_size(1)
    tracker = RngTracker(torch.device("cpu"))
    seed_streams(tracker, 1, 0, 0, 0)
    model = build_model(m, padded, torch.float32, tracker, tp_group, binary_head=False)
    load_hf_state_dict(model, ckpt.weights, padded, 0, 1)
    model.eval()
    every = torch.arange(SEQ).expand(ids.shape[0], SEQ).contiguous()  # every position predicted
    with torch.no_grad():
        return model((ids, torch.zeros_like(ids), mask, every))[0][..., :VOCAB], ckpt.config.model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_with_the_same_rope_scaling(one_rank, tmp_path, case):
    from transformers import ModernBertForMaskedLM

    from pretrain.checkpoint.hf import read_hf, write_hf

    max_positions = 16 if case == "dynamic" else 64
    theirs_model = hf_model(CASES[case], max_positions)
    theirs_model.save_pretrained(tmp_path / "hf")
    tiny_tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (2, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0  # row 0 fills the row: dynamic NTK's length is the same on both sides
    ids[1, 29:] = 0
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids, attention_mask=mask).logits
        unscaled = hf_model(None, max_positions)(input_ids=ids, attention_mask=mask).logits
    ours, m = our_logits(one_rank, tmp_path / "hf", ids, mask)
    real = mask.bool()
    difference = (ours[real] - theirs[real]).abs().max().item()
    assert difference < 1e-5, difference
    assert (unscaled[real] - theirs[real]).abs().max().item() > 1e-2  # the scaling changed the model
    # read as transformers wrote it, per layer kind
    expected = {kind: CASES[case].get(layer_type) for kind, layer_type in
                (("global", "full_attention"), ("local", "sliding_attention"))}
    assert {kind: m.rope_scaling_of(kind == "global") for kind in expected} == expected

    write_hf(read_hf(str(tmp_path / "hf")), str(tmp_path / "out"))  # and written back: transformers reads the same
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    for layer_type, params in CASES[case].items():
        assert {k: v for k, v in written[layer_type].items() if k != "rope_theta"} == params
    with torch.no_grad():
        reloaded = ModernBertForMaskedLM.from_pretrained(tmp_path / "out").eval()
        again = reloaded(input_ids=ids, attention_mask=mask).logits
    assert (again[real] - theirs[real]).abs().max().item() < 1e-5


def test_one_spec_applies_to_both_kinds_and_problems_name_the_key():
    from pretrain.config import ConfigError, load_config

    spec = "{rope_type: yarn, factor: 4, original_max_position_embeddings: 8192}"
    cfg = load_config(None, ["model.architecture=modernbert", f"model.rope_scaling={spec}"])
    assert cfg.model.rope_scaling_of(True) == cfg.model.rope_scaling_of(False) == {
        "rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}
    per_kind = load_config(None, ["model.architecture=modernbert", f"model.rope_scaling={{global: {spec}}}"])
    assert per_kind.model.rope_scaling_of(False) is None and per_kind.model.rope_scaling_of(True)["factor"] == 4
    bad = {
        "{rope_type: ntk, factor: 2}": r"model.rope_scaling.rope_type \('ntk'\) must be one of: linear, dynamic, yarn",
        "{rope_type: yarn, factor: 4}": "model.rope_scaling: yarn needs original_max_position_embeddings",
        "{rope_type: linear, factor: 0.5}": r"model.rope_scaling.factor \(0.5\) must be >= 1",
        "{rope_type: linear, factor: 2, beta_fast: 3}": "linear takes factor; unknown: beta_fast",
        "{global: {rope_type: dynamic}}": "model.rope_scaling.global: dynamic needs factor",
        "{sliding: {rope_type: linear, factor: 2}}": r"unknown keys \['sliding'\]",
        "4": "model.rope_scaling must be a mapping or null, got int 4",
    }
    for value, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["model.architecture=modernbert", f"model.rope_scaling={value}"]).validate(1)
    with pytest.raises(ConfigError, match="model.rope_scaling is for ModernBERT's rotary positions"):
        load_config(None, ["model.rope_scaling={rope_type: linear, factor: 2}"]).validate(1)


def test_a_config_json_rope_scaling_reads_for_both_kinds():
    """transformers' older spelling: a top-level rope_scaling applies to both kinds (as
    ModernBertConfig reads it); YaRN without original_max_position_embeddings takes
    max_position_embeddings, as transformers' standardize_rope_params does."""
    from pretrain.checkpoint.hf_config import config_from_hf

    hf = {"model_type": "modernbert", "num_hidden_layers": 3, "max_position_embeddings": 1024,
          "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    m = config_from_hf(hf, "legacy").model
    assert m.rope_scaling == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    assert (m.global_rope_theta, m.local_rope_theta) == (160000.0, 10000.0)


def test_a_run_from_a_checkpoints_weights_may_set_its_own_context_length_and_rotary_scaling(tmp_path):
    """The weights of a ModernBERT do not depend on its context length or rotary settings: a run
    from a Hugging Face directory (weights alone, no new phase) may change them, not its shape."""
    from pretrain.checkpoint.starting_point import load_run_config, starting_point_problems

    hf_model(None, 128).config.save_pretrained(tmp_path / "hf")
    start = ["data.segment_pairs=none", f"checkpoint.init_from={tmp_path / 'hf'}", "data.seq_length=512",
             "model.max_position_embeddings=512", "data.max_predictions_per_seq=null"]
    longer = load_run_config(None, start + ["model.rope_scaling={rope_type: yarn, factor: 4, "
                                            "original_max_position_embeddings: 128}"])
    assert longer.model.modern and longer.model.hidden_size == 64  # the shape taken from config.json
    assert starting_point_problems(longer) == []
    wider = load_run_config(None, start + ["model.hidden_size=128"])
    (problem,) = starting_point_problems(wider)
    assert "model.hidden_size: run 128, checkpoint 64" in problem
