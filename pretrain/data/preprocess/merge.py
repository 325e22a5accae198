"""Concatenating indexed datasets (megatron-core's IndexedDatasetBuilder.add_index, through our
streaming builder so the index never sits in memory). The inputs' records (dataset_record.py)
carry over when every input has one: the token counts add up; vocabularies must agree."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...common.atomic import atomic_outputs
from .dataset_record import TokenCounts, read_record, record_members
from .fingerprint import fingerprint_path, write_fingerprint
from .indexed import DataError, StreamingIndexedDatasetBuilder, get_bin_path, get_idx_path, validate_indexed_dataset

__all__ = ["MergeResult", "expand_prefixes", "merge_datasets"]

logger = logging.getLogger(__name__)


@dataclass
class MergeResult:
    inputs: list[str]
    dtype: str
    documents: int
    sentences: int
    tokens: int


def expand_prefixes(inputs: Sequence[str]) -> list[str]:
    """Dataset prefixes: each input is a prefix, or a directory standing for all datasets in it."""
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, name[: -len(".idx")]) for name in os.listdir(item)
                           if name.endswith(".idx") and ".tmp-" not in name)
            if not found:
                raise DataError(f"{item}: directory holds no dataset (.idx file)")
            prefixes.extend(found)
        else:
            for suffix in (".bin", ".idx"):
                if item.endswith(suffix) and not os.path.exists(get_idx_path(item)):
                    item = item[: -len(suffix)]  # a file name given instead of the prefix
            prefixes.append(item)
    return prefixes


def merge_datasets(inputs: Sequence[str], output_prefix: str) -> MergeResult:
    prefixes = expand_prefixes(inputs)
    if not prefixes:
        raise DataError("no input dataset given")
    headers = [validate_indexed_dataset(p) for p in prefixes]  # every input checked before writing
    dtypes = {np.dtype(h.dtype).name for h in headers}
    if len(dtypes) > 1:
        listing = ", ".join(f"{p} ({np.dtype(h.dtype).name})" for p, h in zip(prefixes, headers))
        raise DataError(f"inputs have different token dtypes: {listing}; re-run preprocess_data with the same "
                        "--dtype (and vocabulary) for all")
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out_abs for p in prefixes):
        raise DataError(f"{output_prefix}: the output is also an input")
    os.makedirs(os.path.dirname(out_abs), exist_ok=True)
    record = _merged_record(prefixes)
    dtype = headers[0].dtype
    bin_path, idx_path = get_bin_path(output_prefix), get_idx_path(output_prefix)
    fingerprint = fingerprint_path(output_prefix)
    with atomic_outputs([bin_path, fingerprint, idx_path]) as temps:  # the .idx renamed last
        builder = StreamingIndexedDatasetBuilder(temps[bin_path], dtype=dtype)
        try:
            for prefix in prefixes:
                builder.add_index(prefix)
            result = MergeResult(prefixes, np.dtype(dtype).name, builder.num_documents, builder.num_sequences,
                                 builder.num_tokens)
            builder.finalize(temps[idx_path])
        finally:
            builder.close()
        write_fingerprint(temps[bin_path], temps[idx_path], temps[fingerprint], record)
    return result


def _merged_record(prefixes: list[str]) -> dict:
    """The output's record members: the inputs' vocabulary (refused when two differ) and the sum
    of their token counts, each only when every input records it."""
    records = [read_record(prefix) for prefix in prefixes]
    vocabularies = [(prefix, vocabulary) for prefix, (vocabulary, _) in zip(prefixes, records) if vocabulary]
    for prefix, vocabulary in vocabularies[1:]:
        first, theirs = vocabularies[0]
        if (vocabulary.sha256, vocabulary.lowercase) != (theirs.sha256, theirs.lowercase):
            raise DataError(f"{first} and {prefix} were made with different vocabularies ({theirs.describe()} and "
                            f"{vocabulary.describe()}): their ids mean different tokens; preprocess them with one")
    unrecorded = [prefix for prefix, (vocabulary, _) in zip(prefixes, records) if vocabulary is None]
    if unrecorded and vocabularies:
        logger.warning(f"{unrecorded[0]} records no vocabulary (Megatron-LM's tools, or made before datasets "
                       "recorded one): the merged dataset records none either")
    counts = [c for _, c in records]
    return record_members(None if unrecorded else vocabularies[0][1],
                          sum(counts, TokenCounts()) if all(counts) else None)
