"""The demo corpus: prose of Python's own documentation, and the held-out sentence-pair task."""
import json
import sys

import pytest

from distributed import REPO

sys.path.insert(0, str(REPO / "tools" / "demo"))
import python_docs_corpus  # noqa: E402

from finetune.tasks import TASKS  # noqa: E402
from finetune.tasks.glue import read_examples  # noqa: E402


def test_prose_keeps_sentences_and_drops_code():
    text = """The "if" statement
******************

The "if" statement is used for
conditional execution:

   if_stmt ::= "if" assignment_expression ":" suite

>>> if x: pass
It selects exactly one of the suites by evaluating the expressions.
Short heading
"""
    assert python_docs_corpus.prose(text) == (
        'The "if" statement is used for conditional execution:\n'
        "It selects exactly one of the suites by evaluating the expressions. Short heading")


@pytest.mark.slow
def test_corpus_and_pair_task(tmp_path):
    out = tmp_path / "pydocs"
    assert python_docs_corpus.main(["--output-dir", str(out), "--packages", "", "--train-pairs", "500",
                                    "--dev-pairs", "0"]) == 0
    docs = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(docs) > 500
    assert len({d["text"] for d in docs}) == len(docs)  # inherited docstrings kept once
    assert not any(python_docs_corpus.is_dev(d["text"], 0.1) for d in docs)  # held-out documents stay out
    assert all(">>>" not in d["text"] and "::=" not in d["text"] for d in docs)

    train, report = read_examples(TASKS["mrpc"], str(out / "coherence" / "train.tsv"), "train")
    dev, _ = read_examples(TASKS["mrpc"], str(out / "coherence" / "dev.tsv"), "dev")
    assert len(train) == 500 and len(dev) > 100
    labels = [e.label for e in train]
    assert 0.4 < labels.count("1") / len(labels) < 0.6
    pretraining_text = "\n".join(d["text"] for d in docs)
    # a positive dev pair is two consecutive sentences of a held-out document
    held_out = [e for e in dev if e.label == "1" and e.text_a not in pretraining_text]
    assert len(held_out) > 0.9 * sum(e.label == "1" for e in dev)
