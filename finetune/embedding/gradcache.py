"""Gradient caching (Gao et al. 2021, "GradCache"; sentence-transformers' CachedMultipleNegativesRankingLoss):
a contrastive batch larger than memory, trained as if it were embedded in one piece.

1. every mini-batch of every column (anchors, positives, negatives) is embedded without
   gradients, the random state before each kept;
2. the loss of the whole batch is computed on those embeddings (made leaves), and its gradient
   with respect to each embedding;
3. each mini-batch is embedded again with gradients, from the same random state (the same dropout
   masks), and back-propagated with its cached embedding gradient.

The parameters' gradients are then those of the uncached step (to rounding), at the memory of one
mini-batch's activations plus the batch's embeddings. The cost: a second forward per mini-batch.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class RandomState(Protocol):
    """What replays a forward's randomness (dropout): the state before it, and its restoration."""

    def get(self): ...

    def set(self, state) -> None: ...


class TorchRandomState:
    """The CPU generator's state and, where a CUDA device is used, its generator's too; with a
    `tracker` (pretrain.model.rng.RngTracker) also its named streams (the dropout of tensor-parallel
    regions draws from those)."""

    def __init__(self, device: torch.device | None = None, tracker=None):
        self.cuda = device is not None and device.type == "cuda"
        self.tracker = tracker

    def get(self):
        streams = self.tracker.state_dict() if self.tracker is not None else None
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self.cuda else None), streams

    def set(self, state) -> None:
        cpu, cuda, streams = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        if streams is not None:
            self.tracker.load_state_dict(streams)


def cached_step(columns: Sequence[Sequence[object]], embed: Callable[[object], torch.Tensor],
                loss_fn: Callable[[list[torch.Tensor]], torch.Tensor], random_state: RandomState,
                backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> torch.Tensor:
    """One GradCache step. `columns[c]`: column c's mini-batches (inputs `embed` takes); `loss_fn`:
    the loss of the whole batch's embeddings, one [batch, hidden] tensor per column; `backward`:
    how a mini-batch's surrogate is back-propagated (a DeepSpeed engine's backward). Returns the
    loss (detached); the parameters' gradients are accumulated by `backward`."""
    states: list[list[object]] = []
    pieces: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for column in columns:
            states.append([])
            pieces.append([])
            for mini_batch in column:
                states[-1].append(random_state.get())
                pieces[-1].append(embed(mini_batch).detach())
    leaves = [torch.cat(column).requires_grad_() for column in pieces]
    loss = loss_fn(leaves)
    cached = torch.autograd.grad(loss, leaves)
    after = random_state.get()  # the state an uncached step leaves behind
    for c, column in enumerate(columns):
        start = 0
        for mini_batch, state in zip(column, states[c]):
            random_state.set(state)
            embeddings = embed(mini_batch)
            rows = embeddings.shape[0]
            backward((embeddings * cached[c][start:start + rows]).sum())
            start += rows
    random_state.set(after)
    return loss.detach()
