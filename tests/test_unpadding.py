"""ModernBERT, and BERT's pretraining forward, compute real tokens only (pretrain/model/unpadding.py),
and what every layer derives from a micro-batch is built once (pretrain/model/micro_batch.py):

- unpadding keeps every real token with its sample id, position, masked and [CLS] positions,
  drops every padding token, and `repad` puts them back; a row with padding between real tokens is
  refused naming the row; a batch of padding only keeps one token;
- the model gives the same MLM logits for a batch padded and for the same samples packed, and
  counts computed tokens as the real ones;
- a forward builds the rotary tables and attention masks of a micro-batch once per layer kind
  whatever the number of layers, and recomputation in backward builds nothing new;
- BERT: its layers get one row of the real tokens, build each micro-batch's attention plan once
  whatever the number of layers, and refuse padding between real tokens naming the row (its
  transformers parity on padded batches: test_hf_parity.py).
"""
import os

import pytest
import torch

from pretrain.config import load_config
from pretrain.model.unpadding import PaddingLayoutError, repad, unpad_packed, unpad_padded

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN = 4


def padded_batch():
    """Rows of 3, 6, 1 and 0... real tokens (right-padded, one left-padded row), seq 6."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1],
                         [0, 0, 1, 1, 0, 0],
                         [1, 0, 0, 0, 0, 0]])
    hidden = torch.arange(mask.numel() * HIDDEN, dtype=torch.float32).view(*mask.shape, HIDDEN)
    masked = torch.tensor([[2, 0], [5, 1], [3, 2], [0, 0]])  # columns; row 2's first real token is column 2
    return hidden, mask, masked


def test_padded_rows_become_one_row_of_their_real_tokens():
    hidden, mask, masked = padded_batch()
    t = unpad_padded(hidden.clone().requires_grad_(), mask, masked)
    real = mask.bool()
    assert t.hidden.shape == (1, int(real.sum()), HIDDEN)
    torch.testing.assert_close(t.hidden[0], hidden[real], rtol=0, atol=0)  # row by row, in order
    assert t.sample_ids[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 4]
    assert t.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 2, 3, 0]  # columns: transformers' positions
    flat = t.hidden[0]
    for row in range(mask.shape[0]):
        for slot in range(masked.shape[1]):
            column = int(masked[row, slot])
            if mask[row, column]:  # a real position: the same vector after the move
                assert torch.equal(flat[t.masked_positions[row, slot]], hidden[row, column])
        # [CLS] is each row's first real token
        assert torch.equal(flat[t.cls_positions[row]], hidden[row, int(real[row].nonzero()[0])])
    torch.testing.assert_close(repad(t.hidden, mask), hidden * mask[..., None], rtol=0, atol=0)


def test_packed_rows_drop_their_trailing_padding():
    sample_ids = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0]])
    position_ids = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])
    hidden = torch.randn(2, 6, HIDDEN)
    masked = torch.tensor([[1, 4], [0, 0], [7, 9]])  # flat into rows x seq
    cls = torch.tensor([0, 2, 6])
    t = unpad_packed(hidden, sample_ids, masked, position_ids, cls)
    real = sample_ids != 0
    torch.testing.assert_close(t.hidden[0], hidden[real], rtol=0, atol=0)
    assert t.sample_ids[0].tolist() == [1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert t.position_ids[0].tolist() == [0, 1, 0, 1, 2, 0, 1, 2, 3]
    flat_before = hidden.reshape(-1, HIDDEN)
    assert torch.equal(t.hidden[0][t.masked_positions], flat_before[masked])
    assert t.cls_positions.tolist() == [0, 2, 5]
    torch.testing.assert_close(repad(t.hidden, sample_ids), hidden * real[..., None], rtol=0, atol=0)


def test_padding_between_real_tokens_is_refused_naming_the_row():
    hidden, mask, masked = padded_batch()
    mask[1, 3] = 0
    with pytest.raises(PaddingLayoutError, match=r"row 1 of the batch has padding between real tokens"):
        unpad_padded(hidden, mask, masked)


def test_a_batch_of_padding_only_keeps_one_token():
    hidden = torch.randn(2, 3, HIDDEN)
    t = unpad_padded(hidden, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))
    assert t.hidden.shape == (1, 1, HIDDEN) and t.masked_positions.tolist() == [[0], [0]]
    assert repad(t.hidden, torch.zeros(2, 3)).shape == (2, 3, HIDDEN)


# ------------------------------------------------------------------------------------ the model


def tiny_modernbert(tp_group, *overrides):
    from pretrain.model.bert import build_model, init_weights
    from pretrain.model.rng import RngTracker, seed_streams

    cfg = load_config(os.path.join(REPO, "configs", "modernbert-tiny.yaml"),
                      ["model.vocab_size=96", "model.max_position_embeddings=64", "model.local_attention=4",
                       "model.hidden_dropout=0.0", "model.attention_dropout=0.0", *overrides])
    tracker = RngTracker(torch.device("cpu"))
    seed_streams(tracker, 1, 0, 0, 0)
    padded_vocab = cfg.model.padded_vocab_size(1)
    model = build_model(cfg.model, padded_vocab, torch.float32, tracker, tp_group, binary_head=False)
    init_weights(model, cfg.model, 7, 0, 1)
    return model, cfg


def samples(lengths, seq, vocab, generator):
    from pretrain.data.samples.batches import SAMPLE_FIELDS

    out = []
    for n in lengths:
        ids = torch.zeros(seq, dtype=torch.long)
        ids[:n] = torch.randint(5, vocab, (n,), generator=generator)
        positions = torch.zeros(4, dtype=torch.long)
        positions[: min(4, n)] = torch.randperm(n, generator=generator)[:4]
        out.append({"input_ids": ids.numpy(), "token_type_ids": torch.zeros(seq, dtype=torch.long).numpy(),
                    "padding_mask": (torch.arange(seq) < n).long().numpy(), "masked_positions": positions.numpy(),
                    "masked_labels": torch.randint(5, vocab, (4,), generator=generator).numpy(),
                    "masked_weights": (torch.arange(4) < min(4, n)).float().numpy(),
                    "nsp_label": torch.tensor(0).numpy()})
        assert set(out[-1]) == set(SAMPLE_FIELDS)
    return out


def test_padded_and_packed_batches_give_the_same_logits(one_rank):
    """The same six samples, padded (one per row) and packed (data.packing's rows): equal MLM logits,
    forward and gradients; both compute the real tokens only."""
    from pretrain.data.samples.batches import collate, collate_packed, split_inputs_labels
    from pretrain.training.metrics import token_counts

    model, cfg = tiny_modernbert(one_rank)
    drawn = samples([20, 3, 32, 9, 14, 1], 32, 96, torch.Generator().manual_seed(3))
    (padded, labels), = [split_inputs_labels(collate(drawn), torch.device("cpu"))]
    (packed, packed_labels), = [split_inputs_labels(batch, torch.device("cpu")) for batch in collate_packed(drawn)]
    assert torch.equal(labels[0], packed_labels[0])
    assert packed[0].shape[0] < padded[0].shape[0]  # packing did put several samples in a row

    def logits_and_grads(inputs):
        model.zero_grad()
        logits, _ = model(inputs)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (a, grads_a), (b, grads_b) = logits_and_grads(padded), logits_and_grads(packed)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga.to_dense(), gb.to_dense(), rtol=1e-5, atol=1e-5)
    counts = token_counts([padded], torch.zeros(()), unpadded=True)
    assert counts.tolist() == [79.0, 79.0]  # computed = real: padding never reaches a layer
    assert token_counts([padded], torch.zeros(()), unpadded=False).tolist() == [79.0, 6 * 32.0]


def test_padding_between_real_tokens_stops_the_model_with_the_row(one_rank):
    model, _ = tiny_modernbert(one_rank)
    ids = torch.randint(5, 96, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 2] = 0
    with pytest.raises(PaddingLayoutError, match="row 1"):
        model((ids, torch.zeros_like(ids), mask, torch.zeros(2, 1, dtype=torch.long)))


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_masks_and_rotary_tables_are_built_once_per_micro_batch(one_rank, recompute):
    """2 and 6 layers (one and two of each kind) build the same things: per micro-batch, the rotary
    tables of each base and each kind's attention plan; backward's recomputation builds nothing."""
    builds = {}
    for layers in (3, 6):
        model, _ = tiny_modernbert(one_rank, f"model.num_layers={layers}", f"model.recompute={recompute}")
        cache = model.layers[1].cache
        assert all(layer.cache is cache for layer in model.layers if hasattr(layer, "cache"))
        ids = torch.randint(5, 96, (3, 40))
        mask = (torch.arange(40) < torch.tensor([[40], [33], [12]])).long()
        inputs = (ids, torch.zeros_like(ids), mask, torch.zeros(3, 2, dtype=torch.long))
        model.train()
        logits, _ = model(inputs)
        after_forward = cache.builds
        logits.sum().backward()
        assert cache.builds == after_forward, "backward built masks or tables again"
        model(inputs)  # the next micro-batch (new tensors): built again, once
        builds[layers] = (after_forward, cache.builds - after_forward)
    assert builds[3] == builds[6], builds
    # a rotary table per base, a mask per layer kind (85 tokens: both kinds take the dense path)
    assert builds[3] == (4, 4), builds


def tiny_bert(tp_group, layers: int, recompute: str):
    from pretrain.config import ModelConfig
    from pretrain.model.bert import build_model, init_weights
    from pretrain.model.rng import RngTracker, seed_streams

    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=layers, num_attention_heads=2, ffn_hidden_size=64,
                      max_position_embeddings=160, hidden_dropout=0.0, attention_dropout=0.1, recompute=recompute)
    tracker = RngTracker(torch.device("cpu"))
    seed_streams(tracker, 1, 0, 0, 0)
    model = build_model(cfg, cfg.padded_vocab_size(1), torch.float32, tracker, tp_group)
    init_weights(model, cfg, 7, 0, 1)
    return model


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_bert_computes_real_tokens_and_builds_its_masks_once(one_rank, recompute):
    """BERT's layers take one row of the micro-batch's real tokens; each micro-batch's attention
    plan is built once for 2 layers and for 4 alike (the dense mask at 120 real tokens, the
    documents' gather plan at 300), and backward's recomputation builds nothing."""
    from pretrain.model.layers import TransformerLayer

    builds = {}
    for layers in (2, 4):
        model = tiny_bert(one_rank, layers, recompute)
        encoder = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        cache = encoder[0].cache
        assert all(layer.cache is cache for layer in encoder)
        seen = []
        encoder[0].register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0][0].shape[:2])))
        model.train()
        counts = []
        for lengths in ([60, 40, 20], [150, 100, 50]):
            ids = torch.randint(5, 96, (3, 150))
            mask = (torch.arange(150) < torch.tensor(lengths)[:, None]).long()
            inputs = (ids, torch.zeros_like(ids), mask, torch.zeros(3, 2, dtype=torch.long))
            before = cache.builds
            logits, nsp = model(inputs)
            after_forward = cache.builds
            (logits.sum() + nsp.sum()).backward()
            assert cache.builds == after_forward, "backward built masks again"
            counts.append(after_forward - before)
        assert seen == [(1, 120), (1, 300)], seen  # real tokens only, as one row
        builds[layers] = counts
    assert builds[2] == builds[4] == [1, 1], builds


def test_bert_refuses_padding_between_real_tokens_naming_the_row(one_rank):
    model = tiny_bert(one_rank, 1, "none")
    ids = torch.randint(5, 96, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 2] = 0
    with pytest.raises(PaddingLayoutError, match="row 1"):
        model((ids, torch.zeros_like(ids), mask, torch.zeros(2, 1, dtype=torch.long)))


def test_the_cache_sees_one_micro_batch_through_its_aliases():
    """ZeRO-3 hands every module's outputs on as new aliases (detach()), integer tensors too: an
    alias of the same memory is the same micro-batch; equal values elsewhere, or the same tensor
    changed in place, are another."""
    from pretrain.model.micro_batch import MicroBatchCache

    cache = MicroBatchCache()
    ids = torch.tensor([[1, 1, 2, 2, 0]])
    built = cache.get(ids, "mask", lambda: object())
    assert cache.get(ids.detach(), "mask", lambda: object()) is built
    assert cache.get(ids.view(1, 5), "mask", lambda: object()) is built
    assert cache.get(ids.clone(), "mask", lambda: object()) is not built
    assert cache.get(ids[:, :4], "mask", lambda: object()) is not built  # another shape: another key
    ids.add_(0)  # in place: a new version
    assert cache.get(ids.detach(), "mask", lambda: object()) is not built


def test_compile_where_torch_cannot_is_one_line(monkeypatch):
    """model.compile=true on the CPU without a C++ compiler, or on a device torch does not compile
    for (the CPU test device), is refused naming the key, before any compilation starts."""
    from pretrain.model import fused

    fused.check_can_compile.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(fused.CompileUnavailable, match=r"model.compile=true on the CPU needs a C\+\+ compiler "
                                                        r"\(no-such-compiler"):
        fused.check_can_compile("cpu")
    with pytest.raises(fused.CompileUnavailable, match="not for fakegpu; set model.compile=false"):
        fused.check_can_compile("fakegpu")
    with pytest.raises(fused.CompileUnavailable, match="^optimizer.fused=true: .* set optimizer.fused=false"):
        fused.check_can_compile("fakegpu", "optimizer.fused")  # LAMB's compiled direction names its own key
    fused.check_can_compile.cache_clear()
