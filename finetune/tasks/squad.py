"""SQuAD 1.1 and 2.0: reading the JSON, windows over long contexts, training labels, and the
post-processing that turns start/end logits into answers (google-research/bert's run_squad.py
semantics, with the tokenizer's character offsets so answers are cut from the original context).

* Windows: the question (at most max_query_length tokens) is followed by a window of the context;
  window starts are doc_stride tokens apart (doc_stride is the step between starts, as in
  run_squad.py, not an overlap as in Hugging Face's tokenizers).
* Training labels: the answer's first and last tokens; [CLS] (position 0) when the question is
  impossible (2.0) or the answer is not wholly inside the window.
* Post-processing: the n_best starts and ends of every window, spans of at most
  max_answer_length tokens inside the context, whose start token has its maximum context in that
  window (the token's window with the most context on its shorter side), ranked by start + end
  logit; 2.0's null score is the minimum over the question's windows of start[0] + end[0], its
  null odds = null score - best non-null score, and the answer is "" when the odds exceed
  null_score_diff_threshold.
* Training: the mean of the start and end cross entropies; evaluation: the official scripts
  (finetune/squad_metrics.py) on the raw articles, with run_squad.py's prediction files.
"""
from __future__ import annotations

import logging

import collections
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.common.textfile import read_text

from ..config import ModelSection, TaskSection
from ..inputs import Batches, special_tokens
from ..squad_metrics import evaluate_v1, evaluate_v2
from ..windows import is_max_context, windows
from .base import Dataset, Evaluation, Read, ReadReport, Task, TaskDataError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only
    from tokenizers import Tokenizer
    from torch import nn

    from pretrain.config import ModelConfig
    from pretrain.data.preprocess.special_tokens import SpecialTokens


