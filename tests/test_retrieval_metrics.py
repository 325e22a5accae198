"""finetune/embedding/retrieval_metrics.py against hand-computed values (ties broken by trec_eval's
rule) and against a direct implementation of trec_eval's definitions on random data with ties."""
import math
import random

import numpy as np
import pytest

from finetune.embedding.retrieval_metrics import retrieval_metrics, similarity_spearman


def unit(angle):
    return [math.cos(angle), math.sin(angle)]


def test_hand_computed_with_a_tie():
    # cosines with q1 = (1, 0): d1 0.9, d2 and d3 0.5 (a tie: d3 first, ids descending), d4 0.1
    docs = np.array([unit(math.acos(0.9)), [0.5, math.sqrt(0.75)], [0.5, -math.sqrt(0.75)], unit(math.acos(0.1))])
    queries = np.array([[1.0, 0.0], [0.0, 1.0]])
    qrels = {"q1": {"d2": 2, "d4": 1, "d1": 0}, "q2": {"d1": 0}}  # q2 has no relevant document: not counted
    got = retrieval_metrics(queries, docs, ["q1", "q2"], ["d1", "d2", "d3", "d4"], qrels, recall_at=2)
    # ranking d1, d3, d2, d4: relevances 0, 0, 2, 1
    dcg = 2 / math.log2(4) + 1 / math.log2(5)
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert got == pytest.approx({"ndcg@10": dcg / idcg, "mrr@10": 1 / 3, "recall@2": 0.0})
    # the tie the other way (ids renamed so d2's id sorts last): d2 now ranks second
    got = retrieval_metrics(queries, docs, ["q1", "q2"], ["d1", "z2", "d3", "d4"],
                            {"q1": {"z2": 2, "d4": 1}}, recall_at=2)
    assert got["mrr@10"] == pytest.approx(1 / 2) and got["recall@2"] == pytest.approx(0.5)


def trec_eval(scores, query_ids, doc_ids, qrels, k_ndcg, k_mrr, k_recall):
    """trec_eval's measures, written out plainly: sort (score desc, docno desc), then the sums."""
    totals, counted = {"ndcg": 0.0, "mrr": 0.0, "recall": 0.0}, 0
    for qi, qid in enumerate(query_ids):
        judged = qrels.get(qid, {})
        relevant = [d for d, r in judged.items() if r > 0]
        if not relevant:
            continue
        counted += 1
        ranked = sorted(zip(scores[qi].tolist(), doc_ids), key=lambda sd: (sd[0], sd[1]), reverse=True)
        top = [d for _, d in ranked]
        dcg = sum(judged.get(d, 0) / math.log2(i + 2) for i, d in enumerate(top[:k_ndcg]))
        ideal = sorted((r for r in judged.values() if r > 0), reverse=True)[:k_ndcg]
        totals["ndcg"] += dcg / sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
        hits = [i for i, d in enumerate(top[:k_mrr]) if judged.get(d, 0) > 0]
        totals["mrr"] += 1 / (hits[0] + 1) if hits else 0.0
        totals["recall"] += len(set(relevant) & set(top[:k_recall])) / len(relevant)
    return {f"ndcg@{k_ndcg}": totals["ndcg"] / counted, f"mrr@{k_mrr}": totals["mrr"] / counted,
            f"recall@{k_recall}": totals["recall"] / counted}


def test_equal_to_trec_eval_definitions_on_random_data_with_ties():
    rng = random.Random(5)
    generator = np.random.default_rng(5)
    # few distinct directions: many documents share a score with a query (ties everywhere)
    directions = generator.normal(size=(6, 8)).astype(np.float32)
    docs = directions[generator.integers(0, 6, size=60)]
    queries = generator.normal(size=(25, 8)).astype(np.float32)
    doc_ids = [f"doc{rng.randrange(10**6):06d}-{i}" for i in range(60)]
    query_ids = [f"q{i}" for i in range(25)]
    qrels = {q: {d: rng.choice([0, 1, 2, 3]) for d in rng.sample(doc_ids, 5)} for q in query_ids}
    got = retrieval_metrics(queries, docs, query_ids, doc_ids, qrels, ndcg_at=10, mrr_at=10, recall_at=20)
    unit_q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    unit_d = docs / np.linalg.norm(docs, axis=1, keepdims=True)
    expected = trec_eval(unit_q @ unit_d.T, query_ids, doc_ids, qrels, 10, 10, 20)
    assert got == pytest.approx(expected, abs=1e-9)
    assert 0 < got["ndcg@10"] < 1


def test_spearman_of_cosine():
    from scipy.stats import spearmanr

    generator = np.random.default_rng(0)
    a, b = generator.normal(size=(30, 4)), generator.normal(size=(30, 4))
    gold = generator.integers(0, 5, size=30)  # ties in the gold scores
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert similarity_spearman(a, b, gold) == pytest.approx(spearmanr(cosine, gold)[0], abs=1e-6)
    with pytest.raises(ValueError, match="no query has a relevant document"):
        retrieval_metrics(a, b, ["q"], [f"d{i}" for i in range(30)], {"q": {"d1": 0}})
