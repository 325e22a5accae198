"""What every task's inputs share: fixed-length tokenisation, batches of the three input tensors
(plus labels) sliced by example index, and tokenised texts as such a batch source."""
from __future__ import annotations

import torch


def fixed_length_tokenizer(tokenizer, max_length: int):
    """A copy of `tokenizer` that truncates (longest first) and pads every encoding to max_length."""
    tokenizer = tokenizer.__class__.from_str(tokenizer.to_str())
    tokenizer.enable_truncation(max_length, strategy="longest_first")
    tokenizer.enable_padding(length=max_length, pad_id=tokenizer.token_to_id("[PAD]"), pad_token="[PAD]")
    return tokenizer


class Batches:
    """Mixin for feature sets holding input_ids, token_type_ids, attention_mask and labels
    (None without labels), indexed by example along the first dimension."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices, device):
        index = torch.as_tensor(indices, dtype=torch.long)
        inputs = (self.input_ids[index].to(device), self.token_type_ids[index].to(device),
                  self.attention_mask[index].to(device))
        return inputs, (self.labels[index].to(device) if self.labels is not None else None)


class TextFeatures(Batches):
    """Texts (a string or a pair each) tokenised and padded to max_length: [N, S], or
    [N, choices, S] when every example is `choices` consecutive texts."""

    def __init__(self, tokenizer, texts: list, labels: torch.Tensor | None, max_length: int, choices: int = 1):
        encoded = fixed_length_tokenizer(tokenizer, max_length).encode_batch(texts)
        shape = (-1, choices, max_length) if choices > 1 else (-1, max_length)
        self.input_ids = torch.tensor([e.ids for e in encoded], dtype=torch.long).view(shape)
        self.token_type_ids = torch.tensor([e.type_ids for e in encoded], dtype=torch.long).view(shape)
        self.attention_mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long).view(shape)
        self.labels = labels
