"""Token classification (CoNLL-2003 named entities, BERT paper section 5.3): tagged files in the
CoNLL format or JSON lines (finetune/tasks/tagging.py), a tag for every word, entity-level metrics.

* Labels: the word's first sub-token carries its tag (the paper's choice); the other sub-tokens,
  [CLS], [SEP] and padding are ignored in the loss (label -100). The model predicts IOB2 tags.
* Context: by default each document (the sentences between -DOCSTART- lines) is one token
  sequence, as the paper's "maximal document context"; task.context=sentence tags each sentence
  alone. A sequence longer than max_seq_length - 2 is cut into windows whose starts are
  task.doc_stride sub-tokens apart; training uses every window, and every word is predicted
  exactly once, from the window where its first sub-token has the most context.
* Metrics: conlleval's entity precision, recall and F1, per-type F1 and token accuracy
  (finetune/ner_metrics.py), on the tags written back in the file's scheme (IOB1 or IOB2).
* Files: the dev predictions as conlleval's input (word, gold, predicted); test files are
  predicted the same way (word, predicted; plus gold and a scores file when the file is tagged).
"""
from __future__ import annotations

import logging

import bisect
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ModelSection, TaskSection
from ..inputs import Batches, special_tokens
from ..ner_metrics import tagging_scores
from ..windows import max_context_owners, windows
from .base import Dataset, Evaluation, Read, Task, TaskDataError
from .tagging import (CONLL2003_LABELS, SCHEMES, Document, conll_text, in_scheme, iob1_evidence, iob2_labels,
                      read_tagged, split_tag, to_iob2)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only
    from tokenizers import Tokenizer
    from torch import nn

    from pretrain.config import ModelConfig
    from pretrain.data.preprocess.special_tokens import SpecialTokens

IGNORE = -100  # label of positions outside the loss (cross_entropy's ignore_index)
CONTEXTS = ("document", "sentence")


