"""The interface between datasets and the trainer: one pretraining sample, and how batches of them
are cut for data-parallel ranks and micro-batches.

A dataset is anything with `__len__` and `__getitem__(index) -> dict` returning the SAMPLE_FIELDS
as NumPy arrays; every draw must be a pure function of (seed, index) so that the sample sequence
does not depend on the layout and a resumed run continues it exactly.
"""
from __future__ import annotations

import time
from typing import Iterator, Protocol

import numpy as np
import torch

SAMPLE_FIELDS = {
    "input_ids": np.int64,        # [seq] token ids, [CLS] A [SEP] B [SEP] [PAD]...
    "token_type_ids": np.int64,   # [seq] 0 for segment A (and padding), 1 for segment B
    "padding_mask": np.int64,     # [seq] 1 for real tokens, 0 for padding
    "masked_positions": np.int64,  # [max_predictions] positions of predicted tokens (0 where unused)
    "masked_labels": np.int64,    # [max_predictions] original token ids at those positions
    "masked_weights": np.float32,  # [max_predictions] 1.0 for real predictions, 0.0 for unused slots
    "nsp_label": np.int64,        # [] 0: B follows A (IsNext), 1: B is random (NotNext) - BERT's convention
}


class PretrainingDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.stack([s[name] for s in samples]).astype(dtype)) for name, dtype in SAMPLE_FIELDS.items()}


def split_inputs_labels(batch: dict[str, torch.Tensor], device: torch.device):
    """The (inputs, labels) pair the model and the pipeline engine take."""
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    inputs = (b["input_ids"], b["token_type_ids"], b["padding_mask"], b["masked_positions"])
    labels = (b["masked_labels"], b["masked_weights"], b["nsp_label"])
    return inputs, labels


def micro_batch_indices(consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> range:
    """Sample indices of this rank's next micro-batch (Megatron's pretraining sampler order).

    Each micro-step takes micro_batch_size * dp_size consecutive samples of the global sequence;
    DP rank r takes the r-th slice. The global sequence is thus the same for every layout.
    """
    start = consumed_samples + dp_rank * micro_batch_size
    return range(start, start + micro_batch_size)


class _RankMicroBatches:
    """Index lists of this rank's micro-batches, endlessly, from a consumed-samples position
    (the batch sampler of the DataLoader)."""

    def __init__(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, dataset_size: int):
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.dataset_size = dataset_size

    def __iter__(self) -> Iterator[list[int]]:
        consumed = self.consumed_samples
        while True:
            indices = micro_batch_indices(consumed, self.micro_batch_size, self.dp_rank, self.dp_size)
            yield [i % self.dataset_size for i in indices]
            consumed += self.micro_batch_size * self.dp_size


class MicroBatchIterator:
    """Endless iterator over this rank's micro-batches, starting at a consumed-samples position.

    With num_workers > 0, that many loader processes build batches ahead of the trainer (torch's
    DataLoader, in order); `wait_seconds` accumulates the time the trainer spent waiting for
    one, the figure that shows whether data keeps up.
    """

    def __init__(self, dataset: PretrainingDataset, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, device: torch.device, num_workers: int = 0, prefetch_factor: int = 4):
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self.wait_seconds = 0.0
        self._dataset = dataset
        self._loader_options = dict(num_workers=num_workers, prefetch_factor=prefetch_factor if num_workers else None,
                                    pin_memory=device.type == "cuda")
        self._batches = None  # the loader starts at the first draw, from the position then

    def _start_loader(self):
        batches = _RankMicroBatches(self.consumed_samples, self.micro_batch_size, self.dp_rank, self.dp_size,
                                    len(self._dataset))
        loader = torch.utils.data.DataLoader(
            self._dataset, batch_sampler=batches, collate_fn=collate, **self._loader_options,
            # The loader draws a base seed for its workers; from its own generator, not the global
            # one the dropout streams and exact resume depend on (our samples need no torch RNG).
            generator=torch.Generator(device="cpu").manual_seed(0),
        )
        return iter(loader)

    def skip(self, micro_batches: int) -> None:
        """Advance the position without building batches (for ranks that never draw: the middle
        stages of a pipeline); a later draw starts from the new position."""
        self.consumed_samples += micro_batches * self.micro_batch_size * self.dp_size
        self._batches = None

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        started = time.perf_counter()
        if self._batches is None:
            self._batches = self._start_loader()
        batch = next(self._batches)
        self.wait_seconds += time.perf_counter() - started
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return split_inputs_labels(batch, self.device)
