"""Checkpoint interop: Hugging Face <-> native at any TP/PP, resharding, ZeRO consolidation,
resuming in another layout (transformers is the independent reference)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel

from distributed import run_python, run_ranks
from pretrain.checkpoint.format import CheckpointError
from pretrain.checkpoint.hf import read_hf, write_hf
from pretrain.checkpoint.logical import read_native, write_native

# tests/_train_worker.py's TINY model
VOCAB, HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 200, 64, 2, 4, 256, 64
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(path, size=VOCAB):
    path.write_text("\n".join(SPECIALS + [f"w{i}" for i in range(size - len(SPECIALS))]) + "\n")
    return path


def hf_model(cls=BertForPreTraining, seed=0):
    torch.manual_seed(seed)
    model = cls(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=FFN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, attn_implementation="eager"))
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_hf(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    write_vocab(path / "vocab.txt")
    return path


def tensors(path):
    return load_file(os.path.join(path, "model.safetensors"))


def hf_outputs(hf_dir, inputs):
    model = BertForPreTraining.from_pretrained(hf_dir, attn_implementation="eager").eval()
    input_ids, token_types, padding_mask, positions = inputs
    with torch.no_grad():
        out = model(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask)
    mlm = torch.gather(out.prediction_logits, 1, positions.unsqueeze(-1).expand(-1, -1, out.prediction_logits.shape[-1]))
    return mlm, out.seq_relationship_logits


# ----------------------------------------------------------------------------- file-level conversions
@pytest.mark.slow
def test_hf_to_native_tp2_pp2_to_hf_is_bit_identical(tmp_path):
    source = save_hf(hf_model(), tmp_path / "hf")
    write_native(read_hf(str(source)), str(tmp_path / "native"), tp=2, pp=2)
    meta = json.loads((tmp_path / "native" / "iter_0000000" / "meta.json").read_text())
    assert meta["layout"]["tensor_parallel"] == 2 and meta["layout"]["pipeline_parallel"] == 2
    # the files a TP2 x PP2 trainer run writes (layer_05, the tied decoder, is never saved)
    layers = sorted(f for f in os.listdir(tmp_path / "native" / "iter_0000000") if f.startswith("layer_"))
    assert layers == [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in (0, 1, 2, 3, 4, 6) for t in (0, 1)]
    write_hf(read_native(str(tmp_path / "native")), str(tmp_path / "back"))
    before, after = tensors(source), tensors(tmp_path / "back")
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    _, info = BertForPreTraining.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (tmp_path / "back" / "vocab.txt").read_text() == (source / "vocab.txt").read_text()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tokenizer("w1 w2")["input_ids"] == [2, 6, 7, 3]


@pytest.mark.slow
def test_reshard_keeps_weights_and_optimizer_state(tmp_path):
    ckpt = read_hf(str(save_hf(hf_model(), tmp_path / "hf")))
    ckpt.moments = {n: {"exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w)} for n, w in ckpt.weights.items()}
    ckpt.optimizer_step, ckpt.step, ckpt.consumed_samples, ckpt.scheduler_steps = 7, 7, 56, 7
    write_native(ckpt, str(tmp_path / "tp2pp2"), tp=2, pp=2)
    write_native(read_native(str(tmp_path / "tp2pp2")), str(tmp_path / "tp4"), tp=4, pp=1)
    back = read_native(str(tmp_path / "tp4"))
    assert (back.step, back.consumed_samples, back.optimizer_step, back.scheduler_steps) == (7, 56, 7, 7)
    for name, weight in ckpt.weights.items():
        assert torch.equal(back.weights[name], weight), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.moments[name][key], ckpt.moments[name][key]), (name, key)


def test_masked_lm_and_base_model_checkpoints(tmp_path):
    mlm = hf_model(BertForMaskedLM)
    ckpt = read_hf(str(save_hf(mlm, tmp_path / "mlm")))
    notes = "\n".join(ckpt.notes)
    assert "BertForMaskedLM has no pooler: initialised 2 tensor(s)" in notes
    assert "no next-sentence head: initialised 2 tensor(s)" in notes
    for name, value in mlm.state_dict().items():
        if name in ckpt.weights:
            assert torch.equal(ckpt.weights[name], value), name
    assert ckpt.weights["bert.pooler.dense.weight"].std() == pytest.approx(0.02, rel=0.2)

    base = hf_model(BertModel)  # no `bert.` prefix, no heads at all
    ckpt = read_hf(str(save_hf(base, tmp_path / "base")))
    for name, value in base.state_dict().items():
        assert torch.equal(ckpt.weights["bert." + name], value), name
    assert "no MLM head: initialised 5 tensor(s)" in "\n".join(ckpt.notes)


def test_legacy_pytorch_bin_names_and_tied_decoder_copy(tmp_path):
    model = hf_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    legacy = {}
    for name, value in state.items():  # TF-era spellings, decoder stored as an explicit copy
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        legacy[name] = value
    legacy["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"].clone()
    legacy["bert.embeddings.position_ids"] = torch.arange(POSITIONS)[None]
    directory = tmp_path / "legacy"
    directory.mkdir()
    model.config.save_pretrained(directory)
    torch.save(legacy, directory / "pytorch_model.bin")
    write_vocab(directory / "vocab.txt")
    ckpt = read_hf(str(directory))
    for name in ckpt.weights:
        assert torch.equal(ckpt.weights[name], state[name]), name


def _bad_hf(tmp_path, edit_state=None, edit_config=None):
    directory = save_hf(hf_model(), tmp_path / "bad")
    if edit_state:
        state = tensors(directory)
        edit_state(state)
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((directory / "config.json").read_text())
        edit_config(config)
        (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("edit_state, edit_config, message", [
    (None, lambda c: c.update(architectures=["BertLMHeadModel"]), "unknown architecture 'BertLMHeadModel'"),
    (None, lambda c: c.update(model_type="roberta"), "model_type is 'roberta'"),
    (lambda s: s.update({"bert.encoder.layer.0.output.dense.weight": torch.zeros(HIDDEN, FFN + 1)}), None,
     "bert.encoder.layer.0.output.dense.weight: file (64, 257), config.json implies (64, 256)"),
    (lambda s: s.update({"bert.encoder.layer.5.output.dense.weight": torch.zeros(1)}), None,
     "1 unexpected tensor(s) for BertForPreTraining: bert.encoder.layer.5.output.dense.weight"),
    (lambda s: s.pop("bert.encoder.layer.1.intermediate.dense.bias"), None,
     "1 missing tensor(s) for BertForPreTraining: bert.encoder.layer.1.intermediate.dense.bias"),
    (lambda s: s.pop("cls.seq_relationship.weight"), None,
     "missing tensor(s) for BertForPreTraining: cls.seq_relationship.weight"),
    (lambda s: s.update({"cls.predictions.decoder.weight": torch.zeros(VOCAB, HIDDEN)}), None, "untied MLM decoder"),
])
def test_bad_hugging_face_input_is_named(tmp_path, edit_state, edit_config, message):
    with pytest.raises(CheckpointError, match=None) as error:
        read_hf(_bad_hf(tmp_path, edit_state, edit_config))
    assert message in str(error.value)


def test_layout_errors_and_nothing_half_written(tmp_path, monkeypatch):
    ckpt = read_hf(str(save_hf(hf_model(), tmp_path / "hf")))
    with pytest.raises(CheckpointError, match="TP 3 does not divide the 4 attention heads"):
        write_native(ckpt, str(tmp_path / "out"), tp=3, pp=1)
    with pytest.raises(CheckpointError, match="PP 3 exceeds the 2 transformer layers"):
        write_native(ckpt, str(tmp_path / "out"), tp=1, pp=3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        write_native(ckpt, str(tmp_path / "full"), tp=1, pp=1)

    saved = []

    def failing_save(obj, path, *args, **kwargs):  # the disk fills up at the third file
        saved.append(path)
        if len(saved) == 3:
            raise OSError("No space left on device")
        return real_save(obj, path, *args, **kwargs)

    real_save = torch.save
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        write_native(ckpt, str(tmp_path / "out"), tp=2, pp=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["full", "hf"]  # no output, no temporary directory

    write_native(ckpt, str(tmp_path / "out"), tp=2, pp=2)
    tag = tmp_path / "out" / "iter_0000000"
    os.remove(tag / "layer_03-model_01-model_states.pt")
    os.remove(tag / "mp_rank_02_model_states.pt")
    with pytest.raises(CheckpointError, match="missing 2 of its 17 files besides meta.json: layer_03-model_01-model_states.pt, mp_rank_02_model_states.pt"):
        read_native(str(tmp_path / "out"))
    os.remove(tmp_path / "out" / "latest")
    with pytest.raises(CheckpointError, match=f"no 'latest' file; pass a complete checkpoint: {tag}$"):
        read_native(str(tmp_path / "out"))
    (tag / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="not a checkpoint of this trainer"):
        read_native(str(tag))
    with pytest.raises(CheckpointError, match="carries no vocab.txt"):
        ckpt.vocab_dir = None
        write_hf(ckpt, str(tmp_path / "o"))


@pytest.mark.slow
def test_command_line_tool(tmp_path):
    source = save_hf(hf_model(), tmp_path / "hf")
    def run(*args):
        return run_python(["tools/convert_checkpoint.py", *map(str, args)])

    done = run("hf-to-native", "--input", source, "--output", tmp_path / "native", "--tp", 2, "--pp", 2)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    done = run("reshard", "--input", tmp_path / "native", "--output", tmp_path / "tp1", "--tp", 1, "--pp", 1)
    assert done.returncode == 0, done.stderr
    assert "optimizer state: none in the input" in done.stdout
    done = run("native-to-hf", "--input", tmp_path / "tp1", "--output", tmp_path / "back")
    assert done.returncode == 0, done.stderr
    assert all(torch.equal(a, b) for a, b in zip(tensors(source).values(), tensors(tmp_path / "back").values()))
    bad = run("hf-to-native", "--input", tmp_path / "native", "--output", tmp_path / "x", "--tp", 1, "--pp", 1)
    assert bad.returncode == 1
    assert bad.stderr.startswith("convert_checkpoint: error: ") and "(it is a native checkpoint)" in bad.stderr and "config.json is missing" in bad.stderr
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- the model, in every layout
def worker(tmp_path, name, tp, pp, world, runs):
    out = tmp_path / f"{name}.pt"
    run_ranks(["tests/_interop_worker.py", str(out), str(tp), str(pp), *map(json.dumps, runs)], world, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_converted_hugging_face_model_gives_its_logits(tmp_path, tp, pp):
    save_hf(hf_model(), tmp_path / "hf")
    write_native(read_hf(str(tmp_path / "hf")), str(tmp_path / "native"), tp=tp, pp=pp)
    # PP2 resumes from the converted checkpoint (checkpoint.load_dir: step 0, no optimizer state yet);
    # the others start a run from it (checkpoint.init_from)
    key = "checkpoint.load_dir" if pp > 1 else "checkpoint.init_from"
    runs = [{"name": "pretraining", "train": False, "overrides": [f"{key}={tmp_path / 'native'}"]}]
    if pp == 1:  # a BertModel checkpoint straight from its directory: the encoder's outputs
        save_hf(hf_model(BertModel, seed=3), tmp_path / "base")
        runs.append({"name": "base", "train": False, "encode": True, "overrides": [f"checkpoint.init_from={tmp_path / 'base'}"]})
    result = worker(tmp_path, "parity", tp, pp, tp * pp, runs)
    ours = result["pretraining"]
    mlm, nsp = hf_outputs(tmp_path / "hf", ours["inputs"])
    assert mlm.abs().max() > 0.1
    assert (ours["mlm"] - mlm).abs().max() < 1e-5
    assert (ours["nsp"] - nsp).abs().max() < 1e-5
    if pp == 1:
        base = BertModel.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
        input_ids, token_types, padding_mask, _ = result["base"]["inputs"]
        with torch.no_grad():
            ref = base(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask)
        assert (result["base"]["hidden"] - ref.last_hidden_state).abs().max() < 1e-5
        assert (result["base"]["pooled"] - ref.pooler_output).abs().max() < 1e-5


STEPS = ["train.train_steps=6", "optimizer.name=lamb"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 of 6 steps at TP2 x PP2 x DP2 with ZeRO-1, saved, with the model's outputs after them."""
    tmp = tmp_path_factory.mktemp("trained")
    ckpt = tmp / "zero1"
    result = worker(tmp, "zero1", 2, 2, 8, [{"name": "zero1", "overrides": STEPS + [
        "parallel.zero_stage=1", f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=3"]}])["zero1"]
    return ckpt, result


def assert_hf_matches(tmp_path, native_dir, result):
    write_hf(read_native(str(native_dir)), str(tmp_path / "hf"), vocab_file=str(write_vocab(tmp_path / "vocab.txt")))
    mlm, nsp = hf_outputs(tmp_path / "hf", result["inputs"])
    assert (result["mlm"] - mlm).abs().max() < 1e-5
    assert (result["nsp"] - nsp).abs().max() < 1e-5


@pytest.mark.slow
def test_zero1_tp2_pp2_dp2_checkpoint_converts_to_hugging_face(tmp_path, trained):
    ckpt, result = trained
    assert len(result["history"]) == 3
    assert_hf_matches(tmp_path, ckpt, result)


@pytest.mark.slow
def test_resume_in_other_layouts_continues_the_run(tmp_path, trained):
    """Steps 4-6 resumed from the TP2 x PP2 x DP2 ZeRO-1 checkpoint (directly at TP2 x DP2 with
    ZeRO-3 and with ZeRO-2; after `reshard` to TP1 on one process) equal six steps straight on
    one process. The ZeRO-3 run also saves its own checkpoint, which converts to Hugging Face."""
    zero1, first = trained
    resharded = tmp_path / "tp1"
    write_native(read_native(str(zero1)), str(resharded), tp=1, pp=1)
    single = worker(tmp_path, "single", 1, 1, 1, [
        {"name": "straight", "overrides": STEPS},
        {"name": "resharded", "overrides": STEPS + [f"checkpoint.load_dir={resharded}"]},
    ])
    tp2dp2 = worker(tmp_path, "tp2dp2", 2, 1, 4, [
        {"name": "zero3", "overrides": STEPS + ["parallel.zero_stage=3", f"checkpoint.load_dir={zero1}",
                                                f"checkpoint.save_dir={tmp_path / 'zero3'}"]},
        {"name": "zero2", "overrides": STEPS + ["parallel.zero_stage=2", f"checkpoint.load_dir={zero1}"]},
    ])
    straight = single["straight"]["history"]
    for name, resumed in (("resharded", single["resharded"]["history"]), ("zero3", tp2dp2["zero3"]["history"]),
                          ("zero2", tp2dp2["zero2"]["history"])):
        assert len(resumed) == 3, name
        for step, (a, b) in enumerate(zip(first["history"] + resumed, straight), start=1):
            for key in ("loss", "lm_loss", "nsp_loss", "grad_norm", "learning_rate"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), f"{name} step {step} {key}"
    assert_hf_matches(tmp_path, tmp_path / "zero3", tp2dp2["zero3"])


@pytest.mark.slow
@pytest.mark.parametrize("zero, world", [(0, 1), (1, 1), (3, 2)])
def test_bf16_checkpoints_convert_from_their_fp32_masters(tmp_path, zero, world):
    """bf16 runs keep fp32 master weights (ZeRO-0: per parameter; ZeRO-1: DeepSpeed's BF16_Optimizer's
    flat partitions, fp32 accumulation; ZeRO-3: partitioned); the conversion takes those, not the
    bf16 copies the model computes with."""
    from pretrain.checkpoint.format import checkpoint_param_names
    from pretrain.config import ModelConfig

    save_dir = tmp_path / "bf16"
    accumulation = ["train.grad_accum_dtype=bf16"] if zero == 0 else []  # fp32 accumulation needs ZeRO >= 1
    result = worker(tmp_path, "bf16", 1, 1, world, [{"name": "bf16", "overrides": [
        "train.train_steps=3", "train.precision=bf16", f"parallel.zero_stage={zero}", f"checkpoint.save_dir={save_dir}",
        *accumulation]}])
    ckpt = read_native(str(save_dir))
    query = ckpt.weights["bert.encoder.layer.0.attention.self.query.weight"]
    assert not torch.equal(query, query.bfloat16().float())  # fp32 precision, not bf16 values
    if zero == 0:  # the module states hold the bf16 copies of exactly these masters
        module = torch.load(save_dir / "iter_0000003" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        for _, name, hf_name in checkpoint_param_names(ModelConfig(num_layers=LAYERS), pipelined=False):
            master = ckpt.weights[hf_name]
            stored = module[name][: master.shape[0]] if master.shape[0] == VOCAB else module[name]
            assert torch.equal(master.bfloat16(), stored), name
    write_hf(ckpt, str(tmp_path / "hf"), vocab_file=str(write_vocab(tmp_path / "vocab.txt")))
    mlm, nsp = hf_outputs(tmp_path / "hf", result["bf16"]["inputs"])  # fp32 vs the run's bf16 arithmetic
    assert (result["bf16"]["mlm"].float() - mlm).abs().max() < 0.1 * mlm.abs().max()
    assert (result["bf16"]["nsp"].float() - nsp).abs().max() < 0.1 * nsp.abs().max() + 0.05


@pytest.mark.slow
def test_bf16_resumes_across_gradient_dtypes(tmp_path):
    """train.grad_accum_dtype picks DeepSpeed's ZeRO-1 wrapper (bf16: DeepSpeedZeroOptimizer, fp32:
    BF16_Optimizer), whose files the other cannot load exactly: a run saved with bf16 accumulation
    (as every bf16 run before fp32 became the default) resumes with fp32 layout-free, with its step,
    weights and moments."""
    ckpt = tmp_path / "ckpt"
    common = ["train.train_steps=4", "train.precision=bf16", "parallel.zero_stage=1", f"checkpoint.save_dir={ckpt}",
              f"checkpoint.load_dir={ckpt}"]
    first = worker(tmp_path, "bf16-accumulation", 1, 1, 1, [{"name": "first", "overrides": common + [
        "train.grad_accum_dtype=bf16", "resilience.exit_after_steps=2"]}])["first"]
    run = {"name": "second", "overrides": common}
    out = run_ranks(["tests/_interop_worker.py", str(tmp_path / "second.pt"), "1", "1", json.dumps(run)], 1,
                    timeout=900)[0].stdout
    second = torch.load(tmp_path / "second.pt", weights_only=False)["second"]
    assert len(first["history"]) == 2 and len(second["history"]) == 2
    assert "grad_accum_dtype: checkpoint bf16 vs run fp32: loaded layout-free (weights, optimizer state" in out, out[-3000:]
    assert "resumed from" in out and "at step 2 " in out
    assert second["history"][0]["loss"] == pytest.approx(first["history"][-1]["loss"], rel=0.05)


@pytest.mark.slow
def test_no_binary_head_trains_mlm_only_and_converts_to_masked_lm(tmp_path):
    """data.segment_pairs none (Megatron's --bert-no-binary-head): at TP2 x PP2 the model has no
    pooler and no next-sentence classifier, the loss is the MLM loss alone, and the checkpoint
    converts to a BertForMaskedLM directory that transformers loads with no missing or unexpected
    key and that gives our MLM logits."""
    ckpt = tmp_path / "ckpt"
    result = worker(tmp_path, "mlm-only", 2, 2, 4, [{"name": "mlm", "overrides": [
        "data.segment_pairs=none", "train.train_steps=3", f"checkpoint.save_dir={ckpt}"]}])["mlm"]
    assert result["nsp"] is None
    assert all(h["loss"] == h["lm_loss"] and h["nsp_loss"] == 0 for h in result["history"])
    tag_dir = ckpt / "iter_0000003"
    assert json.loads((tag_dir / "meta.json").read_text())["model_shape"]["binary_head"] is False
    saved = set()
    for path in tag_dir.glob("*model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved |= set(state["module"] if state.get("module") is not None else state)
    assert any("mlm_dense" in name for name in saved)
    assert not [name for name in saved if "pooler" in name or "nsp." in name]

    native = read_native(str(ckpt))
    assert native.initialised_heads == ["next-sentence head", "pooler"]
    out = tmp_path / "hf"
    write_hf(native, str(out), vocab_file=str(write_vocab(tmp_path / "vocab.txt")))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    assert not [name for name in tensors(out) if name.startswith(("bert.pooler.", "cls.seq_relationship."))]
    model, info = BertForMaskedLM.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    input_ids, token_types, padding_mask, positions = result["inputs"]
    with torch.no_grad():
        logits = model.eval()(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask).logits
    mlm = torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    assert mlm.abs().max() > 0.1 and (result["mlm"] - mlm).abs().max() < 1e-5
