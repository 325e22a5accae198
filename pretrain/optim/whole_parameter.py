"""The machinery LAMB (lamb.py) and StableAdamW (stable_adamw.py) share: per-logical-parameter
sums that must not depend on how TP sharding or ZeRO partitioning cut the parameter.

Each optimizer computes a flat elementwise term for every tensor it steps (LAMB: w and u, for
their norms; StableAdamW: g^2 / max(v, eps^2), for its RMS), adds it up per segment of a logical
parameter (layout.py's `NormLayout`; without one, every tensor is a whole parameter), and needs the
sums over the whole parameter: the pieces on other DP ranks (ZeRO), then the other TP shards of
TP-sharded parameters.  Two vector all-reduces per step, on the model's device, issued by every
rank even when it holds nothing; no host sync.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from ..distributed.device import all_reduce
from .layout import NormLayout, Segment


class Stepped(NamedTuple):
    """A tensor with a gradient, its param group, its flat elementwise term and its segments."""
    param: torch.Tensor
    group: dict
    flat: torch.Tensor
    segments: list[Segment]


class WholeParameterOptimizer(torch.optim.Optimizer):
    """Base class: the layout, the per-device cache of its index tensors, the collection of stepped
    tensors with their segments, and the DP-then-TP reduction of the per-parameter sums."""

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self._layout: NormLayout | None = None
        self._constants: dict = {}  # index and mask tensors of the layout, per device

    def set_layout(self, layout: NormLayout | None) -> None:
        """Tell the optimizer how its tensors map onto logical parameters (None = every tensor
        is a whole parameter, no collectives)."""
        self._layout = layout
        self._constants = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _update(self) -> None:
        raise NotImplementedError

    def _new_state(self, param: torch.Tensor, group: dict) -> dict:
        """A tensor's state at its first step: step, exp_avg, exp_avg_sq (the names DeepSpeed's
        checkpoints know from Adam)."""
        return {"step": 0, "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}

    def _advance_states(self, params: list[torch.Tensor], group: dict) -> None:
        """Create each tensor's state on its first step, then advance its step counter (a host int:
        no device sync)."""
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                state.update(self._new_state(p, group))
            state["step"] += 1

    def _on(self, device: torch.device, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A small index/mask tensor that only changes with the layout: built once, kept on `device`."""
        cached = self._constants.get((device, key))
        if cached is None:
            cached = self._constants[(device, key)] = make().to(device)
        return cached

    def _collect(self, terms: Callable[[list[torch.Tensor], dict], Sequence[torch.Tensor]]
                 ) -> tuple[list[Stepped], int, torch.device]:
        """Every tensor with a gradient, group by group, with `terms(params, group)`'s flat term
        for each; the number of logical parameters; the device the sums are built on."""
        work, implicit = [], 0  # without a layout each tensor is its own logical parameter
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p, flat in zip(params, terms(params, group)):
                if self._layout is None:
                    segments = [Segment(implicit, 0, p.numel())] if p.numel() else []
                    implicit += 1
                else:
                    segments = self._layout.segments_for(p)
                work.append(Stepped(p, group, flat, segments))
        count = implicit if self._layout is None else self._layout.num_logical
        return work, count, self._sums_device(work)

    def _sums_device(self, work: list[Stepped]) -> torch.device:
        """Where the per-parameter sums are built: the stepped tensors' device (the layout's, for a
        rank stepping nothing this time)."""
        if work:
            return work[0].param.device
        entries = self._layout.entries() if self._layout is not None else []
        return entries[0][0].device if entries else torch.device("cpu")

    def _whole_parameter_sums(self, sums: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[k, num_logical] partial sums -> whole-parameter sums on `device`: add the pieces held by
        other DP ranks (ZeRO), then the other TP shards of sharded parameters only (a replicated
        parameter is already whole on every TP rank).  Reduced on the model's device: under
        optimizer offload the stepped tensors are on the CPU, where an NCCL group cannot reduce."""
        layout = self._layout
        if layout is None:
            return sums
        if layout.comm_device is not None:
            sums = sums.to(layout.comm_device)
        if layout.dp_group is not None:
            all_reduce(sums, layout.dp_group)
        if layout.tp_group is not None:
            mask = self._on(sums.device, ("tp_sharded",), lambda: torch.tensor(layout.tp_sharded, dtype=torch.bool))
            sharded = all_reduce(torch.where(mask, sums, torch.zeros_like(sums)), layout.tp_group)
            sums = torch.where(mask, sharded, sums)
        return sums.to(device)


def flat_target(param: torch.Tensor, copy_back: list) -> torch.Tensor:
    """The parameter's data as one flat tensor to update in place: a view when contiguous, else a
    copy recorded in `copy_back` for `write_back`."""
    if param.data.is_contiguous():
        return param.data.view(-1)
    target = param.data.reshape(-1).clone()
    copy_back.append((param, target))
    return target


def write_back(copy_back: list) -> None:
    for param, target in copy_back:
        param.data.copy_(target.view_as(param))
