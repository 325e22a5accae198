"""Step metrics: the token counts of a step, their reduction over the job (one collective and one
host sync for a whole log window, which also gathers every rank's own figures of the window for
the straggler watch), and the throughput window pretraining and fine-tuning share."""
from __future__ import annotations

import time

import torch

from ..distributed import device
from ..distributed.parallel import Parallel
from ..model.bert import PretrainingLoss

TOKEN_COUNTS = ("real_tokens", "computed_tokens")


def token_counts(micro_batch_inputs: list[tuple], like: torch.Tensor, unpadded: bool = False) -> torch.Tensor:
    """TOKEN_COUNTS of one step's micro-batches (float64 on `like`'s device, no host sync): real
    tokens (not padding; the padding mask and the packed sample ids are 0 there) and computed
    ones (what the layers ran on: rows x seq_length, or the real tokens alone where the model is
    `unpadded`, as ModernBERT is). Zeros on ranks that drew nothing."""
    real = torch.zeros((), dtype=torch.float64, device=like.device)
    computed = 0
    for inputs in micro_batch_inputs:
        real = real + (inputs[2] != 0).sum()
        computed += inputs[0].numel()
    return torch.stack([real, real if unpadded else torch.full_like(real, computed)])


def reduce_metrics(parallel: Parallel, sums: list[torch.Tensor], grad_norms: list = ()) -> list[dict]:
    """Averages of the loss function's sums of several steps (or of one evaluation), each over
    its whole global batch (per masked token, per sequence), with this rank's gradient norm of
    each step: one collective and one host sync for all of them.

    Only the last stage computes the loss, and its TP ranks (and CP ranks) hold identical values:
    the (last stage, TP rank 0, CP rank 0) ranks contribute, everyone receives the result.
    """
    return reduce_window(parallel, sums, grad_norms)[0]


def reduce_window(parallel: Parallel, sums: list[torch.Tensor], grad_norms: list = (),
                  rank_figures: list[float] | None = None) -> tuple[list[dict], list[list[float]] | None]:
    """reduce_metrics, and with `rank_figures` (this rank's host numbers, as many on every rank)
    every rank's figures gathered in the same collective: each rank writes its own row of a
    [world_size, k] zero table appended to the reduced sums, which the sum turns into every
    rank's rows. Returns (the metrics, the rows or None)."""
    p = parallel
    contributes = p.is_last_stage and p.tp_rank == 0 and p.cp_rank == 0
    stacked = torch.stack([s if contributes else torch.zeros_like(s) for s in sums])
    parts = [stacked.reshape(-1)]
    if rank_figures is not None:
        table = torch.zeros((p.world_size, len(rank_figures)), dtype=stacked.dtype, device=stacked.device)
        mine = table[p.rank]
        for i, value in enumerate(rank_figures):  # fill kernels given the numbers: no host-to-device
            mine[i].fill_(float(value))          # copy, which on a GPU would wait for the device
        parts.append(table.reshape(-1))
    reduced = device.all_reduce(torch.cat(parts) if len(parts) > 1 else parts[0])
    on_device = [g.detach().reshape(1).to(reduced) for g in grad_norms if torch.is_tensor(g)]
    values = torch.cat([reduced.reshape(-1), *on_device]).tolist()
    width, count, losses = sums[0].numel(), len(sums), len(PretrainingLoss.METRICS)
    metrics = [PretrainingLoss.averages(values[i * width:i * width + losses]) for i in range(count)]
    for i, m in enumerate(metrics):  # a training step's token counts (an evaluation has none)
        m.update(zip(TOKEN_COUNTS, values[i * width + losses:(i + 1) * width]))
    rows, end = None, count * width
    if rank_figures is not None:
        k = len(rank_figures)
        rows = [values[end + r * k:end + (r + 1) * k] for r in range(p.world_size)]
        end += p.world_size * k
    read = iter(values[end:])
    for m, norm in zip(metrics, grad_norms):
        m["grad_norm"] = next(read) if torch.is_tensor(norm) else float("nan") if norm is None else float(norm)
    return metrics, rows


class ThroughputWindow:
    """The training work since the window opened and the time it took: the perf/* figures. Real
    (non-padding) tokens are the work done; computed tokens include the padding the layers ran on.

    Pretraining hands it the tokens its metric reduction already counted (`rates`); fine-tuning
    counts them here on the device as batches go by (`add`, no host sync) and reduces `counts()`
    over its data-parallel ranks at a log step. Restart it after work that is not training (an
    evaluation, a save)."""

    def __init__(self, device: torch.device, unit: str = "samples"):
        self.device, self.unit = device, unit  # what `items` counts: "samples" or "examples"
        self.restart()

    def restart(self) -> None:
        self.started = time.perf_counter()
        self.real = torch.zeros((), dtype=torch.float64, device=self.device)
        self.computed = 0
        self.items = 0

    def add(self, attention_mask: torch.Tensor) -> None:
        """One batch's tokens (nonzero in the mask: real) and examples, summed on the device."""
        self.real = self.real + (attention_mask != 0).sum()
        self.computed += attention_mask.numel()
        self.items += attention_mask.shape[0]

    def counts(self) -> torch.Tensor:
        """[real tokens, computed tokens, items] added since the restart, on the device."""
        return torch.stack([self.real, torch.full_like(self.real, self.computed), torch.full_like(self.real, self.items)])

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def rates(self, real: float, computed: float, items: float) -> dict[str, float]:
        """Per second since the restart, over the whole job (the counts given are the job's); restarts."""
        seconds = self.seconds()
        self.restart()
        return {"real_tokens_per_second": real / seconds, "tokens_per_second": computed / seconds,
                f"{self.unit}_per_second": items / seconds, "real_token_share": real / max(computed, 1.0)}
