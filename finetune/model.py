"""The fine-tuning model: our (tensor-parallel) encoder plus a small task head.

The encoder is the pretraining model's own stages (pretrain.model.bert), so every checkpoint
the pretraining side loads (native, any layout; Hugging Face) loads here through the same
HF_NAME_TABLE; its pretraining-only heads (BERT: MLM transform, MLM bias, NSP; ModernBERT: the
MLM head and decoder bias) are frozen and unused. The task head is replicated over
tensor-parallel ranks: it sees the encoder's (replicated) output, so its gradients agree across
TP ranks without communication.

Heads by family, each named as its transformers class names it so that the export is that class:
- BERT: dropout + linear on the pooled (tanh pooler) [CLS] or on every token (`classifier`), or
  the span head (`qa_outputs`);
- ModernBERT: every task class (ModernBertFor{SequenceClassification,MultipleChoice,
  QuestionAnswering,TokenClassification}) is `head` (ModernBertPredictionHead: dense -> GELU ->
  LayerNorm) -> dropout -> `classifier`, on the pooled vector (model.classifier_pooling: cls or
  mean, no tanh pooler) or on every token; question answering's classifier has the two outputs
  start and end. `head` starts from the checkpoint's MLM-head transform (the same names:
  transformers loads a ModernBertForMaskedLM into a task class that way), `classifier` fresh.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.checkpoint.format import head_of
from pretrain.checkpoint.sharding import load_hf_state_dict
from pretrain.model.bert import build_model, name_seed
from pretrain.model.names import logical_parameters

# Pretraining heads no fine-tuning graph runs (checkpoint.format.HEADS); BERT's pooler is not
# one of them: its sequence heads read the pooled [CLS].
PRETRAINING_ONLY_HEADS = ("MLM head", "next-sentence head")


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


class PredictionHead(nn.Module):
    """transformers' ModernBertPredictionHead: dense (bias: classifier_bias) -> GELU -> LayerNorm
    (bias: norm_bias); the pretraining MLM head's transform has the same form and names."""

    def __init__(self, model_cfg):
        super().__init__()
        hidden = model_cfg.hidden_size
        self.dense = nn.Linear(hidden, hidden, bias=model_cfg.classifier_bias)
        self.norm = nn.LayerNorm(hidden, eps=model_cfg.layernorm_epsilon, bias=model_cfg.norm_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(hidden)))


class ModernHead(nn.Module):
    """ModernBERT's task head (every ModernBertFor* class): `head` -> dropout -> `classifier`, on
    the pooled vector or on every token. Parameter names are the transformers class's less its
    `model.` encoder: head.dense.*, head.norm.*, classifier.*."""

    def __init__(self, model_cfg, num_outputs: int, dropout: float, seed: int):
        super().__init__()
        self.head = PredictionHead(model_cfg)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(model_cfg.hidden_size, num_outputs)
        # ModernBertPreTrainedModel._init_weights' "final_out": normal truncated at
        # initializer_cutoff_factor (our exports write 2.0) standard deviations, std hidden_size ** -0.5
        std = model_cfg.hidden_size ** -0.5
        generator = torch.Generator().manual_seed(name_seed(seed, "modern-classifier"))
        with torch.no_grad():
            nn.init.trunc_normal_(self.classifier.weight, 0.0, std, -2.0 * std, 2.0 * std, generator=generator)
            self.classifier.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.drop(self.head(hidden)))

    def start_from(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """`head` (the transform) from `tensors` by its names (head.dense.weight, ...)."""
        with torch.no_grad():
            for name, param in self.head.named_parameters(prefix="head"):
                if tuple(tensors[name].shape) != tuple(param.shape):
                    raise ValueError(f"{source}: its {name} has shape {tuple(tensors[name].shape)}, this model needs "
                                     f"{tuple(param.shape)}")
                param.copy_(tensors[name])


def task_head(model_cfg, num_outputs: int, dropout: float, seed: int, span: bool = False) -> nn.Module:
    """The task head of the encoder family: ModernHead for ModernBERT; for BERT ClassifierHead, or
    SpanHead (`span`: start and end logits, transformers' qa_outputs)."""
    if model_cfg.modern:
        return ModernHead(model_cfg, num_outputs, dropout, seed)
    if span:
        return SpanHead(model_cfg.hidden_size, model_cfg.init_std, seed)
    return ClassifierHead(model_cfg.hidden_size, num_outputs, dropout, model_cfg.init_std, seed)


def encoder_inputs(input_ids, token_type_ids, attention_mask) -> tuple:
    """The input tuple of the pretraining stages, without MLM positions (no MLM head runs).
    ModernBERT reads past the token types."""
    no_positions = torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=input_ids.device)
    return input_ids, token_type_ids, attention_mask, no_positions


