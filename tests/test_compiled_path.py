"""model.compile (pretrain/model/fused.py, pretrain/model/cross_entropy.py) on the CPU, where torch
compiles too (inductor's C++ backend): the compiled ModernBERT computes what the eager one does and
what transformers' ModernBertForMaskedLM does, and compiles once for every token count.

- Three training micro-batches with different numbers of real tokens: MLM loss, logits and every
  gradient equal the eager model's (fp32, 1e-5), and torch's compile counters stop growing after the
  first (dynamic shapes: no recompilation when the token count changes).
- The compiled model's logits equal transformers' on a padded batch (the parity test of
  test_modernbert.py, here with the compiled kernels).
- The fused cross entropy, eager and compiled, equals torch's F.cross_entropy in fp32 and bf16,
  forward and gradient, and leaves the logits as they were.

What runs compiled only on a GPU: the FlexAttention kernel and varlen attention (GPU tier,
test_attention_kernels.py). One process compiles everything here (about a minute cold on 2 cores;
inductor's cache makes later runs faster), so the multi-process layout-invariance and resume tests
run eager: the compiled kernels are pure functions proven equal to the eager ones here.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.cross_entropy import vocab_parallel_cross_entropy
from pretrain.model.fused import compile_counters

pytestmark = pytest.mark.slow  # compiles: a minute of CPU

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def micro_batches(lengths_per_batch, seq, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for lengths in lengths_per_batch:
        mask = (torch.arange(seq) < torch.tensor(lengths)[:, None]).long()
        ids = torch.randint(5, vocab, mask.shape, generator=generator) * mask
        positions = torch.stack([torch.randperm(n, generator=generator)[:3] for n in lengths])
        labels = torch.randint(5, vocab, positions.shape, generator=generator)
        out.append(((ids, torch.zeros_like(ids), mask, positions), labels))
    return out


def test_compiled_model_equals_eager_and_compiles_once(one_rank):
    from test_unpadding import tiny_modernbert

    torch._dynamo.reset()
    batches = micro_batches([[40, 17, 33], [9, 40, 40], [25, 6, 12]], 40, 96)
    runs = {}
    graphs = []
    for setting in ("false", "true"):
        model, _ = tiny_modernbert(one_rank, f"model.compile={setting}")
        model.train()
        steps = []
        for inputs, labels in batches:
            model.zero_grad()
            logits, _ = model(inputs)
            loss = vocab_parallel_cross_entropy(logits, labels, one_rank, use_compiled=setting == "true").mean()
            loss.backward()
            steps.append((loss.detach(), logits.detach(),
                          {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}))
            if setting == "true":
                graphs.append(compile_counters()["unique_graphs"])
        runs[setting] = steps
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[0] == graphs[1] == graphs[2], f"graphs compiled after each micro-batch: {graphs}"
    for (loss_e, logits_e, grads_e), (loss_c, logits_c, grads_c) in zip(runs["false"], runs["true"]):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-5)
        assert grads_c.keys() == grads_e.keys()
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_model_matches_transformers(one_rank, tmp_path):
    """test_modernbert.py's padded-batch parity (every shape's windows, eager and sdpa attention in
    transformers) with the compiled kernels."""
    from transformers import ModernBertForMaskedLM

    from pretrain.checkpoint.hf import read_hf
    from pretrain.checkpoint.sharding import load_hf_state_dict
    from pretrain.model.bert import build_model
    from pretrain.model.rng import RngTracker, seed_streams
    from test_modernbert import SHAPES, VOCAB, hf_config, randomise
    from _modern_parity_worker import padded_batch

    for name, shape in SHAPES.items():
        torch.manual_seed(1234)
        hf = ModernBertForMaskedLM(hf_config(shape, "sdpa")).eval()
        randomise(hf)
        hf.save_pretrained(tmp_path / name)
        ckpt = read_hf(str(tmp_path / name))
        m = ckpt.config.model
        m.compile = "true"
        tracker = RngTracker(torch.device("cpu"))
        seed_streams(tracker, 1, 0, 0, 0)
        model = build_model(m, m.padded_vocab_size(1), torch.float32, tracker, one_rank, binary_head=False)
        load_hf_state_dict(model, ckpt.weights, m.padded_vocab_size(1), 0, 1)
        model.eval()
        inputs, lengths = padded_batch(torch.Generator().manual_seed(5))
        with torch.no_grad():
            ours = model(inputs)[0][..., :VOCAB]
            theirs = hf(input_ids=inputs[0], attention_mask=inputs[2]).logits
        for row, n in enumerate(lengths):
            torch.testing.assert_close(ours[row, :n], theirs[row, :n], rtol=1e-4, atol=1e-4, msg=f"{name} row {row}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_compiled", [False, True])
def test_fused_cross_entropy_equals_torch(dtype, use_compiled):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 300, generator=generator) * 4).to(dtype)
    logits[..., 290:] = torch.finfo(dtype).min  # padded vocabulary entries, as MlmOutputBias sets them
    target = torch.randint(0, 290, (5, 7), generator=generator)
    upstream = torch.randn(5, 7, generator=generator)
    ours_in = logits.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_in, target, None, use_compiled)
    (ours * upstream).sum().backward()
    theirs_in = logits.clone().requires_grad_()
    theirs = F.cross_entropy(theirs_in.float().reshape(-1, 300), target.reshape(-1), reduction="none").view(5, 7)
    (theirs * upstream).sum().backward()
    assert ours.dtype == torch.float32 and ours_in.grad.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_in.grad.float(), theirs_in.grad.float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(ours_in.detach(), logits)  # the logits are left as they were


def test_compiled_bert_equals_eager_and_transformers(one_rank):
    """BERT's layers with model.compile (fused.bias_dropout_add_norm: output bias, dropout, residual
    and LayerNorm as one kernel): in training with every dropout on, three micro-batches of
    different real-token counts give the eager model's loss, logits and gradients (the keep masks
    are the same draws on the CPU, and again the same in the compiled side's recomputation) and
    compile no more after the first; in evaluation, transformers' BertForPreTraining's logits."""
    from transformers import BertConfig, BertForPreTraining

    from pretrain.checkpoint.sharding import load_hf_state_dict
    from pretrain.config import ModelConfig
    from pretrain.model import fused
    from pretrain.model.bert import PretrainingLoss, build_model
    from pretrain.model.rng import RngTracker, seed_streams

    vocab, hidden = 96, 32
    torch.manual_seed(1234)
    hf = BertForPreTraining(BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64,
                                       attn_implementation="eager")).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make them random too
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)

    def ours(setting):
        # the compiled side recomputes its layers in backward (model.recompute full): the keep masks
        # drawn again there must be the forward's
        cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=2, num_attention_heads=2,
                          ffn_hidden_size=64, max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1,
                          compile=setting, recompute="full" if setting == "true" else "none")
        tracker = RngTracker(torch.device("cpu"))
        seed_streams(tracker, 1, 0, 0, 0)
        model = build_model(cfg, cfg.padded_vocab_size(1), torch.float32, tracker, one_rank)
        load_hf_state_dict(model, hf.state_dict(), cfg.padded_vocab_size(1), 0, 1)
        return model

    torch._dynamo.reset()
    calls = []  # whether each call of the compiled kernel had a keep mask: proof that it ran, with dropout
    kernels = fused.layer_kernels("true", "cpu")
    real_kernel = kernels.bias_dropout_add_norm
    assert real_kernel is fused.compiled("bias_dropout_add_norm") and hasattr(real_kernel, "_torchdynamo_orig_callable")
    kernels.bias_dropout_add_norm = lambda *a: calls.append(a[2] is not None) or real_kernel(*a)
    batches = micro_batches([[40, 17, 33], [9, 40, 40], [25, 6, 12]], 40, vocab)
    runs, graphs = {}, []
    try:
        for setting in ("false", "true"):
            model = ours(setting)
            model.train()
            torch.manual_seed(7)  # the same dropout draws on both sides
            steps = []
            for inputs, labels in batches:
                model.zero_grad()
                mlm, nsp = model(inputs)
                weights = torch.ones_like(labels, dtype=torch.float32)
                loss = PretrainingLoss(one_rank, 0, setting)((mlm, nsp), (labels, weights, torch.zeros(3).long()))
                loss.backward()
                grads = {n: p.grad.to_dense().clone() for n, p in model.named_parameters() if p.grad is not None}
                steps.append((loss.detach(), mlm.detach(), grads))
                if setting == "true":
                    graphs.append(fused.compile_counters()["unique_graphs"])
            runs[setting] = (model, steps)
        # 2 layers x 2 residuals, in forward and again in backward's recomputation, per micro-batch
        assert len(calls) == 3 * 2 * 2 * 2 and all(calls), f"compiled kernel calls (with a keep mask?): {calls}"
        assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2], f"graphs after each micro-batch: {graphs}"
        for (loss_e, mlm_e, grads_e), (loss_c, mlm_c, grads_c) in zip(runs["false"][1], runs["true"][1]):
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mlm_c, mlm_e, rtol=1e-5, atol=1e-5)
            assert grads_c.keys() == grads_e.keys()
            for name in grads_e:
                torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)

        compiled = runs["true"][0].eval()
        calls.clear()
        inputs, _ = batches[0]
        with torch.no_grad():
            mlm, nsp = compiled(inputs)
            theirs = hf(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2])
        assert calls and not any(calls), "evaluation should run the compiled kernel without dropout"
        ref_mlm = torch.gather(theirs.prediction_logits, 1, inputs[3].unsqueeze(-1).expand(-1, -1, vocab))
        torch.testing.assert_close(mlm[..., :vocab], ref_mlm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nsp, theirs.seq_relationship_logits, rtol=1e-5, atol=1e-5)

        # the mask as dropout.keep_mask draws it off the CPU (booleans) drops what the CPU's does
        x, residual, bias, weight = torch.randn(4, 5, hidden).unbind(0)
        keep = torch.rand(5, hidden) >= 0.1
        torch.testing.assert_close(real_kernel(x, bias[0], keep, 1 / 0.9, residual, weight[0], bias[1], 1e-12),
                                   real_kernel(x, bias[0], keep.float(), 1 / 0.9, residual, weight[0], bias[1], 1e-12))
    finally:
        kernels.bias_dropout_add_norm = real_kernel
        torch._dynamo.reset()
