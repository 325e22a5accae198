"""Whole tensors (Hugging Face names, unpadded vocabulary) <-> this rank's TP shards of them,
via HF_NAME_TABLE: the padding of vocabulary-indexed rows and the slicing along each parameter's
partition dimension."""
from __future__ import annotations

import torch
from torch import nn

from ..model.bert import assign_local, local_shard
from ..model.names import VOCAB_ROWS as _VOCAB_ROWS, logical_parameters


def pad_vocab(hf_name: str, tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows to vocabulary-indexed tensors up to the padded vocabulary size."""
    if hf_name not in _VOCAB_ROWS or tensor.shape[0] == padded_vocab_size:
        return tensor
    padding = torch.zeros((padded_vocab_size - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, padding])


def unpad_vocab(hf_name: str, tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop the padding rows of vocabulary-indexed tensors (inverse of pad_vocab)."""
    return tensor[:vocab_size] if hf_name in _VOCAB_ROWS else tensor


def local_value(hf_name: str, full: torch.Tensor, padded_vocab_size: int, partition_dim: int | None,
                tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a whole (unpadded) Hugging Face tensor, as fp32."""
    return local_shard(pad_vocab(hf_name, full.detach().to(torch.float32), padded_vocab_size), partition_dim,
                       tp_rank, tp_size).contiguous()


def load_hf_state_dict(model: nn.Module, state: dict, padded_vocab_size: int, tp_rank: int,
                       tp_size: int) -> dict[int, torch.Tensor]:
    """Copy a BertForPreTraining state dict into this rank's part of the model. Returns the
    local values by id() of the parameter they went into."""
    params = logical_parameters(model)
    missing = [lp.hf_name for lp in params if lp.hf_name not in state]
    if missing:
        raise KeyError(f"Hugging Face state dict lacks {len(missing)} tensors: {', '.join(missing)}")
    values = {}
    for lp in params:
        values[id(lp.param)] = local_value(lp.hf_name, state[lp.hf_name], padded_vocab_size, lp.tp_partition_dim,
                                           tp_rank, tp_size)
        assign_local(lp.param, values[id(lp.param)])
    return values
