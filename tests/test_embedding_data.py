"""finetune/embedding/data.py: pairs and tuples from JSON lines, TSV and Parquet with a column mapping, every
bad row counted under its reason and named, and batches that are full, duplicate-free and of one
source each, with the leftovers carried into the next epoch."""
import json
import sys
from collections import Counter

import pytest

from finetune.embedding.data import Columns, ContrastiveDataError, ContrastiveExample, contrastive_batches, read_examples


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_jsonl_pairs_and_tuples_with_a_column_mapping_and_every_bad_row_counted(tmp_path):
    rows = [{"q": "what is a cat", "d": "a cat is an animal", "n": ["a car", "a cap"], "src": "wiki"},
            "{not json",
            [1, 2],
            {"q": "where", "n": ["x", "y"], "src": "wiki"},              # no positive
            {"q": "", "d": "text", "n": ["x", "y"], "src": "wiki"},      # empty anchor
            {"q": "why", "d": 3, "n": ["x", "y"], "src": "wiki"},        # a number, not text
            {"q": "who", "d": "him", "n": ["him", "her"], "src": "wiki"},  # a negative equals the positive
            {"q": "how", "d": "so", "n": ["this", ""], "src": "wiki"},   # an empty negative
            {"q": "when", "d": "now", "n": ["then", "later"], "src": "news"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    examples, report = read_examples(path, Columns(anchor="q", positive="d", negatives=("n",), source="src"))
    assert examples == [ContrastiveExample("what is a cat", "a cat is an animal", ("a car", "a cap"), "wiki"),
                        ContrastiveExample("when", "now", ("then", "later"), "news")]
    assert (report.rows, report.kept) == (9, 2)
    assert report.skipped == Counter({"invalid JSON": 1, "not a JSON object": 1, "no 'd'": 1, "empty 'q'": 1,
                                      "'d' is not text": 1, "a negative equals the positive": 1,
                                      "'n' holds an empty or non-text entry": 1})
    summary = report.summary()
    assert "9 rows, 2 examples; skipped 7" in summary and f"{path}:2: invalid JSON" in summary, summary


def test_parquet_gives_what_the_same_rows_give_as_json_lines_in_batches_of_rows(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    import finetune.embedding.data as data

    rows = [{"q": f"query {i}", "d": f"passage {i}" if i % 5 else "", "n": [f"neg {i}", f"other {i}"], "src": "a"}
            for i in range(23)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet", row_group_size=7)
    jsonl = write_jsonl(tmp_path / "pairs.jsonl", rows)
    columns = Columns(anchor="q", positive="d", negatives=("n",), source="src")
    monkeypatch.setattr(data, "PARQUET_BATCH_ROWS", 4)  # several record batches
    from_parquet, report = read_examples(str(tmp_path / "pairs.parquet"), columns)
    assert from_parquet == read_examples(jsonl, columns)[0] and len(from_parquet) == 18
    assert report.skipped == Counter({"empty 'd'": 5}) and f"{tmp_path / 'pairs.parquet'}:6: empty 'd'" in report.summary()
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ContrastiveDataError, match=r"broken\.parquet: not a readable Parquet file"):
        read_examples(str(tmp_path / "broken.parquet"), columns)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # pyarrow is the parquet extra's: without it, one line
    with pytest.raises(ContrastiveDataError, match=r"pairs\.parquet: reading Parquet needs pyarrow.*\[parquet\]"):
        read_examples(str(tmp_path / "pairs.parquet"), columns)


def test_tsv_with_negatives_in_columns(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("anchor\tpositive\tneg\n"
                    "a query\tits passage\tanother passage\n"
                    "short row\tonly two\n"
                    "second\tpassage two\tnegative two\n", encoding="utf-8")
    examples, report = read_examples(str(path), Columns(negatives=("neg",)))
    assert [e.negatives for e in examples] == [("another passage",), ("negative two",)]
    assert report.skipped == Counter({"2 fields of the header's 3": 1})
    assert f"{path}:3:" in report.summary()


def test_unusable_files_are_named(tmp_path):
    with pytest.raises(ContrastiveDataError, match="no such file"):
        read_examples(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ContrastiveDataError, match=r"bad\.jsonl: 1 rows, 0 examples; skipped 1 .*no example left"):
        read_examples(write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "a"}]))
    with pytest.raises(ContrastiveDataError, match="unknown format"):
        read_examples(str((tmp_path / "data.csv").write_text("x") and tmp_path / "data.csv"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"anchor": "caf\xe9", "positive": "x"}\n')
    with pytest.raises(ContrastiveDataError, match="latin1.jsonl: not UTF-8"):
        read_examples(str(tmp_path / "latin1.jsonl"))
    ragged = write_jsonl(tmp_path / "ragged.jsonl", [{"anchor": "a", "positive": "b", "negatives": ["c"]},
                                                     {"anchor": "d", "positive": "e", "negatives": ["f", "g"]}])
    with pytest.raises(ContrastiveDataError, match=r"rows hold \[1, 2\] negatives"):
        read_examples(ragged, Columns(negatives=("negatives",)))


def test_batches_are_full_free_of_duplicates_and_of_one_source():
    examples = [ContrastiveExample(f"q{i}", f"d{i % 7}", (), "a" if i % 3 else "b") for i in range(40)]
    batches, leftover = contrastive_batches(examples, batch_size=4, seed=1, epoch=0)
    assert all(len(batch) == 4 for batch in batches)
    for batch in batches:
        texts = [t for i in batch for t in examples[i].texts()]
        assert len(texts) == len(set(texts)), "a text twice in a batch"
        assert len({examples[i].source for i in batch}) == 1, "two sources in a batch"
    used = [i for batch in batches for i in batch]
    assert sorted(used + leftover) == list(range(40)) and len(set(used)) == len(used)
    # another epoch shuffles differently; its leftovers come first in the next
    again, _ = contrastive_batches(examples, 4, seed=1, epoch=1, carried=leftover)
    assert again != batches
    assert set(leftover) <= {i for batch in again for i in batch} | set(_)
    # reproducible
    assert contrastive_batches(examples, 4, seed=1, epoch=0) == (batches, leftover)
