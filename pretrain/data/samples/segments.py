"""Cut documents into the segment pairs of BERT pretraining samples.

google-research/bert's create_instances_from_document, over sentence indices instead of tokens:
sentences of a document are gathered into a chunk until it reaches a target length (the full
length, or with probability short_seq_prob a random shorter one, redrawn per sample as Megatron
does, so short sequences also occur inside long documents); the chunk is split at a random
sentence boundary into A and B.

- nsp: with probability 1/2 B is replaced by sentences from a random other document, and the
  chunk's unused sentences are put back so they start the next sample (the reference's "we
  don't want to waste data" rule).
- sop: B always follows A; with probability 1/2 they are swapped (label 1).
Pair chunks always hold two sentences or more (as Megatron's mapping requires): the reference
makes every one-sentence chunk a random next, which pushes NotNext well above 1/2 on corpora of
short paragraphs; here the coin is always fair. A random-next A keeps a sentence that would
otherwise be put back alone at the document's end, where it could not form a pair.
- none: the whole chunk is one segment.

The result is a table of sentence ranges, built once per (data, split, settings) and cached on
disk; tokens are read and masked later, per sample. Documents a mode cannot use (empty ones;
single-sentence ones for nsp/sop) are skipped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...config.choices import SEGMENT_PAIRS

COLUMNS = ("a_begin", "a_end", "b_begin", "b_end", "label")  # sentence index ranges [begin, end); label per BERT


@dataclass(frozen=True)
class SegmentSettings:
    mode: str  # one of SEGMENT_PAIRS
    max_seq_length: int
    short_seq_prob: float
    seed: int

    @property
    def max_num_tokens(self) -> int:
        return self.max_seq_length - (2 if self.mode == "none" else 3)  # [CLS] A [SEP] (B [SEP])


def build_segments(sentence_lengths: np.ndarray, document_bounds: np.ndarray, first_doc: int, last_doc: int,
                   settings: SegmentSettings) -> tuple[np.ndarray, dict]:
    """Segment table (int64 [samples, 5], COLUMNS) for documents [first_doc, last_doc), and counts.

    sentence_lengths: tokens per sentence; document_bounds: [documents + 1] sentence offsets
    (megatron-core's document_indices).
    """
    if settings.mode not in SEGMENT_PAIRS:
        raise ValueError(f"segment pairs {settings.mode!r}: expected one of {', '.join(SEGMENT_PAIRS)}")
    rng = np.random.default_rng([settings.seed, first_doc, last_doc])
    lengths = sentence_lengths.astype(np.int64)
    pairs_needed = settings.mode != "none"
    min_sentences = 2 if pairs_needed else 1
    usable, skipped_empty, skipped_short = [], 0, 0
    for doc in range(first_doc, last_doc):
        begin, end = int(document_bounds[doc]), int(document_bounds[doc + 1])
        nonempty = int(np.count_nonzero(lengths[begin:end]))
        if nonempty == 0:
            skipped_empty += 1
        elif nonempty < min_sentences:
            skipped_short += 1
        else:
            usable.append(doc)
    if settings.mode == "nsp" and len(usable) < 2:
        raise ValueError(f"nsp needs at least 2 usable documents (with 2+ sentences) in documents "
                         f"[{first_doc}, {last_doc}), found {len(usable)}")

    max_tokens = settings.max_num_tokens
    rows: list[tuple[int, int, int, int, int]] = []
    random_next = dropped_tails = 0

    def draw_target() -> int:
        if rng.random() < settings.short_seq_prob:
            return int(rng.integers(2, max_tokens + 1))
        return max_tokens

    for doc in usable:
        begin, end = int(document_bounds[doc]), int(document_bounds[doc + 1])
        target = draw_target()
        chunk_begin, chunk_tokens = begin, 0
        i = begin
        while i < end:
            chunk_tokens += lengths[i]
            chunk_size = i + 1 - chunk_begin
            remaining = end - 1 - i
            # A pair needs two sentences in its chunk, and a document's last sentence is never left
            # alone (it joins the chunk before it), so the NSP/SOP coin below is always fair.
            leaves_lone_sentence = pairs_needed and remaining == 1
            ready = chunk_tokens >= target and chunk_size >= min_sentences and not leaves_lone_sentence
            if not (ready or remaining == 0):
                i += 1
                continue
            if chunk_size < min_sentences:
                dropped_tails += 1  # cannot happen with the rules above; counted should they change
            elif settings.mode == "none":
                rows.append((chunk_begin, i + 1, i + 1, i + 1, 0))
            else:
                a_end = chunk_begin + int(rng.integers(1, chunk_size))
                coin = rng.random() < 0.5
                if settings.mode == "sop":
                    rows.append((a_end, i + 1, chunk_begin, a_end, 1) if coin else (chunk_begin, a_end, a_end, i + 1, 0))
                elif coin:
                    if (i + 1 - a_end) + remaining == 1:
                        a_end = i + 1  # a put-back sentence would be alone at the end: A keeps it
                    a_tokens = int(lengths[chunk_begin:a_end].sum())
                    b_begin, b_end = _random_continuation(rng, usable, doc, document_bounds, lengths,
                                                          max(1, target - a_tokens))
                    rows.append((chunk_begin, a_end, b_begin, b_end, 1))
                    random_next += 1
                    i = a_end - 1  # put the unused sentences back: they start the next sample
                else:
                    rows.append((chunk_begin, a_end, a_end, i + 1, 0))
            chunk_begin, chunk_tokens = i + 1, 0
            target = draw_target()
            i += 1

    table = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    counts = {
        "documents": last_doc - first_doc, "documents_used": len(usable),
        "skipped_empty_documents": skipped_empty, "skipped_single_sentence_documents": skipped_short,
        "samples": int(table.shape[0]), "random_next": random_next, "dropped_single_sentence_tails": dropped_tails,
        "sentences_longer_than_sequence": int(np.count_nonzero(
            lengths[int(document_bounds[first_doc]):int(document_bounds[last_doc])] > max_tokens)),
    }
    return table, counts


def _random_continuation(rng, usable: list[int], doc: int, document_bounds, lengths, target_b: int) -> tuple[int, int]:
    """Sentences of a random other document, from a random start, until target_b tokens."""
    other = doc
    while other == doc:  # >= 2 usable documents, so this ends (expected tries < 2)
        other = usable[int(rng.integers(len(usable)))]
    begin, end = int(document_bounds[other]), int(document_bounds[other + 1])
    start = begin + int(rng.integers(end - begin))
    while start < end - 1 and lengths[start] == 0:
        start += 1
    stop, tokens = start, 0
    while stop < end and tokens < target_b:
        tokens += lengths[stop]
        stop += 1
    return start, stop
