"""SQuAD evaluation, identical to the official evaluate-v1.1.py and evaluate-v2.0.py.

Both normalise an answer the same way (lowercase; drop ASCII punctuation, i.e.
`string.punctuation`, so other Unicode punctuation is kept; drop the articles a/an/the;
collapse whitespace) and take the maximum over the gold answers. They differ where the
official scripts differ:

* v1.1: a question without a prediction counts in the total with score 0; F1 against an empty
  normalised answer is 0; the result is {"exact_match", "f1"}.
* v2.0: gold answers that normalise to "" are ignored, and a question without any is answered
  correctly only by "" (F1 is 1 when both are empty, else 0); questions without a prediction
  are left out of the total; with a no-answer probability per question, predictions whose
  probability exceeds `na_prob_thresh` count as "no answer", the result is broken down by
  HasAns/NoAns, and best_exact/best_f1 with their thresholds are searched over the
  probabilities. The keys and their order are the official script's.
"""
from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    text = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _tokens(s: str) -> list[str]:
    return normalize_answer(s).split() if s else []


def _overlap_f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = collections.Counter(prediction_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


# ----------------------------------------------------------------------------- v1.1
def exact_match_v1(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def f1_v1(prediction: str, gold: str) -> float:
    return _overlap_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def _questions(dataset: list[dict]):
    for article in dataset:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def evaluate_v1(dataset: list[dict], predictions: dict[str, str], warn=lambda message: None) -> dict:
    """evaluate-v1.1.py's evaluate(): {"exact_match": %, "f1": %}."""
    f1 = exact = total = 0.0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            warn(f"Unanswered question {qa['id']} will receive score 0.")
            continue
        golds = [a["text"] for a in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact += max(exact_match_v1(prediction, g) for g in golds)
        f1 += max(f1_v1(prediction, g) for g in golds)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


# ----------------------------------------------------------------------------- v2.0
def exact_v2(gold: str, prediction: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def f1_v2(gold: str, prediction: str) -> float:
    gold_tokens, prediction_tokens = _tokens(gold), _tokens(prediction)
    if not gold_tokens or not prediction_tokens:  # no-answer on either side: 1 if both agree
        return float(gold_tokens == prediction_tokens)
    return _overlap_f1(prediction_tokens, gold_tokens)


def has_answer_by_id(dataset: list[dict]) -> dict[str, bool]:
    return {qa["id"]: bool(qa["answers"]) for qa in _questions(dataset)}


def raw_scores_v2(dataset: list[dict], predictions: dict[str, str], warn=lambda message: None):
    exact, f1 = {}, {}
    for qa in _questions(dataset):
        qid = qa["id"]
        golds = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])] or [""]
        if qid not in predictions:
            warn(f"Missing prediction for {qid}")
            continue
        exact[qid] = max(exact_v2(g, predictions[qid]) for g in golds)
        f1[qid] = max(f1_v2(g, predictions[qid]) for g in golds)
    return exact, f1


def _apply_threshold(scores, na_probs, has_answer, threshold):
    return {qid: float(not has_answer[qid]) if na_probs[qid] > threshold else s for qid, s in scores.items()}


def _summary(exact, f1, qids=None) -> dict:
    qids = list(exact) if not qids else qids
    total = len(qids)
    return {"exact": 100.0 * sum(exact[q] for q in qids) / total, "f1": 100.0 * sum(f1[q] for q in qids) / total,
            "total": total}


def best_threshold(predictions, scores, na_probs, has_answer) -> tuple[float, float]:
    """evaluate-v2.0.py's find_best_thresh: the threshold on the no-answer probability that
    maximises the score when every question above it is answered with no answer."""
    score = best = sum(1 for q in has_answer if not has_answer[q])
    threshold = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            score += scores[qid]
        else:
            score += -1 if predictions[qid] else 0
        if score > best:
            best, threshold = score, na_probs[qid]
    return 100.0 * best / len(scores), threshold


def evaluate_v2(dataset: list[dict], predictions: dict[str, str], na_probs: dict[str, float] | None = None,
                na_prob_thresh: float = 1.0, warn=lambda message: None) -> dict:
    """evaluate-v2.0.py's main(): exact, f1, total, HasAns_*, NoAns_*, and with na_probs
    best_exact, best_exact_thresh, best_f1, best_f1_thresh."""
    given = na_probs is not None
    na_probs = na_probs if given else {k: 0.0 for k in predictions}
    has_answer = has_answer_by_id(dataset)
    exact_raw, f1_raw = raw_scores_v2(dataset, predictions, warn)
    missing = [q for q in has_answer if q not in exact_raw]
    if missing:  # the official script prints them, then fails on the first in its HasAns/NoAns sums
        raise ValueError(f"{len(missing)} question(s) have no prediction (first: {', '.join(missing[:5])}); "
                         "evaluate-v2.0.py cannot score such a file either")
    lacking = [q for q in exact_raw if q not in na_probs]
    if lacking:
        raise ValueError(f"the no-answer probabilities lack {len(lacking)} predicted question(s) "
                         f"(first: {', '.join(lacking[:5])})")
    exact = _apply_threshold(exact_raw, na_probs, has_answer, na_prob_thresh)
    f1 = _apply_threshold(f1_raw, na_probs, has_answer, na_prob_thresh)
    result = _summary(exact, f1)
    for prefix, wanted in (("HasAns", True), ("NoAns", False)):
        qids = [q for q, h in has_answer.items() if h == wanted]
        if qids:
            result.update({f"{prefix}_{k}": v for k, v in _summary(exact, f1, qids).items()})
    if given:
        result["best_exact"], result["best_exact_thresh"] = best_threshold(predictions, exact_raw, na_probs, has_answer)
        result["best_f1"], result["best_f1_thresh"] = best_threshold(predictions, f1_raw, na_probs, has_answer)
    return result