@dataclass(frozen=True)
class SquadTask(Task):
    """Span extraction: start and end logits on every token of every window."""

    architecture: ClassVar[str] = "BertForQuestionAnswering"
    modern_architecture: ClassVar[str] = "ModernBertForQuestionAnswering"
    name: str
    version: str  # "1.1" or "2.0" (unanswerable questions)
    train_file: str
    dev_files: tuple[str, ...]
    submission: str = "SQuAD"
    test_files: tuple[tuple[str, str], ...] = ()  # the official test sets are hidden

    def config_problems(self, section: TaskSection) -> list[str]:
        if section.max_seq_length - section.max_query_length - 3 < 1:
            return [f"task.max_seq_length ({section.max_seq_length}) leaves no room for the context after "
                    f"max_query_length ({section.max_query_length}) + 3 special tokens"]
        return []

    def read(self, path: str, split: str, section: TaskSection) -> Read:
        examples, data, report = read_squad(path, self.version, training=split == "train")
        return Read(examples, report, data)

    def encode(self, tokenizer: Tokenizer, examples: list[SquadExample], section: TaskSection,
               training: bool, specials: SpecialTokens | None = None) -> SquadFeatures:
        features = build_features(tokenizer, examples, section.max_seq_length, section.doc_stride,
                                   section.max_query_length, training, specials)
        longer = sum(n > 1 for n in features.windows_per_example)
        logger.info(f"  {len(examples):,} questions -> {len(features):,} windows ({longer:,} contexts need "
                    f"more than one); {features.truncated_questions:,} questions truncated to "
                    f"{section.max_query_length} tokens")
        return features

    def build_model(self, encoder: nn.Module, model_cfg: ModelConfig, section: ModelSection, seed: int) -> nn.Module:
        from ..model import TokenModel, task_head  # megatron-core: imported once a model is built

        # BERT: qa_outputs; ModernBERT: its classifier with the two outputs start and end
        return TokenModel(encoder, task_head(model_cfg, 2, section.classifier_dropout, seed, span=True))

    def loss(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Mean of the start and end cross entropies (run_squad.py's loss)."""
        logits = logits.float()
        return (F.cross_entropy(logits[..., 0], positions[:, 0]) + F.cross_entropy(logits[..., 1], positions[:, 1])) / 2

    def answers(self, data: Dataset, logits: np.ndarray, section: TaskSection) -> tuple[dict, dict, dict]:
        """(predictions, n-best lists, null odds) by question id."""
        return postprocess(data.examples, data.features, logits, self.version, section.n_best_size,
                           section.max_answer_length, section.null_score_diff_threshold)

    def evaluate(self, dev: Dataset, logits: np.ndarray, section: TaskSection) -> Evaluation:
        """The official evaluation, and the prediction files of google-research/bert's run_squad.py."""
        predictions, nbest, null_odds = self.answers(dev, logits, section)
        if self.version == "1.1":
            values = evaluate_v1(dev.reference, predictions)
        else:
            values = evaluate_v2(dev.reference, predictions, null_odds)
        outputs = {"predictions.json": predictions, "nbest_predictions.json": nbest}
        if self.version == "2.0":
            outputs["null_odds.json"] = null_odds
        return Evaluation({k: float(v) for k, v in values.items() if not k.endswith("total")},
                          {f"{dev.name}/{file}": json.dumps(content, indent=1) for file, content in outputs.items()})

    def submission_files(self, test: Dataset, logits: np.ndarray, section: TaskSection) -> dict[str, str]:
        """The answers in the format the official evaluation reads: {question id: text}."""
        predictions, _, _ = self.answers(test, logits, section)
        return {f"{test.name}.json": json.dumps(predictions, indent=1)}


SQUAD_TASKS = {
    "squad": SquadTask("squad", "1.1", "train-v1.1.json", ("dev-v1.1.json",)),
    "squad2": SquadTask("squad2", "2.0", "train-v2.0.json", ("dev-v2.0.json",)),
}


@dataclass
class SquadExample:
    qid: str
    question: str
    context: str
    answers: list[dict]  # the gold answers {"text", "answer_start"} (evaluation uses their texts)
    is_impossible: bool
    label: tuple[int, int] | None = None  # character span of the training answer (start, end exclusive)


def read_squad(path: str, version: str, training: bool) -> tuple[list[SquadExample], list[dict], ReadReport]:
    """Examples and the raw `data` list (for the official evaluation). In training files an
    answer whose answer_start does not point at its text is skipped and counted."""
    report = ReadReport(path, unit="questions")
    try:
        document = json.loads(read_text(path, TaskDataError))
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{path}: not valid JSON ({e})") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise TaskDataError(f"{path}: expected {{\"version\": ..., \"data\": [articles]}}")
    examples = []
    for a, article in enumerate(data):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise TaskDataError(f"{path}: data[{a}] has no \"paragraphs\" list (SQuAD's layout: "
                                "data[].paragraphs[].context and .qas[])")
        for p, paragraph in enumerate(article["paragraphs"]):
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str):
                raise TaskDataError(f"{path}: data[{a}].paragraphs[{p}] has no context")
            for q, qa in enumerate(paragraph.get("qas", [])):
                report.rows += 1
                where = f"{path}: data[{a}].paragraphs[{p}].qas[{q}]"
                if "id" not in qa or "question" not in qa:
                    raise TaskDataError(f"{where}: needs 'id' and 'question'")
                answers = qa.get("answers", [])
                impossible = bool(qa.get("is_impossible", False)) or (version == "2.0" and not answers)
                if version == "1.1" and not answers:
                    raise TaskDataError(f"{where} ({qa['id']}): no answers in a SQuAD 1.1 file")
                label = None
                if training and not impossible:
                    first = answers[0]
                    start, text = first.get("answer_start"), first.get("text", "")
                    if not isinstance(start, int) or context[start:start + len(text)] != text or not text:
                        report.skip("answer_start does not point at the answer text", f"{where} ({qa['id']})")
                        continue
                    label = (start, start + len(text))
                examples.append(SquadExample(str(qa["id"]), qa["question"], context, answers, impossible, label))
    if not examples:
        raise TaskDataError(f"{path}: no questions" + (f" ({report.summary()})" if report.skipped else ""))
    report.examples = len(examples)
    return examples, data, report


@dataclass
class SquadFeatures(Batches):
    """Every window of every question: model inputs plus what post-processing needs."""

    input_ids: torch.Tensor
    token_type_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None  # [N, 2] start/end positions (training)
    example_index: list[int] = field(default_factory=list)
    offsets: list[list[tuple[int, int] | None]] = field(default_factory=list)  # per position: context chars, None outside the context
    max_context: list[list[bool]] = field(default_factory=list)
    windows_per_example: list[int] = field(default_factory=list)
    truncated_questions: int = 0


def build_features(tokenizer, examples: list[SquadExample], max_seq_length: int, doc_stride: int,
                   max_query_length: int, training: bool, specials: SpecialTokens | None = None) -> SquadFeatures:
    """[CLS] question [SEP] window [SEP] rows (the tokenizer's own cls, sep and pad tokens; `specials`
    None: read from it, finetune.inputs.special_tokens)."""
    specials = special_tokens(tokenizer, specials)
    cls_id, sep_id, pad_id = specials.cls_id, specials.sep_id, specials.pad_id
    rows = collections.defaultdict(list)
    truncated = 0
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    contexts = tokenizer.encode_batch([e.context for e in examples], add_special_tokens=False)
    windows_per_example = []
    for example_index, (example, question, context) in enumerate(zip(examples, questions, contexts)):
        query = question.ids[:max_query_length]
        truncated += len(question.ids) > max_query_length
        max_tokens = max_seq_length - len(query) - 3
        spans = windows(len(context.ids), max_tokens, doc_stride)
        windows_per_example.append(len(spans))
        answer_tokens = None
        if training and example.label is not None:
            char_start, char_end = example.label
            inside = [i for i, (s, e) in enumerate(context.offsets) if e > char_start and s < char_end]
            answer_tokens = (inside[0], inside[-1]) if inside else None
        for window, (start, length) in enumerate(spans):
            ids = [cls_id, *query, sep_id, *context.ids[start:start + length], sep_id]
            types = [0] * (len(query) + 2) + [1] * (length + 1)
            offsets = [None] * (len(query) + 2) + list(context.offsets[start:start + length]) + [None]
            max_context = [False] * (len(query) + 2) + [is_max_context(spans, window, start + i)
                                                        for i in range(length)] + [False]
            label = (0, 0)
            if answer_tokens is not None and start <= answer_tokens[0] and answer_tokens[1] < start + length:
                label = (answer_tokens[0] - start + len(query) + 2, answer_tokens[1] - start + len(query) + 2)
            padding = max_seq_length - len(ids)
            rows["ids"].append(ids + [pad_id] * padding)
            rows["types"].append(types + [0] * padding)
            rows["mask"].append([1] * len(ids) + [0] * padding)
            rows["labels"].append(label)
            rows["example"].append(example_index)
            rows["offsets"].append(offsets + [None] * padding)
            rows["max_context"].append(max_context + [False] * padding)
    return SquadFeatures(
        torch.tensor(rows["ids"], dtype=torch.long), torch.tensor(rows["types"], dtype=torch.long),
        torch.tensor(rows["mask"], dtype=torch.long),
        torch.tensor(rows["labels"], dtype=torch.long) if training else None,
        rows["example"], rows["offsets"], rows["max_context"], windows_per_example, truncated)


@dataclass
class Prediction:
    text: str
    score: float  # start logit + end logit
    start_logit: float
    end_logit: float


def postprocess(examples: list[SquadExample], features: SquadFeatures, logits: np.ndarray, version: str,
                n_best_size: int = 20, max_answer_length: int = 30, null_score_diff_threshold: float = 0.0):
    """(predictions {qid: text}, n-best {qid: [{text, probability, start_logit, end_logit}]},
    null odds {qid: float} for 2.0) from the [N, seq, 2] start/end logits of every window (read
    up to the window's real length)."""
    by_example = collections.defaultdict(list)
    for feature, example in enumerate(features.example_index):
        by_example[example].append(feature)
    predictions, nbest_json, null_odds = {}, {}, {}
    for example_index, example in enumerate(examples):
        candidates, null_score, null_logits = [], math.inf, (0.0, 0.0)
        for feature in by_example[example_index]:
            # the window's real positions only: padding's logits (whatever a batch's padding made
            # of them) never take an n-best place from a real span
            real = int(features.lengths[feature])
            start, end = logits[feature, :real, 0], logits[feature, :real, 1]
            offsets, max_context = features.offsets[feature], features.max_context[feature]
            if start[0] + end[0] < null_score:
                null_score, null_logits = float(start[0] + end[0]), (float(start[0]), float(end[0]))
            starts = np.argsort(-start, kind="stable")[:n_best_size]
            ends = np.argsort(-end, kind="stable")[:n_best_size]
            for s in starts:
                if offsets[s] is None or not max_context[s]:
                    continue
                for e in ends:
                    if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    candidates.append((float(start[s] + end[e]), float(start[s]), float(end[e]),
                                       offsets[s][0], offsets[e][1]))
        candidates.sort(key=lambda c: -c[0])
        nbest, seen = [], set()
        for score, start_logit, end_logit, char_start, char_end in candidates:
            text = example.context[char_start:char_end]
            if text in seen:
                continue
            seen.add(text)
            nbest.append(Prediction(text, score, start_logit, end_logit))
            if len(nbest) == n_best_size:
                break
        if version == "2.0" and "" not in seen:
            nbest.append(Prediction("", null_score, *null_logits))
            nbest.sort(key=lambda p: -p.score)
        if not nbest:
            nbest = [Prediction("", 0.0, 0.0, 0.0)]
        scores = np.array([p.score for p in nbest])
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        nbest_json[example.qid] = [{"text": p.text, "probability": float(q), "start_logit": p.start_logit,
                                    "end_logit": p.end_logit} for p, q in zip(nbest, probabilities)]
        best_non_null = next((p for p in nbest if p.text), None)
        if version == "1.1":
            predictions[example.qid] = nbest[0].text
            continue
        difference = null_score - (best_non_null.score if best_non_null else -math.inf)
        null_odds[example.qid] = float(min(difference, 1e9))
        predictions[example.qid] = "" if best_non_null is None or difference > null_score_diff_threshold \
            else best_non_null.text
    return predictions, nbest_json, null_odds