@dataclass(frozen=True)
class TokenClassificationTask(Task):
    """A tag for every word from a linear layer (ModernBERT: its head) on its first sub-token's hidden state."""

    architecture: ClassVar[str] = "BertForTokenClassification"
    modern_architecture: ClassVar[str] = "ModernBertForTokenClassification"
    feature_based: ClassVar[bool] = True
    name: str
    labels: tuple[str, ...]  # IOB2 tags; the head's outputs in this order (task.labels replaces them)
    submission: str
    train_file: str = "train.txt"
    dev_files: tuple[str, ...] = ("valid.txt",)
    test_files: tuple[tuple[str, str], ...] = (("test.txt", ""),)

    def configured(self, section: TaskSection) -> TokenClassificationTask:
        return replace(self, labels=tuple(section.labels)) if section.labels else self

    def config_problems(self, section: TaskSection) -> list[str]:
        p = iob2_labels(section.labels) if section.labels else []
        if section.tag_scheme not in SCHEMES:
            p.append(f"task.tag_scheme {section.tag_scheme!r} must be one of {', '.join(SCHEMES)}")
        if section.context not in CONTEXTS:
            p.append(f"task.context {section.context!r} must be one of {', '.join(CONTEXTS)}")
        if section.tag_column == 0:
            p.append("task.tag_column 0 is the word; CoNLL-2003's entity tags are column 3 (or -1, the last)")
        return p

    # ------------------------------------------------------------------------- reading
    def read(self, path: str, split: str, section: TaskSection) -> Read:
        documents, report = read_tagged(path, section.tag_column, self.labels)
        sentences = [s for d in documents for s in d.sentences]
        tagged = sentences[0].tags is not None
        if not tagged and split != "test":
            raise TaskDataError(f"{path}: no tag column (a {split} file needs tags)")
        evidence = iob1_evidence(sentences) if tagged else None
        if section.tag_scheme == "iob2" and evidence is not None:
            raise TaskDataError(f"{path}:{evidence}: an entity starts with I-, which is IOB1 "
                                "(set task.tag_scheme to iob1 or auto)")
        scheme = section.tag_scheme if section.tag_scheme != "auto" else "iob2" if evidence is None else "iob1"
        if tagged:
            self._check_types(path, sentences)
        if section.context == "sentence":
            documents = [Document([s], d.docstart and i == 0) for d in documents for i, s in enumerate(d.sentences)]
        return Read(documents, report, scheme)

    def _check_types(self, path: str, sentences: list) -> None:
        """Every entity type of the file is one the head predicts."""
        known = {split_tag(label)[1] for label in self.labels} - {None}
        for sentence in sentences:
            for tag, line in zip(sentence.tags, sentence.lines):
                if tag != "O" and split_tag(tag)[1] not in known:
                    unknown = sorted({split_tag(t)[1] for s in sentences for t in s.tags} - known - {None})
                    raise TaskDataError(
                        f"{path}:{line}: tag {tag}: the task's labels have the types {', '.join(sorted(known))}; "
                        f"this file also has {', '.join(unknown)}: give task.labels with O and B-/I- of every type")

    # ------------------------------------------------------------------------- inputs
    def encode(self, tokenizer: Tokenizer, examples: list[Document], section: TaskSection,
               training: bool, specials: SpecialTokens | None = None) -> TaggingFeatures:
        features = build_tagging_features(tokenizer, examples, self.labels, section.max_seq_length,
                                          section.doc_stride, specials)
        words = sum(features.words_per_example)
        longer = sum(n > 1 for n in features.windows_per_example)
        logger.info(f"  {len(examples):,} {section.context}s, {words:,} words -> {len(features):,} windows "
                    f"({longer:,} need more than one); {features.split_words:,} words split into sub-tokens"
                    + (f", {features.unknown_words:,} with no token ([UNK])" if features.unknown_words else ""))
        return features

    def build_model(self, encoder: nn.Module, model_cfg: ModelConfig, section: ModelSection, seed: int) -> nn.Module:
        from ..model import TokenModel, task_head  # megatron-core: imported once a model is built

        return TokenModel(encoder, task_head(model_cfg, len(self.labels), section.classifier_dropout, seed))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross entropy over the labelled positions (first sub-tokens) of the micro-batch."""
        labels = labels.flatten()
        total = F.cross_entropy(logits.float().flatten(0, -2), labels, ignore_index=IGNORE, reduction="sum")
        return total / (labels != IGNORE).sum().clamp(min=1)  # a window of continuation sub-tokens only: 0, not NaN

    # ------------------------------------------------------------------------- outputs
    def evaluate(self, dev: Dataset, logits: np.ndarray, section: TaskSection) -> Evaluation:
        return self.evaluate_words(dev, word_predictions(dev.features, logits))

    def submission_files(self, test: Dataset, logits: np.ndarray, section: TaskSection) -> dict[str, str]:
        return self.submission_words(test, word_predictions(test.features, logits))

    # the same from label indexes per word of every document (the feature-based tagger's outputs too)
    def evaluate_words(self, dev: Dataset, predicted: list[list[int]]) -> Evaluation:
        tags = sentence_tags(dev.examples, predicted, self.labels, dev.reference)
        gold = [s.tags for d in dev.examples for s in d.sentences]
        return Evaluation(tagging_scores(gold, tags), {f"{dev.name}.txt": conll_text(dev.examples, tags)})

    def submission_words(self, test: Dataset, predicted: list[list[int]]) -> dict[str, str]:
        """The predictions as conlleval's input; with the scores when the file is tagged."""
        tags = sentence_tags(test.examples, predicted, self.labels, test.reference)
        files = {f"{test.name}.txt": conll_text(test.examples, tags)}
        gold = [s.tags for d in test.examples for s in d.sentences]
        if gold[0] is not None:
            files[f"{test.name}.scores.json"] = json.dumps(tagging_scores(gold, tags), indent=1)
        return files

    def export_config(self) -> dict:
        return {"num_labels": len(self.labels), "finetuning_task": self.name,
                "id2label": dict(enumerate(self.labels)), "label2id": {t: i for i, t in enumerate(self.labels)}}


NER_TASKS = {"conll2003": TokenClassificationTask("conll2003", CONLL2003_LABELS, "conll2003")}


@dataclass
class TaggingFeatures(Batches):
    """Every window of every document: model inputs, labels (-100 off the first sub-tokens), and
    the words each window predicts."""

    per_token_labels = True  # a label per position: cut with the inputs under dynamic padding
    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None  # [N, seq]; None for an untagged file
    example_index: list[int] = field(default_factory=list)
    predicts: list[list[tuple[int, int]]] = field(default_factory=list)  # per window: (word, position) it predicts
    words_per_example: list[int] = field(default_factory=list)
    windows_per_example: list[int] = field(default_factory=list)
    split_words: int = 0
    unknown_words: int = 0


