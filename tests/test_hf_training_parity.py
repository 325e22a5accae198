"""Training parity with Hugging Face: the backward pass and the optimizer step, not only the forward.

A transformers BertForPreTraining, and a ModernBertForMaskedLM (random weights, random biases and
LayerNorms) are saved in the test; the trainer starts from it (checkpoint.init_from), dropout off, and trains 20 steps of LAMB and
of AdamW with gradient accumulation (micro-batch 2 x 4) and clipping, at TP1 and TP2. The test
trains the transformers model on the same global batches with an optimizer written here from
the formulas (no code of ours): per-step losses must agree within 1e-5 relative, and the weights
after 20 steps, read back from our checkpoint, within 1e-5 of each tensor's scale.

Our side runs its own autograd pieces (sparse embedding gradient, vocabulary-parallel cross
entropy, the fused QKV projection, TP all-reduces, the global-token-mean MLM loss over
micro-batches); the transformers side runs stock PyTorch.
"""
import json

import pytest
import torch

from _train_worker import TINY
from distributed import run_ranks
from test_lamb import new_state, ref_lamb_step
from test_layout_invariance import expected_groups

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

STEPS, LR, MAX_NORM, WEIGHT_DECAY, BETAS, EPS = 20, 1e-3, 1.0, 0.01, (0.9, 0.999), 1e-6
PARITY = [f"train.train_steps={STEPS}", "scheduler.warmup_steps=0", "scheduler.decay=constant", f"optimizer.lr={LR}",
          f"optimizer.grad_clip={MAX_NORM}"]
# ModernBERT: 4 layers, global attention on 0 and 2, windows of +-4 tokens on rows of 32, the
# MLP and LayerNorm biases on; no next-sentence head (the trainer's data then has single segments)
MODERN = ["model.architecture=modernbert", "data.segment_pairs=none", "model.num_layers=4", "model.ffn_hidden_size=96",
          "model.global_attn_every_n_layers=2", "model.local_attention=8", "model.layernorm_epsilon=1e-5",
          "model.norm_bias=true", "model.mlp_bias=true"]
FAMILIES = {"bert": PARITY, "modernbert": PARITY + MODERN}


