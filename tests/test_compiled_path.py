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