class SequenceClassifier(nn.Module):
    """Encoder + head on the pooled vector: logits [batch, num_outputs] (num_outputs 1 for
    regression). BERT pools with its tanh pooler on [CLS]; ModernBERT per classifier_pooling."""

    def __init__(self, bert: nn.Module, head: nn.Module):
        super().__init__()
        self.bert = bert
        self.head = head

    def forward(self, input_ids, token_type_ids, attention_mask):
        # BERT: the last layer for [CLS] alone: the head reads nothing else
        return self.head(self.bert.pooled(encoder_inputs(input_ids, token_type_ids, attention_mask)))


class MultipleChoiceClassifier(SequenceClassifier):
    """Inputs [batch, choices, seq]: each choice through the encoder, one logit each -> [batch, choices].
    (ModernBertForMultipleChoice's cls pooling takes the first real token: with our right-side
    padding, the first.)"""

    def forward(self, input_ids, token_type_ids, attention_mask):
        batch, choices, seq = input_ids.shape
        logits = super().forward(input_ids.view(-1, seq), token_type_ids.view(-1, seq), attention_mask.view(-1, seq))
        return logits.view(batch, choices)


def build_encoder(model_cfg, tp_group, tracker) -> nn.Module:
    bert = build_model(model_cfg, model_cfg.padded_vocab_size(tp_group.size()), torch.float32, tracker, tp_group)
    for module in bert.tied.values():
        module.sparse_lookup_grad = False  # no MLM decoder in this graph: the lookup's gradient must be dense
    for lp in logical_parameters(bert):
        if head_of(lp.hf_name) in PRETRAINING_ONLY_HEADS:
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


def initialise_head(head: nn.Module, ckpt) -> str | None:
    """The task head's starting weights from the checkpoint, as transformers would load that
    checkpoint into the task class; a line for the log, or None (a fresh head: BERT's from a
    pretrained checkpoint). Raises ValueError on a shape that does not fit.

    - this task's head whole (a fine-tuned checkpoint of the same head shape): taken;
    - ModernBERT otherwise: `head` (the transform) from a fine-tuned checkpoint's task transform,
      else from the MLM head's (head.dense.*, head.norm.*: the same names), `classifier` fresh."""
    if load_head(head, ckpt.extra, ckpt.source):
        return f"task head ({', '.join(n for n, _ in head.named_parameters())}) taken from {ckpt.source}"
    if not isinstance(head, ModernHead):
        return None
    names = [name for name, _ in head.head.named_parameters(prefix="head")]
    if all(name in ckpt.extra for name in names):
        head.start_from(ckpt.extra, ckpt.source)
        return f"task head's transform ({', '.join(names)}) taken from {ckpt.source}'s task head; classifier new"
    head.start_from(ckpt.weights, ckpt.source)
    untrained = " (an initialised one: the checkpoint had none)" if "MLM head" in ckpt.initialised_heads else ""
    return f"task head's transform ({', '.join(names)}) taken from {ckpt.source}'s MLM head{untrained}; classifier new"


class TokenModel(SequenceClassifier):
    """Encoder + a head on every token's hidden state (ModernBERT: after its final norm):
    [batch, seq, outputs] (span start/end logits, or token classification)."""

    def forward(self, input_ids, token_type_ids, attention_mask):
        hidden, _ = self.bert.encode(encoder_inputs(input_ids, token_type_ids, attention_mask))
        return self.head(hidden)
