"""Training parity with Hugging Face: the backward pass and the optimizer step, not only the forward.

A transformers BertForPreTraining (random weights, random biases and LayerNorms) is saved in the
test; the trainer starts from it (checkpoint.init_from), dropout off, and trains 20 steps of LAMB and
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


def hugging_face_model():
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(1234)
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


def train_hugging_face(optimizer: str, overrides) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = hugging_face_model().train()
    params = dict(model.named_parameters())  # the tied decoder weight appears once, as the embedding
    states = {name: new_state(p.detach()) for name, p in params.items()}
    losses = []
    for inputs, (masked_labels, weights, nsp_labels) in global_batches(overrides):
        input_ids, token_types, padding_mask, positions = inputs
        out = model(input_ids=input_ids, token_type_ids=token_types, attention_mask=padding_mask,
                    labels=hugging_face_labels(input_ids, positions, masked_labels, weights),
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
def hugging_face_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "bert"
    hugging_face_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def references():
    return {optimizer: train_hugging_face(optimizer, PARITY) for optimizer in ("lamb", "adamw")}


def test_reference_trains(references):
    """Guards the comparison: the reference moves, and LAMB and AdamW part ways."""
    lamb, adamw = references["lamb"][0], references["adamw"][0]
    assert lamb[0] == adamw[0] and lamb[-1] < lamb[0] and abs(lamb[-1] - adamw[-1]) > 1e-3


@pytest.mark.parametrize("tp", [1, 2])
def test_training_matches_hugging_face(tmp_path, hugging_face_dir, references, tp):
    from pretrain.checkpoint.logical import read_native

    runs = [json.dumps({"name": optimizer, "overrides": PARITY + [
        f"optimizer.name={optimizer}", f"checkpoint.init_from={hugging_face_dir}", f"checkpoint.save_dir={tmp_path / optimizer}"]})
        for optimizer in ("lamb", "adamw")]
    out = tmp_path / "result.json"
    run_ranks(["tests/_train_worker.py", str(out), str(tp), "1", *runs], tp, timeout=600)
    result = json.loads(out.read_text())
    for optimizer, (losses, weights) in references.items():
        history = result[optimizer]["history"]
        assert {r["megatron_tp_size"] for r in result[optimizer]["ranks"]} == {tp}
        assert [h["learning_rate"] for h in history] == [LR] * STEPS
        assert any(h["grad_norm"] > MAX_NORM for h in history), "clipping must be exercised"
        for step, (ours, theirs) in enumerate(zip([h["loss"] for h in history], losses, strict=True), start=1):
            assert ours == pytest.approx(theirs, rel=1e-5), f"{optimizer} step {step}: {ours} vs {theirs}"
        trained = read_native(str(tmp_path / optimizer), with_optimizer=False).weights
        for name, theirs in weights.items():
            if name not in trained:
                assert name.startswith("cls.predictions.decoder."), name  # tied to the embedding and the bias
                continue
            error = (trained[name] - theirs).abs().max().item()
            assert error <= 1e-5 * theirs.abs().max().item(), f"{optimizer} {name}: max error {error:.3e}"
