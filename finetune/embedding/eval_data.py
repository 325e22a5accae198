"""The evaluation sets of contrastive training, read and checked up front.

- Retrieval, in BEIR's layout (what MTEB and sentence-transformers' InformationRetrievalEvaluator
  users have): queries.jsonl and corpus.jsonl of {"_id", "text"} objects (a corpus entry's
  optional "title" is put before its text, separated by a space, as BEIR's models see it), and a
  qrels TSV of query-id, corpus-id, score with a header row. A qrels line naming an unknown query
  or document, a duplicate id, or a bad line is an error naming the file and line: a judged
  document missing from the corpus would silently lower every score.
- Similarity: scored pairs (JSON lines or TSV with a header), sentence1, sentence2, score columns.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass

from .data import ContrastiveDataError


@dataclass(frozen=True)
class RetrievalSet:
    query_ids: list[str]
    queries: list[str]
    doc_ids: list[str]
    documents: list[str]
    qrels: dict[str, dict[str, int]]


@dataclass(frozen=True)
class SimilaritySet:
    first: list[str]
    second: list[str]
    scores: list[float]


def _json_lines(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise ContrastiveDataError(f"{path}:{number}: invalid JSON") from None
                if not isinstance(row, dict):
                    raise ContrastiveDataError(f"{path}:{number}: not a JSON object")
                yield number, row
    except FileNotFoundError:
        raise ContrastiveDataError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise ContrastiveDataError(f"{path}: not UTF-8 ({error.reason} at byte {error.start})") from None


def _texts_by_id(path: str, with_title: bool) -> tuple[list[str], list[str]]:
    ids, texts, seen = [], [], set()
    for number, row in _json_lines(path):
        key, text = row.get("_id"), row.get("text")
        if not isinstance(key, (str, int)) or not isinstance(text, str):
            raise ContrastiveDataError(f"{path}:{number}: needs an \"_id\" and a \"text\"")
        key = str(key)
        if key in seen:
            raise ContrastiveDataError(f"{path}:{number}: _id {key!r} appears twice")
        title = row.get("title") if with_title else None
        if isinstance(title, str) and title.strip():
            text = f"{title} {text}"
        if not text.strip():
            raise ContrastiveDataError(f"{path}:{number}: empty text")
        seen.add(key)
        ids.append(key)
        texts.append(text)
    if not ids:
        raise ContrastiveDataError(f"{path}: no entry")
    return ids, texts


def read_retrieval_set(queries_path: str, corpus_path: str, qrels_path: str) -> RetrievalSet:
    query_ids, queries = _texts_by_id(queries_path, with_title=False)
    doc_ids, documents = _texts_by_id(corpus_path, with_title=True)
    known_queries, known_docs = set(query_ids), set(doc_ids)
    qrels: dict[str, dict[str, int]] = {}
    try:
        with open(qrels_path, encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            next(reader, None)  # the header (query-id corpus-id score)
            for row in reader:
                where = f"{qrels_path}:{reader.line_num}"
                if not row or not "".join(row).strip():
                    continue
                if len(row) < 3:
                    raise ContrastiveDataError(f"{where}: needs query-id, corpus-id and score, tab-separated")
                qid, did, score = row[0], row[1], row[2]
                try:
                    relevance = int(float(score))
                except ValueError:
                    raise ContrastiveDataError(f"{where}: score {score!r} is not a number") from None
                if qid not in known_queries:
                    raise ContrastiveDataError(f"{where}: query {qid!r} is not in {queries_path}")
                if did not in known_docs:
                    raise ContrastiveDataError(f"{where}: document {did!r} is not in {corpus_path}")
                qrels.setdefault(qid, {})[did] = relevance
    except FileNotFoundError:
        raise ContrastiveDataError(f"{qrels_path}: no such file") from None
    if not any(rel > 0 for judged in qrels.values() for rel in judged.values()):
        raise ContrastiveDataError(f"{qrels_path}: no relevant (score > 0) judgement")
    return RetrievalSet(query_ids, queries, doc_ids, documents, qrels)


def read_similarity_set(path: str, first: str, second: str, score: str) -> SimilaritySet:
    if path.lower().endswith(".tsv"):
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            rows = [(reader.line_num, row) for row in reader]
    else:
        rows = list(_json_lines(path))
    a, b, gold = [], [], []
    for number, row in rows:
        values = [row.get(first), row.get(second)]
        if not all(isinstance(v, str) and v.strip() for v in values):
            raise ContrastiveDataError(f"{path}:{number}: needs the texts '{first}' and '{second}'")
        try:
            gold.append(float(row.get(score)))
        except (TypeError, ValueError):
            raise ContrastiveDataError(f"{path}:{number}: '{score}' is not a number") from None
        a.append(values[0])
        b.append(values[1])
    if len(a) < 2:
        raise ContrastiveDataError(f"{path}: a correlation needs at least two scored pairs ({len(a)} found)")
    return SimilaritySet(a, b, gold)
