"""Vocabulary-parallel cross entropy, in the form each kind of kernel runs fastest.

megatron-core's (VocabParallelCrossEntropy) takes fp32 logits and overwrites them in place, so a
bf16 model's masked logits are first copied to fp32 ([masked tokens, vocabulary / TP] x 4 bytes:
2.2 GB for ModernBERT-base at seq 1024 x 64, 30% masking), swept several times, and the fp32
softmax kept for backward. Two forms of the same loss:

- compiled (model.compile; on CUDA by default): forward reads the logits as they are twice (the row
  maximum, then the sum of exponentials, fp32 arithmetic in registers), backward once, writing the
  gradient in the logits' dtype; it saves the logits (alive until backward anyway) and two fp32
  numbers per token: no fp32 tensor of the logits' size is ever written. The exponentials are
  computed twice, which costs nothing on a GPU, where these sweeps are bound by memory;
- eager (the CPU's default): megatron's own steps on an fp32 copy, its softmax kept for backward:
  one exponential per logit, which is what costs on a CPU (the recomputing form was 3x slower
  there), and the very numbers of megatron's function.

Where a rank holds a slice of the vocabulary, the maximum, the sum and the target's logit are
all-reduced over the tensor-parallel group, as megatron's are.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..distributed.device import all_reduce


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(dim=-1)


def _sum_exp(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    return torch.exp(logits.float() - row_max.unsqueeze(-1)).sum(dim=-1)


def _gradient(logits, row_max, sum_exp, local_target, in_range, grad_loss) -> torch.Tensor:
    """(softmax - one_hot(target)) x the loss's gradient, in the logits' dtype."""
    softmax = torch.exp(logits.float() - row_max.unsqueeze(-1)) / sum_exp.unsqueeze(-1)
    columns = torch.arange(logits.shape[-1], device=logits.device)
    one_hot = (columns == local_target.unsqueeze(-1)) & in_range.unsqueeze(-1)
    return ((softmax - one_hot.float()) * grad_loss.unsqueeze(-1)).to(logits.dtype)


@functools.cache
def _compiled(name: str):
    return torch.compile({"row_max": _row_max, "sum_exp": _sum_exp, "gradient": _gradient}[name], dynamic=True)


def _targets(target: torch.Tensor, start: int, local_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's column of each target (0 where another rank holds it) and whether it holds it."""
    local = target - start
    in_range = (local >= 0) & (local < local_size)
    return local.masked_fill(~in_range, 0), in_range


def _picked(values: torch.Tensor, local_target: torch.Tensor, in_range: torch.Tensor) -> torch.Tensor:
    """values[row, target] in fp32, 0 where the target is another rank's."""
    return values.gather(1, local_target.unsqueeze(1)).squeeze(1).float().masked_fill(~in_range, 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, use_compiled: bool):
        shape = logits.shape
        logits = logits.reshape(-1, shape[-1])
        sharded = tp_group is not None and dist.get_world_size(tp_group) > 1
        start = dist.get_rank(tp_group) * logits.shape[-1] if sharded else 0  # every rank holds an equal slice
        local_target, in_range = _targets(target.reshape(-1), start, logits.shape[-1])
        ctx.use_compiled, ctx.shape, ctx.dtype = use_compiled, shape, logits.dtype
        if use_compiled:
            row_max = _compiled("row_max")(logits)
            if sharded:
                all_reduce(row_max, tp_group, op="max")
            sum_exp = _compiled("sum_exp")(logits, row_max)
            predicted = _picked(logits, local_target, in_range) - row_max
            if sharded:
                all_reduce(sum_exp, tp_group)
                all_reduce(predicted, tp_group)
            ctx.save_for_backward(logits, row_max, sum_exp, local_target, in_range)
            return (torch.log(sum_exp) - predicted).view(shape[:-1])
        # megatron's steps on an fp32 copy (the logits stay as they are)
        work = logits.to(torch.float32, copy=True)
        row_max = work.amax(dim=-1)
        if sharded:
            all_reduce(row_max, tp_group, op="max")
        work.sub_(row_max.unsqueeze(-1))
        predicted = _picked(work, local_target, in_range)
        sum_exp = work.exp_().sum(dim=-1)
        if sharded:
            all_reduce(sum_exp, tp_group)
            all_reduce(predicted, tp_group)
        loss = torch.log(sum_exp) - predicted
        ctx.save_for_backward(work.div_(sum_exp.unsqueeze(-1)), local_target, in_range)  # the softmax
        return loss.view(shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        grad_loss = grad_loss.reshape(-1).float()
        if ctx.use_compiled:
            logits, row_max, sum_exp, local_target, in_range = ctx.saved_tensors
            grad = _compiled("gradient")(logits, row_max, sum_exp, local_target, in_range, grad_loss)
        else:
            softmax, local_target, in_range = ctx.saved_tensors
            rows = torch.arange(softmax.shape[0], device=softmax.device)
            softmax[rows, local_target] -= in_range.float()
            grad = softmax.mul_(grad_loss.unsqueeze(-1)).to(ctx.dtype)
        return grad.view(ctx.shape), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group,
                                 use_compiled: bool = False) -> torch.Tensor:
    """Per-token cross entropy (fp32) of `logits` [..., vocabulary / TP] in any dtype, each rank of
    `tp_group` holding an equal slice of the vocabulary; the logits are left as they are."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, use_compiled)
