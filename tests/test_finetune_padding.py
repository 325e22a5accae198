"""Fine-tuning batches padded to their longest example (train.padding: longest, the default) give
what fixed-length batches give (max_length): the same logits to float rounding, the same metrics
and byte-identical prediction and submission files, on every kind of task (GLUE pair and single
sentence, SWAG, SQuAD windows, CoNLL NER), on two data-parallel ranks (evaluation sorted by
length, sharded, gathered and written back in file order); and length-grouped training order.
SQuAD's n-best lists and null odds print the logits themselves: equal within 1e-5 there (a
matrix product over fewer padding rows rounds differently in the last bits)."""
import csv
import json
import random

import numpy as np
import pytest

from distributed import run_ranks
from test_finetune_ner import synthetic_files, tiny_ner  # noqa: F401  (tiny_ner: a fixture)
from test_finetune_squad import squad_file
from test_finetune_tasks import WORDS, tiny, write_tsv  # noqa: F401  (tiny: a fixture)

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier


def sentences(rng, low=1, high=9):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def glue_files(root):
    rng = random.Random(3)
    pair = [(i, sentences(rng), sentences(rng), rng.choice(["entailment", "not_entailment"])) for i in range(37)]
    single = [(sentences(rng, 1, 10), rng.randrange(2)) for _ in range(29)]
    return {"rte_dev": write_tsv(root / "rte_dev.tsv", ["index", "sentence1", "sentence2", "label"], pair),
            "rte_test": write_tsv(root / "rte_test.tsv", ["index", "sentence1", "sentence2"],
                                  [row[:3] for row in pair[:11]]),
            "sst2_dev": write_tsv(root / "sst2_dev.tsv", ["sentence", "label"], single)}


def swag_dir(root):
    rng = random.Random(5)
    header = ["video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1", "ending2",
              "ending3", "label"]
    with open(root / "val.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for i in range(23):
            writer.writerow([f"v{i}", 1000 + i, "", sentences(rng, 1, 6), "", "gold",
                             *[sentences(rng, 1, 4) for _ in range(4)], rng.randrange(4)])
    return root


def squad_windows(path):
    """SQuAD 2.0 questions on contexts of 3 to 35 words (1 or 2 windows of 32 tokens): the answer
    follows the marker x0, or there is none."""
    rng = random.Random(6)
    questions = []
    for i in range(21):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 35))]
        qa = {"id": f"q{i}", "question": "x1 x2", "answers": []}
        if rng.random() < 0.6:
            k = rng.randrange(len(words) - 1)
            words[k] = "x0"
            qa["answers"] = [{"text": words[k + 1], "answer_start": len(" ".join(words[: k + 1])) + 1}]
        else:
            qa["is_impossible"] = True
        questions.append((" ".join(words), [qa]))
    return squad_file(path, questions, "2.0")


@pytest.fixture(scope="module")
def padded_both_ways(tiny, tiny_ner, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("padding")
    glue = glue_files(root)
    squad_dev = squad_windows(root / "squad_dev.json")
    ner = synthetic_files(root, seed=3, train_docs=1, dev_docs=9)
    model = f"model.init_from={tiny / 'hf'}"
    small_batches = ["train.eval_batch_size=4"]  # several batches of unlike lengths
    runs = [
        ("rte", "rte", [model, f"task.dev_files=[{glue['rte_dev']}]", f"task.test_files=[{glue['rte_test']}]",
                        "task.max_seq_length=24"]),
        ("sst2", "sst2", [model, f"task.dev_files=[{glue['sst2_dev']}]", "task.max_seq_length=32"]),
        ("swag", "swag", [model, f"task.data_dir={swag_dir(root)}", "task.max_seq_length=32"]),
        ("squad2", "squad2", [model, f"task.dev_files=[{squad_dev}]", "task.max_seq_length=32",
                              "task.max_query_length=8", "task.doc_stride=8"]),
        ("conll2003", "conll2003", [f"model.init_from={tiny_ner}", f"task.dev_files=[{ner['dev']}]",
                                    "task.max_seq_length=64", "task.doc_stride=16"]),
    ]
    out = root / "out.json"
    run_ranks(["tests/_finetune_padding_worker.py", str(out),
               *[json.dumps({"name": name, "task": task, "overrides": overrides + small_batches})
                 for name, task, overrides in runs]], 2, timeout=600)
    return json.loads(out.read_text())


def assert_same_json(ours, reference, where):
    """Equal, floats within 1e-5 (SQuAD's n-best lists and null odds print the logits themselves)."""
    if isinstance(reference, dict):
        assert ours.keys() == reference.keys(), where
        for key in reference:
            assert_same_json(ours[key], reference[key], f"{where}/{key}")
    elif isinstance(reference, list):
        assert len(ours) == len(reference), where
        for i, (a, b) in enumerate(zip(ours, reference)):
            assert_same_json(a, b, f"{where}[{i}]")
    elif isinstance(reference, float):
        assert ours == pytest.approx(reference, abs=1e-5), where
    else:
        assert ours == reference, where


@pytest.mark.parametrize("task", ["rte", "sst2", "swag", "squad2", "conll2003"])
def test_longest_padding_changes_nothing_but_the_tokens(padded_both_ways, task):
    fixed, longest = padded_both_ways[task]["max_length"], padded_both_ways[task]["longest"]
    assert padded_both_ways[task]["dp"] == 2
    assert longest["metrics"] == fixed["metrics"]
    assert longest["files"].keys() == fixed["files"].keys() and fixed["files"]
    for name, content in fixed["files"].items():
        if name.endswith(("nbest_predictions.json", "null_odds.json")):  # scores: floats of the logits
            assert_same_json(json.loads(longest["files"][name]), json.loads(content), f"{task}: {name}")
        else:
            assert longest["files"][name] == content, f"{task}: {name} differs"
    for name, logits in fixed["logits"].items():
        ours, reference = np.array(longest["logits"][name]), np.array(logits)
        if ours.ndim == 3:  # token-level logits: the real positions (padding's are zeros under "longest")
            real = np.arange(ours.shape[1])[None, :] < np.array(fixed["lengths"][name])[:, None]
            ours, reference = ours[real], reference[real]
        np.testing.assert_allclose(ours, reference, atol=2e-5, err_msg=f"{task} {name}")
    assert longest["tokens"] < 0.9 * fixed["tokens"], f"{task}: the batches were not cut"


def test_length_grouped_order_keeps_every_example_in_its_window():
    from finetune.inputs import length_grouped

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 60, size=1000)
    order = rng.permutation(1000).tolist()
    grouped = length_grouped(order, lengths, 100)
    assert len(grouped) == 1000
    for start in range(0, 1000, 100):
        window = grouped[start:start + 100]
        assert sorted(window) == sorted(order[start:start + 100])
        assert [lengths[i] for i in window] == sorted((lengths[i] for i in window), reverse=True)
    # batches of 10 pad far less than the shuffled order's
    def padded(o):
        return sum(10 * max(lengths[i] for i in o[k:k + 10]) for k in range(0, 1000, 10))
    assert padded(grouped) < 0.7 * padded(order) and padded(grouped) < 1.15 * lengths.sum()
