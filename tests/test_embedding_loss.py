"""finetune/embedding/loss.py against sentence-transformers (a test-only dependency): pooling as its
Pooling module, the loss and its gradients as its MultipleNegativesRankingLoss (pairs, hard
negatives, the symmetric variant, MatryoshkaLoss around it) within 1e-6 in fp32; and the candidates
gathered over two data-parallel processes (gradients through the gather) equal to one process
given the whole global batch."""
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from finetune.embedding.loss import ContrastiveLoss, pool

pytestmark = pytest.mark.slow  # sentence-transformers' import alone takes seconds

BATCH, SEQ, HIDDEN = 6, 7, 16


def token_states(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return hidden, mask


@pytest.mark.parametrize("mode, theirs", [("mean", "mean"), ("cls", "cls"), ("last", "lasttoken")])
def test_pooling_is_sentence_transformers_pooling(mode, theirs):
    from sentence_transformers.sentence_transformer.modules import Pooling

    hidden, mask = token_states()
    expected = Pooling(HIDDEN, pooling_mode=theirs)({"token_embeddings": hidden, "attention_mask": mask})
    assert torch.allclose(pool(hidden, mask, mode), expected["sentence_embedding"], atol=1e-6)
    normalized = pool(hidden, mask, mode, normalize=True)
    assert torch.allclose(normalized.norm(dim=1), torch.ones(BATCH))
    # the padding never counts: changing the states behind the mask changes nothing
    noisy = hidden + (1 - mask)[..., None] * 100.0
    assert torch.allclose(pool(noisy, mask, mode), pool(hidden, mask, mode), atol=1e-5)


def embeddings(columns: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, HIDDEN, generator=generator, dtype=torch.float64).float().requires_grad_()
            for _ in range(columns)]


def gradients(loss, inputs):
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("columns, symmetric, matryoshka", [
    (2, False, ()),          # (anchor, positive) pairs
    (4, False, ()),          # two hard negatives each
    (2, True, ()),           # the symmetric term
    (3, False, (16, 8, 4)),  # MatryoshkaLoss around it
], ids=["pairs", "hard-negatives", "symmetric", "matryoshka"])
def test_loss_and_gradients_equal_multiple_negatives_ranking_loss(columns, symmetric, matryoshka):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

    kwargs = dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction") if symmetric else {}
    reference = MultipleNegativesRankingLoss(None, scale=20.0, **kwargs)
    inputs = embeddings(columns)
    if matryoshka:  # MatryoshkaLoss: the base loss on each shrunk copy, weighted (here 1, 2, 0.5)
        weights = (1.0, 2.0, 0.5)
        theirs = sum(w * reference.compute_loss_from_embeddings([shrink(e, d) for e in inputs], None)
                     for d, w in zip(matryoshka, weights))
        ours = ContrastiveLoss(scale=20.0, matryoshka_dims=matryoshka, matryoshka_weights=weights)(
            inputs[0], inputs[1], inputs[2:])
    else:
        theirs = reference.compute_loss_from_embeddings(inputs, None)
        ours = ContrastiveLoss(scale=20.0, symmetric=symmetric)(inputs[0], inputs[1], inputs[2:])
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    for mine, reference_grad in zip(gradients(ours, inputs), gradients(theirs, inputs)):
        assert torch.allclose(mine, reference_grad, atol=1e-6)


def _dp_worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for symmetric in (False, True):  # one process group for both losses
            torch.manual_seed(0)
            encoder = torch.nn.Linear(HIDDEN, HIDDEN)  # the same weights on every rank (seeded)
            inputs = [e.detach() for e in embeddings(3)]
            mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's share of the global batch
            encoded = [encoder(e[mine]) for e in inputs]
            loss = ContrastiveLoss(symmetric=symmetric, group=dist.group.WORLD, rank=rank)(
                encoded[0], encoded[1], encoded[2:])
            loss.backward()
            for p in encoder.parameters():  # data-parallel gradient averaging, as DeepSpeed does
                dist.all_reduce(p.grad)
                p.grad /= world
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            results[(rank, symmetric)] = (mean_loss.item() / world, [p.grad.clone() for p in encoder.parameters()])
    finally:
        dist.destroy_process_group()


def test_two_data_parallel_ranks_equal_one_process_with_the_global_batch():
    from distributed import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_dp_worker, args=(2, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for symmetric in (False, True):
        torch.manual_seed(0)
        encoder = torch.nn.Linear(HIDDEN, HIDDEN)
        inputs = [e.detach() for e in embeddings(3)]
        encoded = [encoder(e) for e in inputs]
        whole = ContrastiveLoss(symmetric=symmetric)(encoded[0], encoded[1], encoded[2:])
        whole.backward()
        expected = [p.grad for p in encoder.parameters()]
        for rank in (0, 1):
            loss, grads = results[(rank, symmetric)]
            assert loss == pytest.approx(whole.item(), rel=1e-6), (symmetric, rank)
            for got, want in zip(grads, expected):
                assert torch.allclose(got, want, atol=1e-6), (symmetric, rank, (got - want).abs().max())
        # the gather took effect: each rank alone (its 3 anchors against its own candidates) differs
        alone = ContrastiveLoss(symmetric=symmetric)(encoded[0][:3], encoded[1][:3], [encoded[2][:3]])
        assert abs(alone.item() - whole.item()) > 1e-3


def test_one_step_of_our_encoder_equals_sentence_transformers_multiple_negatives_ranking_loss(tmp_path):
    """The whole step, model included: a tiny BERT loaded as our encoder and as a SentenceTransformer,
    one batch (anchors, positives, hard negatives): the loss and every parameter's gradient of ours
    (padded rows, packed rows, gradient-cached) equal MultipleNegativesRankingLoss's and
    CachedMultipleNegativesRankingLoss's within 1e-5."""
    from transformers import BertModel

    from distributed import run_ranks
    from test_hf_directories import save_directory, tiny_model

    model_dir = save_directory(tmp_path / "bert", tiny_model(BertModel), lowercase=False)
    out = tmp_path / "parity.json"
    run_ranks(["tests/_embed_st_parity_worker.py", str(out), str(model_dir)], 1, timeout=300)
    results = json.loads(out.read_text())
    assert set(results) == {"padded", "packed", "cached"}
    for mode, r in results.items():
        assert abs(r["ours"] - r["theirs"]) < 1e-5, (mode, r["ours"], r["theirs"])
        # every parameter sentence-transformers trains has our gradient (the pooler: in neither)
        assert r["names"] == r["our_names"] and len(r["names"]) > 30, mode
        assert r["scale"] > 1e-3 and max(r["max_difference"].values()) < 1e-5, (mode, r["max_difference"])
