"""finetune/embedding/gradcache.py: a cached step (mini-batches of 2, dropout on) gives the
parameters the gradients of the uncached step, for the plain, symmetric, hard-negative and
Matryoshka losses; without replaying the random state it would not."""
import pytest
import torch

from finetune.embedding.gradcache import TorchRandomState, cached_step
from finetune.embedding.loss import ContrastiveLoss

BATCH, FEATURES, HIDDEN = 8, 12, 10


def encoder():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.GELU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(32, HIDDEN))


def batch(columns: int):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, FEATURES, generator=generator) for _ in range(columns)]


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("columns, loss", [
    (2, ContrastiveLoss()),
    (3, ContrastiveLoss(symmetric=True)),
    (4, ContrastiveLoss(matryoshka_dims=(10, 4))),
], ids=["pairs", "symmetric-hard-negative", "matryoshka"])
def test_a_cached_step_equals_the_uncached_one(columns, loss):
    inputs = batch(columns)

    def whole_loss(embeddings):
        return loss(embeddings[0], embeddings[1], embeddings[2:])

    uncached = encoder().train()
    torch.manual_seed(11)
    expected_loss = whole_loss([uncached(x) for x in inputs])
    expected_loss.backward()

    cached = encoder().train()
    torch.manual_seed(11)
    minis = [list(x.split(2)) for x in inputs]
    got_loss = cached_step(minis, cached, whole_loss, TorchRandomState())
    assert got_loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    for got, want in zip(grads(cached), grads(uncached)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()  # summation order

    # the replay took effect: without it the second forward draws other dropout masks
    class NoReplay(TorchRandomState):
        def set(self, state):
            pass

    careless = encoder().train()
    torch.manual_seed(11)
    cached_step(minis, careless, whole_loss, NoReplay())
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(grads(careless), grads(uncached)))


class ForkedDropout(torch.nn.Module):
    """Dropout drawn from a tracker's stream, as the tensor-parallel regions of our encoder draw it."""

    def __init__(self, tracker):
        super().__init__()
        torch.manual_seed(0)
        self.tracker, self.inner = tracker, torch.nn.Linear(FEATURES, HIDDEN)  # one dropout: the draws' order is the batch's

    def forward(self, x):
        with self.tracker.fork():
            return torch.nn.functional.dropout(self.inner(x), 0.3, training=self.training)


def test_the_replay_covers_the_tracker_streams_the_encoders_tensor_parallel_dropout_draws_from():
    from pretrain.model.rng import RngTracker

    inputs = batch(2)
    loss = ContrastiveLoss()

    def run(random_state_of, cached: bool):
        tracker = RngTracker(torch.device("cpu"))
        tracker.add("model-parallel", 5)
        model = ForkedDropout(tracker).train()
        torch.manual_seed(11)
        if cached:
            cached_step([list(x.split(2)) for x in inputs], model, lambda e: loss(e[0], e[1]), random_state_of(tracker))
        else:
            loss(model(inputs[0]), model(inputs[1])).backward()
        return grads(model)

    want = run(None, cached=False)
    got = run(lambda tracker: TorchRandomState(tracker=tracker), cached=True)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got, want))
    careless = run(lambda tracker: TorchRandomState(), cached=True)  # the default generator only
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(careless, want))
