"""The fine-tuning model: our (tensor-parallel) BERT encoder plus a small task head.

The encoder is the pretraining model's own stages (pretrain.model.bert), so every checkpoint
the pretraining side loads (native, any layout; Hugging Face) loads here through the same
HF_NAME_TABLE; its pretraining-only heads (MLM transform, MLM bias, NSP) are frozen and unused.
The task head is replicated over tensor-parallel ranks: it sees the encoder's (replicated)
output, so its gradients agree across TP ranks without communication.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.bert import build_model, logical_parameters
from pretrain.model.hf_interop import load_hf_state_dict

# Head parameter names, as Hugging Face's BertFor{SequenceClassification, MultipleChoice} spell them.
HEAD_WEIGHT, HEAD_BIAS = "classifier.weight", "classifier.bias"


class ClassifierHead(nn.Module):
    """Dropout + linear on the pooled [CLS] vector (classification, regression, multiple choice)."""

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float, init_std: float, seed: int):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_size, num_outputs)
        generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/head".encode()).digest()[:8],
                                                                 "little") & (2**63 - 1))
        with torch.no_grad():  # the same on every rank: a seeded draw, not the global generator
            self.classifier.weight.copy_(torch.empty_like(self.classifier.weight).normal_(0.0, init_std,
                                                                                          generator=generator))
            self.classifier.bias.zero_()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(pooled))


class SequenceClassifier(nn.Module):
    """BERT + ClassifierHead: logits [batch, num_outputs] (num_outputs 1 for regression)."""

    def __init__(self, bert: nn.Module, head: ClassifierHead):
        super().__init__()
        self.bert = bert
        self.head = head

    def forward(self, input_ids, token_type_ids, attention_mask):
        no_positions = torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=input_ids.device)
        _, pooled = self.bert.encode((input_ids, token_type_ids, attention_mask, no_positions))
        return self.head(pooled)


def build_encoder(model_cfg, tp_rank: int, tp_size: int, tracker) -> nn.Module:
    bert = build_model(model_cfg, model_cfg.padded_vocab_size(tp_size), torch.float32, tracker)
    for module in bert.tied.values():
        module.sparse_lookup_grad = False  # no MLM decoder in this graph: the lookup's gradient must be dense
    for lp in logical_parameters(bert):
        if lp.hf_name.startswith("cls."):
            lp.param.requires_grad_(False)  # pretraining heads: not part of the task model
    return bert


def load_encoder(bert: nn.Module, weights: dict, model_cfg, tp_rank: int, tp_size: int) -> None:
    load_hf_state_dict(bert, weights, model_cfg.padded_vocab_size(tp_size), tp_rank, tp_size)


def load_head(head: ClassifierHead, extra: dict, source: str) -> bool:
    """Take a fine-tuned checkpoint's classifier when it fits this task; True if it did."""
    weight, bias = extra.get(HEAD_WEIGHT), extra.get(HEAD_BIAS)
    if weight is None or bias is None:
        return False
    if weight.shape != head.classifier.weight.shape:
        raise ValueError(f"{source}: its classifier has {weight.shape[0]} outputs, this task needs "
                         f"{head.classifier.weight.shape[0]}")
    with torch.no_grad():
        head.classifier.weight.copy_(weight)
        head.classifier.bias.copy_(bias)
    return True


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.float(), labels)
