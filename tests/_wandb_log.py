"""Reading a W&B offline run's transaction log (run-<id>.wandb) with wandb's own record
definitions: what `wandb sync` would upload. The file is a LevelDB-style log: a 7-byte header
(":W&B", magic 0xBEE1, version), then 32 KiB blocks of records, each a 7-byte header (CRC-32,
length, kind: 1 whole, 2 first, 3 middle, 4 last piece) and a piece of a serialised Record."""
from __future__ import annotations

import json
import struct

BLOCK = 32768
HEADER = 7


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a record header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        piece, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind == 0:
            continue
        pending = piece if kind in (1, 2) else pending + piece
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def history(path: str) -> dict[str, dict[int, float]]:
    """{key: {step: value}} of the run's logged history."""
    out: dict[str, dict[int, float]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if key.startswith("_"):
                continue  # _step, _runtime, _timestamp
            out.setdefault(key, {})[step] = json.loads(item.value_json)
    return out


def run_ids(path: str) -> set[str]:
    return {record.run.run_id for record in records(path) if record.WhichOneof("record_type") == "run"}