def word_pieces(tokenizer, documents: list[Document],
                specials: SpecialTokens | None = None) -> tuple[list[list[list[int]]], int, int]:
    """Sub-token ids of every word of every document (the unknown token, [UNK], for a word that
    normalises to nothing), the number of words split into several sub-tokens, and of words with
    none. A tokenizer without an unknown token (a byte-level BPE never needs one) that gives a word
    no token is an error naming the word.

    Words are cut as in the document's running text: a byte-level BPE without add_prefix_space
    (ModernBERT's, GPT-2's) marks a word after a space with 'Ġ', which a word given alone lacks, so
    every word but a document's first is given with the space before it."""
    unk = special_tokens(tokenizer, specials).unk_id
    tokenizer = tokenizer.__class__.from_str(tokenizer.to_str())
    tokenizer.no_truncation()
    tokenizer.no_padding()
    words_of = [d.words for d in documents]
    if _byte_level_without_prefix_space(tokenizer):
        words_of = [words[:1] + [" " + word for word in words[1:]] for words in words_of]
    encodings = tokenizer.encode_batch(words_of, is_pretokenized=True, add_special_tokens=False)
    pieces, split, unknown = [], 0, 0
    for document, encoding in zip(documents, encodings):
        words = [[] for _ in range(document.num_words)]
        for token, word in zip(encoding.ids, encoding.word_ids):
            words[word].append(token)
        for w, word in enumerate(words):
            split += len(word) > 1
            if not word:
                if unk is None:
                    line = [line for sentence in document.sentences for line in sentence.lines][w]
                    raise TaskDataError(f"line {line}: the word {document.words[w]!r} gives no token and the "
                                        "tokenizer has no unknown token to stand for it")
                word.append(unk)
                unknown += 1
        pieces.append(words)
    return pieces, split, unknown


def _byte_level_without_prefix_space(tokenizer) -> bool:
    """Whether the tokenizer's pre-tokenizer (or one in its Sequence) is ByteLevel without add_prefix_space."""
    pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any(step.get("type") == "ByteLevel" and not step.get("add_prefix_space") for step in steps)


def build_tagging_features(tokenizer, documents: list[Document], labels: tuple[str, ...], max_seq_length: int,
                           stride: int, specials: SpecialTokens | None = None) -> TaggingFeatures:
    """[CLS] window [SEP] rows (the tokenizer's own cls, sep and pad tokens; `specials` None: read
    from it, finetune.inputs.special_tokens)."""
    specials = special_tokens(tokenizer, specials)
    cls_id, sep_id, pad_id = specials.cls_id, specials.sep_id, specials.pad_id
    label_id = {tag: i for i, tag in enumerate(labels)}
    pieces, split, unknown = word_pieces(tokenizer, documents, specials)
    tagged = documents[0].sentences[0].tags is not None
    rows = {"ids": [], "mask": [], "labels": [], "example": [], "predicts": []}
    windows_per_example = []
    for example, (document, words) in enumerate(zip(documents, pieces)):
        gold = [label_id[t] for s in document.sentences for t in to_iob2(s.tags)] if tagged else None
        tokens = [token for word in words for token in word]
        first = np.cumsum([0] + [len(word) for word in words[:-1]]).tolist()  # each word's first sub-token
        spans = windows(len(tokens), max_seq_length - 2, stride)
        windows_per_example.append(len(spans))
        owner = max_context_owners(spans, first)
        for window, (start, length) in enumerate(spans):
            ids = [cls_id, *tokens[start:start + length], sep_id]
            inside = range(bisect.bisect_left(first, start), bisect.bisect_left(first, start + length))
            row_labels = [IGNORE] * max_seq_length
            if tagged:
                for w in inside:
                    row_labels[first[w] - start + 1] = gold[w]
            padding = max_seq_length - len(ids)
            rows["ids"].append(ids + [pad_id] * padding)
            rows["mask"].append([1] * len(ids) + [0] * padding)
            rows["labels"].append(row_labels)
            rows["example"].append(example)
            rows["predicts"].append([(w, first[w] - start + 1) for w in inside if owner[w] == window])
    ids = torch.tensor(rows["ids"], dtype=torch.long)
    return TaggingFeatures(ids, torch.zeros_like(ids), torch.tensor(rows["mask"], dtype=torch.long),
                           torch.tensor(rows["labels"], dtype=torch.long) if tagged else None, rows["example"],
                           rows["predicts"], [d.num_words for d in documents], windows_per_example, split, unknown)


def word_predictions(features: TaggingFeatures, logits: np.ndarray) -> list[list[int]]:
    """The label index of every word of every document, each from the one window that predicts it."""
    predicted = [[-1] * n for n in features.words_per_example]
    for window, example in enumerate(features.example_index):
        for word, position in features.predicts[window]:
            predicted[example][word] = int(logits[window, position].argmax())
    missing = [(e, w) for e, words in enumerate(predicted) for w, p in enumerate(words) if p < 0]
    if missing:
        raise AssertionError(f"{len(missing)} words no window predicts, e.g. document {missing[0][0]} word {missing[0][1]}")
    return predicted


def sentence_tags(documents: list[Document], predicted: list[list[int]], labels: tuple[str, ...],
                  scheme: str) -> list[list[str]]:
    """Label indexes per document -> tags per sentence, in `scheme` (IOB1 or IOB2)."""
    out = []
    for document, words in zip(documents, predicted):
        position = 0
        for sentence in document.sentences:
            tags = [labels[i] for i in words[position:position + len(sentence.words)]]
            position += len(sentence.words)
            out.append(in_scheme(tags, scheme))
    return out

