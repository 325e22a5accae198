"""Retrieval and similarity metrics of an embedding model, with trec_eval's definitions (those of
pytrec_eval, which BEIR and MTEB report):

- ranking: exact search, every document scored (cosine of the embeddings); documents sorted by
  score, descending, ties broken by document id in descending lexicographic order (trec_eval's
  rule, so that a tie is resolved the same way by any tool);
- nDCG@k: DCG = sum over the top k of rel_i / log2(i + 1) (i from 1, linear gain, trec_eval's
  ndcg_cut), divided by the DCG of the ideal order of the query's judged relevances;
- MRR@k: 1 / the rank of the first relevant document (relevance > 0) within the top k, else 0;
- Recall@k: the relevant documents (relevance > 0) within the top k over all of the query's;
- each averaged over the queries that have at least one relevant document (trec_eval skips
  queries without judgements);
- semantic similarity: Spearman's rank correlation between the cosine of each pair and its gold
  score (scipy's, average ranks for ties), as sentence-transformers' EmbeddingSimilarityEvaluator.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np


def tie_break_order(doc_ids: Sequence[str]) -> np.ndarray:
    """For each document, its position in descending lexicographic order of the ids: the
    secondary sort key of a ranking (lower first)."""
    order = sorted(range(len(doc_ids)), key=lambda i: doc_ids[i], reverse=True)
    positions = np.empty(len(doc_ids), dtype=np.int64)
    positions[order] = np.arange(len(doc_ids))
    return positions


def rank_documents(scores: np.ndarray, tie_break: np.ndarray, k: int) -> np.ndarray:
    """Indices of the top `k` documents of one query's scores, best first."""
    order = np.lexsort((tie_break, -scores.astype(np.float64)))
    return order[:k]


def _ndcg(ranked_relevances: list[int], judged: list[int], k: int) -> float:
    dcg = sum(rel / math.log2(i + 2) for i, rel in enumerate(ranked_relevances[:k]))
    ideal = sorted((r for r in judged if r > 0), reverse=True)[:k]
    idcg = sum(rel / math.log2(i + 2) for i, rel in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


def retrieval_metrics(query_embeddings: np.ndarray, doc_embeddings: np.ndarray, query_ids: Sequence[str],
                      doc_ids: Sequence[str], qrels: Mapping[str, Mapping[str, int]],
                      ndcg_at: int = 10, mrr_at: int = 10, recall_at: int = 100) -> dict[str, float]:
    """nDCG@k, MRR@k and Recall@k by exact cosine search (the module's definitions)."""
    queries = _unit(query_embeddings)
    docs = _unit(doc_embeddings)
    tie_break = tie_break_order(doc_ids)
    depth = max(ndcg_at, mrr_at, recall_at)
    totals = {f"ndcg@{ndcg_at}": 0.0, f"mrr@{mrr_at}": 0.0, f"recall@{recall_at}": 0.0}
    counted = 0
    for start in range(0, len(query_ids), 256):  # a block of queries at a time: memory stays flat
        block = queries[start:start + 256] @ docs.T
        for row, qid in enumerate(query_ids[start:start + 256]):
            judged = qrels.get(qid, {})
            relevant = {d for d, rel in judged.items() if rel > 0}
            if not relevant:
                continue
            counted += 1
            top = [doc_ids[i] for i in rank_documents(block[row], tie_break, depth)]
            relevances = [int(judged.get(d, 0)) for d in top]
            totals[f"ndcg@{ndcg_at}"] += _ndcg(relevances, list(judged.values()), ndcg_at)
            first = next((i for i, d in enumerate(top[:mrr_at]) if d in relevant), None)
            totals[f"mrr@{mrr_at}"] += 0.0 if first is None else 1.0 / (first + 1)
            totals[f"recall@{recall_at}"] += len(relevant.intersection(top[:recall_at])) / len(relevant)
    if counted == 0:
        raise ValueError("no query has a relevant document in the qrels")
    return {name: value / counted for name, value in totals.items()}


def similarity_spearman(first: np.ndarray, second: np.ndarray, gold: Sequence[float]) -> float:
    """Spearman's correlation of the pairs' cosine with their gold scores."""
    from scipy.stats import spearmanr

    cosine = np.sum(_unit(first) * _unit(second), axis=1)
    return float(spearmanr(cosine, np.asarray(gold, dtype=np.float64))[0])


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