def hugging_face_model(family: str = "bert"):
    from transformers import BertConfig, BertForPreTraining, ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(1234)
    if family == "modernbert":
        model = ModernBertForMaskedLM(ModernBertConfig(
            vocab_size=200, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, norm_bias=True,
            mlp_bias=True, pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
            attn_implementation="sdpa"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        return model
    model = BertForPreTraining(BertConfig(
        vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager"))
    with torch.no_grad():  # transformers starts biases and LayerNorms at constants: make them random too
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def global_batches(overrides):
    """The trainer's global batches: samples 8s .. 8s+7 of its dataset at step s."""
    from pretrain.config import load_config
    from pretrain.data.samples.provider import pretraining_datasets
    from pretrain.data.samples.batches import collate, split_inputs_labels

    cfg = load_config(None, TINY + overrides)
    data, _, _ = pretraining_datasets(cfg, is_builder=True, barrier=None)
    size = cfg.train.global_batch_size
    for step in range(STEPS):
        yield split_inputs_labels(collate([data[i] for i in range(step * size, (step + 1) * size)]),
                                  torch.device("cpu"))


def hugging_face_labels(input_ids, positions, masked_labels, weights):
    labels = torch.full_like(input_ids, -100)
    for row in range(input_ids.shape[0]):
        keep = weights[row] > 0
        labels[row, positions[row][keep]] = masked_labels[row][keep]
    return labels


def adamw_step(w, g, st, lr, wd):
    """torch.optim.AdamW's update, written from its documented algorithm."""
    b1, b2 = BETAS
    st["t"] += 1
    w = w * (1 - lr * wd)
    st["m"] = b1 * st["m"] + (1 - b1) * g
    st["v"] = b2 * st["v"] + (1 - b2) * g * g
    m_hat, v_hat = st["m"] / (1 - b1 ** st["t"]), st["v"] / (1 - b2 ** st["t"])
    return w - lr * m_hat / (v_hat.sqrt() + EPS)


def train_hugging_face(optimizer: str, family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = hugging_face_model(family).train()
    params = dict(model.named_parameters())  # the tied decoder weight appears once, as the embedding
    states = {name: new_state(p.detach()) for name, p in params.items()}
    losses = []
    for inputs, (masked_labels, weights, nsp_labels) in global_batches(FAMILIES[family]):
        input_ids, token_types, padding_mask, positions = inputs
        labels = hugging_face_labels(input_ids, positions, masked_labels, weights)
        if family == "modernbert":
            out = model(input_ids=input_ids, attention_mask=padding_mask, labels=labels)
        else:
            out = model(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask, labels=labels,
                        next_sentence_label=nsp_labels)
        model.zero_grad()
        out.loss.backward()
        losses.append(out.loss.item())
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params.values())).item()
        clip = min(1.0, MAX_NORM / (norm + 1e-6))
        with torch.no_grad():
            for name, p in params.items():
                decay, adapt = expected_groups(name, embeddings_decay=True)
                g = p.grad * clip
                if optimizer == "lamb":
                    new = ref_lamb_step(p.detach(), g, states[name], LR, wd=decay, adapt=adapt, betas=BETAS, eps=EPS)
                else:
                    new = adamw_step(p.detach(), g, states[name], LR, decay)
                p.copy_(new)
    return losses, {name: p.detach().clone() for name, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def hugging_face_dirs(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        paths[family] = tmp_path_factory.mktemp("hf") / family
        hugging_face_model(family).save_pretrained(paths[family])
    return paths


@pytest.fixture(scope="module")
def references():
    return {family: {optimizer: train_hugging_face(optimizer, family) for optimizer in ("lamb", "adamw")}
            for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_trains(references, family):
    """Guards the comparison: the reference moves, and LAMB and AdamW part ways."""
    lamb, adamw = references[family]["lamb"][0], references[family]["adamw"][0]
    assert lamb[0] == adamw[0] and lamb[-1] < lamb[0] and abs(lamb[-1] - adamw[-1]) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
def test_training_matches_hugging_face(tmp_path, hugging_face_dirs, references, tp, family):
    from pretrain.checkpoint.logical import read_native
    from pretrain.checkpoint.modernbert_hf import to_hf

    runs = [json.dumps({"name": optimizer, "overrides": FAMILIES[family] + [
        f"optimizer.name={optimizer}", f"checkpoint.init_from={hugging_face_dirs[family]}",
        f"checkpoint.save_dir={tmp_path / optimizer}"]})
        for optimizer in ("lamb", "adamw")]
    out = tmp_path / "result.json"
    run_ranks(["tests/_train_worker.py", str(out), str(tp), "1", *runs], tp, timeout=600)
    result = json.loads(out.read_text())
    for optimizer, (losses, weights) in references[family].items():
        history = result[optimizer]["history"]
        assert {r["megatron_tp_size"] for r in result[optimizer]["ranks"]} == {tp}
        assert [h["learning_rate"] for h in history] == [LR] * STEPS
        assert any(h["grad_norm"] > MAX_NORM for h in history), "clipping must be exercised"
        for step, (ours, theirs) in enumerate(zip([h["loss"] for h in history], losses, strict=True), start=1):
            assert ours == pytest.approx(theirs, rel=1e-5), f"{optimizer} step {step}: {ours} vs {theirs}"
        ckpt = read_native(str(tmp_path / optimizer), with_optimizer=False)
        assert ckpt.config.model.architecture == family
        trained = {name: to_hf(name, t, ckpt.config) if family == "modernbert" else t for name, t in ckpt.weights.items()}
        for name, theirs in weights.items():
            if name not in trained:  # tied to the embedding (and BERT's to the MLM bias)
                assert name.startswith(("cls.predictions.decoder.", "decoder.weight")), name
                continue
            error = (trained[name] - theirs).abs().max().item()
            assert error <= 1e-5 * theirs.abs().max().item(), f"{optimizer} {name}: max error {error:.3e}"
