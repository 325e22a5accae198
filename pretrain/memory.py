"""Where a rank's memory goes, measured during the first training step and logged once:

- parameters: the model's tensors this rank holds (a ZeRO-3 rank: its partitions);
- gradients: every gradient tensor alive when the optimizer steps (the model's, and those of the
  fp32 master copies or ZeRO partitions DeepSpeed steps), each storage once;
- optimizer state: the optimizer's moments and step counters, and DeepSpeed's fp32 master
  copies (ZeRO partitions, bf16's masters) when they are tensors of their own;
- activations peak: the most bytes that autograd kept for backward at any moment of the step
  (its saved tensors, counted when saved and released when freed, each storage once). Tensors
  that recomputation keeps outside autograd (a fully recomputed layer's input) are not included.
"""
from __future__ import annotations

import weakref

import torch

from . import internals

MB = 2**20


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter runs; freed with the graph."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """saved_tensors_hooks that count the bytes autograd keeps for backward, and their peak."""

    def __init__(self):
        self.live: dict[tuple, list] = {}  # storage key -> [bytes, references]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    @staticmethod
    def _unpack(holder):
        return holder.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class FirstStepMemory:
    """Measures the first optimizer step of a run; `report()` is the breakdown in MB."""

    def __init__(self, model: torch.nn.Module, engine):
        self.model, self.engine = model, engine
        self.meter = ActivationMeter()
        self.gradients = 0
        self._optimizer = optimizer = internals.client_optimizer(engine)
        self._hook = optimizer.register_step_pre_hook(self._measure_gradients)

    def _measure_gradients(self, optimizer, args, kwargs) -> None:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        self.gradients = _storage_bytes([p.grad for p in stepped] + [p.grad for p in self.model.parameters()])
        self._hook.remove()  # once

    def report(self) -> dict[str, float]:
        params = [internals.zero3_partition(p) if internals.is_zero3_param(p) else p for p in self.model.parameters()]
        state = [v for s in self._optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        own = {(p.untyped_storage().data_ptr(), p.device) for p in params}
        masters = [p for group in self._optimizer.param_groups for p in group["params"]
                   if (p.untyped_storage().data_ptr(), p.device) not in own]
        return {"parameters_mb": _storage_bytes(params) / MB, "gradients_mb": self.gradients / MB,
                "optimizer_state_mb": _storage_bytes(state + masters) / MB,
                "activations_peak_mb": self.meter.peak / MB}
