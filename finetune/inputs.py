"""What every task's inputs share: the tokenizer's special tokens by role, fixed-length
tokenisation, batches of the three input tensors (plus labels) sliced by example index, and
tokenised texts as such a batch source."""
from __future__ import annotations

import functools
import os
import tempfile
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only
    from pretrain.data.preprocess.special_tokens import SpecialTokens


def special_tokens(tokenizer, specials: SpecialTokens | None = None) -> SpecialTokens:
    """The special tokens by role (pad, unk, cls, sep, mask) of a loaded `tokenizers.Tokenizer`:
    `specials` when the caller has them (the fine-tuner: read with the checkpoint's tokenizer file
    and the configs beside it), else read from the tokenizer itself by the data layer's rules
    (pretrain/data/preprocess/special_tokens.py: its post-processor's template for cls and sep, a
    special token spelt [PAD] or <pad>, ...), never assumed. Raises its TokenizerError naming a
    missing role."""
    if specials is not None:
        return specials
    from pretrain.data.preprocess.tokenizer import read_special_tokens

    # the data layer reads a tokenizer from its file (and the configs beside it): a directory of its own
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "tokenizer.json")
        tokenizer.save(path)
        return read_special_tokens(path)


def fixed_length_tokenizer(tokenizer, max_length: int, specials: SpecialTokens | None = None):
    """A copy of `tokenizer` that truncates (longest first) and pads every encoding to max_length
    with its pad token. A tokenizer without a post-processor (a bare BPE tokenizer.json) gets
    BERT's template from its cls and sep tokens: [CLS] A [SEP] (B [SEP])."""
    from tokenizers.processors import TemplateProcessing

    specials = special_tokens(tokenizer, specials)
    tokenizer = tokenizer.__class__.from_str(tokenizer.to_str())
    if tokenizer.post_processor is None:
        cls, sep = specials.token("cls"), specials.token("sep")
        tokenizer.post_processor = TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, specials.cls_id), (sep, specials.sep_id)])
    tokenizer.enable_truncation(max_length, strategy="longest_first")
    tokenizer.enable_padding(length=max_length, pad_id=specials.pad_id, pad_token=specials.token("pad"))
    return tokenizer


class Batches:
    """Mixin for feature sets holding input_ids, token_type_ids, attention_mask and labels
    (None without labels), indexed by example along the first dimension; the sequence is the
    last dimension ([N, S], or [N, choices, S]). `per_token_labels`: labels are [N, S] too (cut
    with the inputs)."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None
    per_token_labels = False

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @functools.cached_property
    def lengths(self) -> torch.Tensor:
        """Real tokens of each example [N] (the longest choice's, for [N, choices, S])."""
        lengths = self.attention_mask.sum(-1)
        return lengths.amax(-1) if lengths.dim() > 1 else lengths

    def batch(self, indices, device, padding: str = "max_length", multiple: int = 1):
        """(inputs, labels) of the examples at `indices` on `device`; padding "longest": cut to
        the longest of them, rounded up to a multiple of `multiple` (padding comes last in every
        example, so nothing real is cut)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        width = self.input_ids.shape[-1]
        if padding == "longest":
            width = min(width, -(-int(self.lengths[index].max()) // multiple) * multiple)
        inputs = tuple(t[index][..., :width].to(device) for t in (self.input_ids, self.token_type_ids,
                                                                   self.attention_mask))
        labels = None
        if self.labels is not None:
            labels = self.labels[index]
            labels = (labels[..., :width] if self.per_token_labels else labels).to(device)
        return inputs, labels


def length_grouped(order: list[int], lengths, window: int) -> list[int]:
    """`order` cut into windows of `window` positions, each sorted by length, longest first
    (stable: ties keep their shuffled order); Hugging Face's group_by_length. Consecutive batches
    then hold examples of like lengths, and every position of `order` stays in its window."""
    grouped = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        grouped += sorted(chunk, key=lambda i: -int(lengths[i]))
    return grouped


class TextFeatures(Batches):
    """Texts (a string or a pair each) tokenised and padded to max_length: [N, S], or
    [N, choices, S] when every example is `choices` consecutive texts."""

    def __init__(self, tokenizer, texts: list, labels: torch.Tensor | None, max_length: int, choices: int = 1,
                 specials: SpecialTokens | None = None):
        encoded = fixed_length_tokenizer(tokenizer, max_length, specials).encode_batch(texts)
        shape = (-1, choices, max_length) if choices > 1 else (-1, max_length)
        self.input_ids = torch.tensor([e.ids for e in encoded], dtype=torch.long).view(shape)
        self.token_type_ids = torch.tensor([e.type_ids for e in encoded], dtype=torch.long).view(shape)
        self.attention_mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long).view(shape)
        self.labels = labels
