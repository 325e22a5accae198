"""Dropout RNG streams that work on CPU and GPU.

megatron-core's RNG tracker and checkpoint function only handle CUDA RNG state. Tensor
parallelism needs two kinds of randomness:
- replicated regions (embeddings, residual branches) must draw the *same* dropout mask on every
  TP rank: they use the device's default generator, seeded identically across a TP group;
- sharded regions (attention probabilities of this rank's heads) must draw *different* masks per
  TP rank: they fork into the "model-parallel" stream below, seeded per TP rank.
Activation recomputation must replay both, see `checkpoint_with_rng`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_STREAM = "model-parallel"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RngTracker:
    """Named generator states, swapped into the device's default generator by `fork`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_STREAM):
        outside = _get_state(self.device)
        _set_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(self.device, outside)

    def state_dict(self) -> dict:
        return {name: state.clone() for name, state in self.states.items()}

    def load_state_dict(self, states: dict) -> None:
        self.states = {name: state.clone() for name, state in states.items()}


def seed_streams(tracker: RngTracker, seed: int, tp_rank: int, pp_rank: int, dp_rank: int) -> None:
    """Seed the default generator (same on all TP ranks) and this TP rank's own stream."""
    default_seed = seed + 100 * pp_rank + 10007 * dp_rank
    torch.manual_seed(default_seed)
    if tracker.device.type == "cuda":
        torch.cuda.manual_seed(default_seed)
    tracker.add(MODEL_PARALLEL_STREAM, default_seed + 2718 + tp_rank)


def checkpoint_with_rng(function, tracker: RngTracker, *args):
    """Activation checkpointing that replays the tracker's streams as well as the default one.

    torch.utils.checkpoint restores the default generator for recomputation; the tracker's
    streams have moved on by then, so we snapshot them at forward time and put the snapshot
    back for the duration of the recomputation.
    """
    snapshot = dict(tracker.states)

    @contextlib.contextmanager
    def replay_streams():
        current = dict(tracker.states)
        tracker.states.update(snapshot)
        try:
            yield
        finally:
            tracker.states.update(current)

    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (contextlib.nullcontext(), replay_streams()),
    )
