"""A dataset's content fingerprint: `<prefix>.fingerprint.json`, written by preprocessing and
merging beside the .bin/.idx, checked whenever the pair is opened (indexed.validate_indexed_dataset).

The structural checks find a truncated or inconsistent pair; they cannot find a .idx of another
dataset that happens to describe as many tokens as the .bin holds, or a .bin rewritten in place.
The fingerprint records both files' sizes and the CRC32 of 64 pages of 4 KiB spread evenly over
each (the first and the last included): 512 KiB read at most, whatever the dataset's size.
Datasets without one (Megatron-LM's own tools, older runs) get the structural checks only.
The same file records the vocabulary and token counts the dataset was made with
(dataset_record.py); the checks here ignore those members.
"""
from __future__ import annotations

import json
import os
import zlib

FINGERPRINT_SUFFIX = ".fingerprint.json"
FORMAT = 1
_PAGE_BYTES = 4096
_PAGES = 64


def fingerprint_path(prefix: str) -> str:
    return prefix + FINGERPRINT_SUFFIX


def sampled_crc32(path: str, page_bytes: int = _PAGE_BYTES, pages: int = _PAGES) -> str:
    """CRC32 of `pages` pages spread evenly over the file, as 8 hex digits."""
    size = os.path.getsize(path)
    count = max(1, -(-size // page_bytes))
    picks = sorted({i * (count - 1) // max(1, pages - 1) for i in range(pages)})
    crc = 0
    with open(path, "rb") as f:
        for page in picks:
            f.seek(page * page_bytes)
            crc = zlib.crc32(f.read(page_bytes), crc)
    return f"{crc:08x}"


def fingerprint(bin_path: str, idx_path: str) -> dict:
    return {"format": FORMAT, "page_bytes": _PAGE_BYTES, "pages": _PAGES,
            "bin_bytes": os.path.getsize(bin_path), "bin_crc32": sampled_crc32(bin_path),
            "idx_bytes": os.path.getsize(idx_path), "idx_crc32": sampled_crc32(idx_path)}


def write_fingerprint(bin_path: str, idx_path: str, path: str, extra: dict | None = None) -> None:
    """Record the pair as written (callers write into temporary files renamed together), with
    `extra` members (dataset_record.record_members: what the dataset was made with)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**fingerprint(bin_path, idx_path), **(extra or {})}, f, indent=1)
        f.write("\n")


def fingerprint_problem(prefix: str, bin_path: str, idx_path: str) -> str | None:
    """None when the pair is the one its fingerprint recorded, or when there is no fingerprint;
    else one line naming the file that changed."""
    path = fingerprint_path(prefix)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        page_bytes, pages = int(saved["page_bytes"]), int(saved["pages"])
        recorded = {key: saved[key] for key in ("bin_bytes", "bin_crc32", "idx_bytes", "idx_crc32")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path}: not a dataset fingerprint of this project ({type(e).__name__}: {e})"
    replaced = f"; if the files were replaced on purpose, delete {path}"
    for kind, file in (("idx", idx_path), ("bin", bin_path)):
        size, crc = os.path.getsize(file), sampled_crc32(file, page_bytes, pages)
        if (size, crc) != (recorded[f"{kind}_bytes"], recorded[f"{kind}_crc32"]):
            other = bin_path if kind == "idx" else idx_path
            return (f"{file} is not the file preprocessing wrote with {other}: {size} bytes, sampled CRC32 {crc}; "
                    f"{path} records {recorded[f'{kind}_bytes']} bytes, {recorded[f'{kind}_crc32']} (a foreign or "
                    f"rewritten .{kind}){replaced}")
    return None
