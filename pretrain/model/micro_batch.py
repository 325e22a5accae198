"""What every encoder layer derives from one micro-batch, built once and shared.

A micro-batch's sample ids and positions are the same tensors in every layer of a stage (each
layer hands them on unchanged), and so is what follows from them: the rotary tables of each base,
the attention masks of each window (a FlexAttention BlockMask, the banded path's window mask), the
document boundaries of variable-length attention. Built per layer, ModernBERT-base made 22 masks
and 22 pairs of rotary tables per forward where two of each exist, and again in every recomputation.

`MicroBatchCache.get(key, name, build)` returns what `build()` gave the first time `name` was asked
for this micro-batch, `key` being the micro-batch's sample-id tensor: the same memory, layout (and
version) means the same micro-batch, whatever tensor object carries it (DeepSpeed's ZeRO-3 hands
every module's outputs on as new aliases, `detach()`, integer tensors too: keyed by object, each
layer would build its own masks). The cache holds the key tensors it has seen, so their memory
cannot be reused for another micro-batch while an entry lives, and keeps the last few micro-batches
(a pipeline runs several forwards before their backwards recompute). What it holds is never
differentiated: masks, indices and tables, no activations.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch


class MicroBatchCache:
    def __init__(self, micro_batches: int = 4):
        self.micro_batches = micro_batches
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, int, dict]] = OrderedDict()
        self.builds = 0  # how many values were built (tests count them)

    def get(self, key: torch.Tensor, name: Any, build: Callable[[], Any]) -> Any:
        # aliases share their version counter with the tensor they alias, so an in-place change shows
        where = (key.untyped_storage().data_ptr(), key.storage_offset(), tuple(key.shape), key.stride(),
                 key.dtype, key.device)
        entry = self._entries.get(where)
        if entry is None or entry[1] != key._version:
            entry = (key, key._version, {})
            self._entries[where] = entry
            while len(self._entries) > self.micro_batches:
                self._entries.popitem(last=False)
        self._entries.move_to_end(where)
        values = entry[2]
        if name not in values:
            values[name] = build()
            self.builds += 1
        return values[name]

    def clear(self) -> None:
        self._entries.clear()
