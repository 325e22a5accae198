"""tools/position_accuracy.py: masked-token accuracy by position bucket. On a tiny ModernBERT
directory its per-bucket counts equal transformers' ModernBertForMaskedLM predicting the same masked
documents (the tool's own masking, drawn per document); the same at CP2 (each document's tokens
split over two processes); bad input is one line naming the file and line.
"""
import json
import os

import pytest
import torch

from distributed import REPO, run_python, run_ranks
from test_modernbert import VOCAB, saved_model
from tools import position_accuracy

EDGES = [8, 32, 64]


def documents(path, count=6):
    words = ["the cat sat on the mat", "a dog ran in the park", "the mat was red"]
    lines = [" ".join(words[(i + j) % 3] for j in range(2 + 3 * i)) for i in range(count)]
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")  # one empty line, skipped
    return path


def transformers_counts(model, path, docs) -> list[tuple[int, int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = {tokenizer.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    counts = [[0, 0] for _ in range(len(EDGES) + 1)]
    texts = [line for line in docs.read_text().splitlines() if line.strip()]
    for index, text in enumerate(texts):
        ids = tokenizer.encode(text).ids[:64]
        positions = position_accuracy.masked_positions(ids, specials, 0.15, 3, index)
        masked = torch.tensor(ids)
        masked[positions] = tokenizer.token_to_id("[MASK]")
        with torch.no_grad():
            predicted = model(input_ids=masked[None]).logits[0, positions, :VOCAB].argmax(-1)
        for position, right in zip(positions, (predicted == torch.tensor(ids)[positions]).tolist()):
            bucket = position_accuracy.bucket_of(position, EDGES)
            counts[bucket][0] += 1
            counts[bucket][1] += int(right)
    return [tuple(c) for c in counts]


@pytest.mark.slow
def test_bucket_counts_equal_transformers_at_cp1_and_cp2(tmp_path):
    model, path = saved_model(tmp_path, "every2-window8")
    docs = documents(tmp_path / "docs.txt")
    args = ["tools/position_accuracy.py", "--checkpoint", str(path), "--input", str(docs), "--buckets",
            ",".join(map(str, EDGES)), "--max-length", "64", "--seed", "3", "--json"]
    one = run_python(args, dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    result = json.loads(one.stdout.strip().splitlines()[-1])
    assert result["documents"] == 6 and result["empty_lines_skipped"] == 1 and result["longest_document"] == 64
    got = [(b["masked"], b["correct"]) for b in result["buckets"]]
    assert got == transformers_counts(model, path, docs)
    assert all(masked > 0 for masked, _ in got[:3]) and got[3] == (0, 0)  # no position past 64
    assert [b["positions"] for b in result["buckets"]] == ["0-8", "8-32", "32-64", "64-"]

    outputs = run_ranks(args + ["--cp", "2"], 2, timeout=300)
    two = json.loads([line for line in outputs[0].stdout.splitlines() if line.startswith("{")][-1])
    assert [(b["masked"], b["correct"]) for b in two["buckets"]] == got


def test_bad_input_is_one_line_naming_the_line(tmp_path):
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(position_accuracy.PositionAccuracyError, match=r"docs.jsonl:2: no \"text\" string field"):
        position_accuracy.read_documents(str(bad), None)
    assert position_accuracy.bucket_names([1024, 4096]) == ["0-1k", "1k-4k", "4k-"]
