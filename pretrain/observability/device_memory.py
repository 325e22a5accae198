"""Where a rank's memory goes, measured during the first training step and logged once:

- parameters: the model's tensors this rank holds (a ZeRO-3 rank: its partitions);
- gradients: the gradients the optimizer steps with (the model's, and those of the fp32 master
  copies or ZeRO partitions DeepSpeed steps, over its per-group steps), each storage once per step call;
- optimizer state: the optimizer's moments and step counters, and DeepSpeed's fp32 master
  copies (ZeRO partitions, bf16's masters) when they are tensors of their own;
- activations peak: the most bytes that autograd kept for backward at any moment of the step
  (its saved tensors, counted when saved and released when freed, each storage once), the
  parameters it saves (a linear's weight) left out: they are counted as parameters. A
  recomputed region's own tensors are not included (torch's checkpoint saves them to hooks of its
  own, and they live only during that region's backward); its inputs are (checkpoint saves them
  through the meter's hooks);
- device peak (GPUs, and fakegpu): the device's allocated peak over the second step (the first
  with optimizer state; torch.cuda.max_memory_allocated), everything at once.

The trainer logs each figure beside the planner's prediction for the rank (pretrain/plan), so
every run checks the planner.
"""
from __future__ import annotations

import weakref

import torch

from ..distributed import device as devices
from ..distributed import internals

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

    def __init__(self, parameters=()):
        self.parameters = {id(p) for p in parameters}  # left out: counted as parameters
        self.live: dict[tuple, list] = {}  # storage key -> [bytes, references]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: torch.Tensor):
        base = tensor if tensor._base is None else tensor._base
        if id(base) in self.parameters:  # a parameter, or a view of one (a linear's weight.t())
            return tensor
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
        return holder.tensor if isinstance(holder, _Saved) else holder

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


class FirstStepMemory:
    """Measures the first steps of a run; `report()` is the breakdown in bytes.

    The model states and the activations are those of the first step; the device peak that of
    the second (the first with the optimizer's state, which its first step creates), or of the
    first when the run has one. DeepSpeed's ZeRO optimizers step the client optimizer once per
    param group (ZeRO-1/2) or sub-group (ZeRO-3), each with its gradient made just before and
    freed after: the gradients are those of every such call (each call's storages once), the
    masters those stepped in any."""

    def __init__(self, model: torch.nn.Module, engine, device: torch.device, allocated_before: int = 0):
        self.model, self.engine, self.device = model, engine, device
        self.allocated_before = allocated_before  # the device's bytes before the run began: not its own
        self.meter = ActivationMeter(model.parameters())
        self.gradients = 0
        self.steps = 0
        self._stepped: dict[tuple, torch.Tensor] = {}  # the tensors the optimizer stepped (masters persist)
        self._optimizer = optimizer = internals.client_optimizer(engine)
        self._hook = optimizer.register_step_pre_hook(self._at_step)
        devices.reset_peak_memory(device)

    def _at_step(self, optimizer, args, kwargs) -> None:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        self.gradients += _storage_bytes([p.grad for p in stepped] + [p.grad for p in self.model.parameters()])
        for p in stepped:
            self._stepped.setdefault((p.untyped_storage().data_ptr(), p.device), p)

    def measured(self, run_step):
        """`run_step()`'s result, the first step run under the activation meter's hooks."""
        if self.steps == 0:
            with self.meter.hooks():
                result = run_step()
        else:
            result = run_step()
        self.step_done()
        return result

    def step_done(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self._hook.remove()  # the first step's optimizer calls only
            devices.reset_peak_memory(self.device)

    def report(self) -> dict[str, int]:
        params = [internals.zero3_partition(p) if internals.is_zero3_param(p) else p for p in self.model.parameters()]
        state = [v for s in self._optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        own = {(p.untyped_storage().data_ptr(), p.device) for p in params}
        masters = [p for key, p in self._stepped.items() if key not in own]
        report = {"parameters": _storage_bytes(params), "gradients": self.gradients,
                  "optimizer_state": _storage_bytes(state + masters), "activations_peak": self.meter.peak}
        peak = devices.peak_memory_allocated(self.device)
        if peak is not None:
            report["device_peak"] = peak - self.allocated_before
        return report
