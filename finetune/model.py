"""The fine-tuning model: our (tensor-parallel) BERT encoder plus a small task head.

The encoder is the pretraining model's own stages (pretrain.model.bert), so every checkpoint
the pretraining side loads (native, any layout; Hugging Face) loads here through the same
HF_NAME_TABLE; its pretraining-only heads (MLM transform, MLM bias, NSP) are frozen and unused.
The task head is replicated over tensor-parallel ranks: it sees the encoder's (replicated)
output, so its gradients agree across TP ranks without communication.
"""
from __future__ import annotations

import torch
from torch import nn

from pretrain.checkpoint.sharding import load_hf_state_dict
from pretrain.model.bert import build_model, name_seed
from pretrain.model.names import logical_parameters


def _seeded_linear(in_features: int, out_features: int, init_std: float, seed: int, name: str) -> nn.Linear:
    """A linear layer initialised like BERT's heads (normal weights, zero bias) from a seed, so
    every rank builds the same one without touching the global generator."""
    layer = nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    with torch.no_grad():
        layer.weight.copy_(torch.empty_like(layer.weight).normal_(0.0, init_std, generator=generator))
        layer.bias.zero_()
    return layer


class ClassifierHead(nn.Module):
    """Dropout + linear on the pooled [CLS] vector (classification, regression, multiple choice) or
    on every token (token classification). Its parameters are named as in transformers'
    BertFor{SequenceClassification,MultipleChoice,TokenClassification}."""

    def __init__(self, hidden_size: int, num_outputs: int, dropout: float, init_std: float, seed: int):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = _seeded_linear(hidden_size, num_outputs, init_std, seed, "head")

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(pooled))


class SpanHead(nn.Module):
    """Start and end logits of every token (transformers' BertForQuestionAnswering.qa_outputs)."""

    def __init__(self, hidden_size: int, init_std: float, seed: int):
        super().__init__()
        self.qa_outputs = _seeded_linear(hidden_size, 2, init_std, seed, "span-head")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.qa_outputs(hidden)


def encoder_inputs(input_ids, token_type_ids, attention_mask) -> tuple:
    """The input tuple of the pretraining stages, without MLM positions (no MLM head runs)."""
    no_positions = torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=input_ids.device)
    return input_ids, token_type_ids, attention_mask, no_positions


class SequenceClassifier(nn.Module):
    """BERT + ClassifierHead: logits [batch, num_outputs] (num_outputs 1 for regression)."""

    def __init__(self, bert: nn.Module, head: ClassifierHead):
        super().__init__()
        self.bert = bert
        self.head = head

    def forward(self, input_ids, token_type_ids, attention_mask):
        # the last layer for [CLS] alone: the head reads nothing else
        return self.head(self.bert.pooled(encoder_inputs(input_ids, token_type_ids, attention_mask)))


class MultipleChoiceClassifier(SequenceClassifier):
    """Inputs [batch, choices, seq]: each choice through the encoder, one logit each -> [batch, choices]."""

    def forward(self, input_ids, token_type_ids, attention_mask):
        batch, choices, seq = input_ids.shape
        logits = super().forward(input_ids.view(-1, seq), token_type_ids.view(-1, seq), attention_mask.view(-1, seq))
        return logits.view(batch, choices)


def build_encoder(model_cfg, tp_group, tracker) -> nn.Module:
    bert = build_model(model_cfg, model_cfg.padded_vocab_size(tp_group.size()), torch.float32, tracker, tp_group)
    for module in bert.tied.values():
        module.sparse_lookup_grad = False  # no MLM decoder in this graph: the lookup's gradient must be dense
    for lp in logical_parameters(bert):
        if lp.hf_name.startswith("cls."):
            lp.param.requires_grad_(False)  # pretraining heads: not part of the task model
    return bert


def load_encoder(bert: nn.Module, weights: dict, model_cfg, tp_rank: int, tp_size: int) -> None:
    load_hf_state_dict(bert, weights, model_cfg.padded_vocab_size(tp_size), tp_rank, tp_size)


def load_head(head: nn.Module, extra: dict, source: str) -> bool:
    """Take a fine-tuned checkpoint's task head when it has this one; True if it did."""
    params = dict(head.named_parameters())
    if not all(name in extra for name in params):
        return False
    for name, param in params.items():
        if extra[name].shape != param.shape:
            raise ValueError(f"{source}: its {name} has shape {tuple(extra[name].shape)}, this task needs "
                             f"{tuple(param.shape)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(extra[name])
    return True


class TokenModel(SequenceClassifier):
    """BERT + a head on every token's hidden state: [batch, seq, outputs] (span start/end logits,
    or token classification)."""

    def forward(self, input_ids, token_type_ids, attention_mask):
        hidden, _ = self.bert.encode(encoder_inputs(input_ids, token_type_ids, attention_mask))
        return self.head(hidden)
