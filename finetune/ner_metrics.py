"""Token classification metrics: entity-level precision, recall and F1 as the CoNLL evaluation
script (conlleval) defines them, through seqeval's default mode (an entity counts when its type
and both ends match; entities are read with conlleval's chunk rules, so IOB1 and IOB2 tags give
the same entities), plus per-type F1 and token accuracy (the share of tokens whose tag matches, as
conlleval's "accuracy"). Importable without torch."""
from __future__ import annotations

from typing import Sequence


def tagging_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict[str, float]:
    """{precision, recall, f1, accuracy, f1_TYPE...} over sentences (lists of tags, one scheme)."""
    from seqeval.metrics import classification_report

    if [len(s) for s in gold] != [len(s) for s in predicted]:
        raise ValueError("gold and predicted sentences differ in length")
    tokens = sum(len(s) for s in gold)
    correct = sum(g == p for gs, ps in zip(gold, predicted) for g, p in zip(gs, ps))
    # every non-O tag starts or continues an entity (conlleval's chunk rules); with none on either
    # side there is nothing to score (seqeval would average an empty array), and P = R = F1 = 0
    has_entities = any(tag != "O" for sentences in (gold, predicted) for s in sentences for tag in s)
    # zero_division=0: a type never predicted has precision 0, as conlleval counts it, without a warning
    report = classification_report([list(s) for s in gold], [list(s) for s in predicted], output_dict=True,
                                   zero_division=0) if has_entities else {}
    micro = report.get("micro avg", {"precision": 0.0, "recall": 0.0, "f1-score": 0.0})
    scores = {"precision": float(micro["precision"]), "recall": float(micro["recall"]),
              "f1": float(micro["f1-score"]), "accuracy": correct / tokens if tokens else 0.0}
    for kind, values in sorted(report.items()):
        if not kind.endswith(" avg"):
            scores[f"f1_{kind}"] = float(values["f1-score"])
    return scores
