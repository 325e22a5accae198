"""SQuAD: windows, labels and the max-context rule on known inputs; post-processing on crafted
logits; bad input counted; a tiny BERT fine-tuned on a learnable span task (the answer is the word
after a marker) reaches near-perfect official scores for 1.1 and 2.0."""
import json
import random
from functools import partial

import numpy as np
import pytest
import torch

from finetune.tasks.base import TaskDataError
from finetune.tasks.squad import build_features, postprocess, read_squad
from finetune.windows import windows as _windows
from pretrain.data.preprocess.tokenizer import bert_wordpiece_tokenizer
from side_by_side import side_by_side
from test_finetune_tasks import SPECIALS, WORDS, finetune, tiny  # noqa: F401  (tiny: a fixture)

VOCAB = SPECIALS + WORDS + [f"x{i}" for i in range(15)]


def tokenizer():
    return bert_wordpiece_tokenizer({t: i for i, t in enumerate(VOCAB)}, lowercase=True)


def squad_file(path, questions, version="2.0"):
    data = [{"title": "t", "paragraphs": [{"context": c, "qas": qas}]} for c, qas in questions]
    path.write_text(json.dumps({"version": version, "data": data}))
    return str(path)


def test_windows_step_by_doc_stride():
    assert _windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]  # starts 3 apart; the last reaches the end
    assert _windows(5, 8, 3) == [(0, 5)]
    assert _windows(9, 4, 5) == [(0, 4), (4, 4), (8, 1)]  # a stride above the window length steps by the length


def test_features_labels_and_max_context(tmp_path):
    context = " ".join(f"w{i % 12}" for i in range(14))  # 14 tokens
    answer_start = context.index("w10")  # token 10
    path = squad_file(tmp_path / "train.json", [(context, [
        {"id": "a", "question": "x1 x2 x3", "answers": [{"text": "w10 w11", "answer_start": answer_start}]},
        {"id": "b", "question": "x1", "answers": [], "is_impossible": True},
        {"id": "c", "question": "x1", "answers": [{"text": "w3", "answer_start": 1}]},  # start points elsewhere
    ])])
    examples, _, report = read_squad(path, "2.0", training=True)
    assert [e.qid for e in examples] == ["a", "b"] and report.skipped == {"answer_start does not point at the answer text": 1}
    # max_seq 16, query 2 of 3 tokens (truncated): 11 context tokens per window, stride 4
    features = build_features(tokenizer(), examples, max_seq_length=16, doc_stride=4, max_query_length=2, training=True)
    assert features.truncated_questions == 1 and features.windows_per_example == [2, 2]
    tokens = [[VOCAB[i] for i in row] for row in features.input_ids.tolist()]
    assert tokens[0][:5] == ["[CLS]", "x1", "x2", "[SEP]", "w0"] and tokens[0][-1] == "[SEP]"
    assert tokens[1][4] == "w4" and features.token_type_ids[1].tolist() == [0] * 4 + [1] * 11 + [0]
    assert features.labels.tolist()[0] == [0, 0]  # window 0 holds tokens 0-10: the answer (10-11) is cut -> [CLS]
    assert features.labels.tolist()[1] == [10 - 4 + 4, 11 - 4 + 4]  # window 1 starts at token 4
    assert features.labels.tolist()[2:] == [[0, 0], [0, 0]]  # impossible
    # token 5: 5 tokens on either side in window 0 (0-10), 1 on its left in window 1 (4-13): window 0 is its max context
    assert features.max_context[0][4 + 5] and not features.max_context[1][4 + 1]
    assert features.max_context[1][4 + 8]  # token 12 exists only in window 1
    assert features.offsets[1][4 + 6] == (answer_start, answer_start + 3)  # character span of "w10"


def test_postprocess_picks_spans_and_null_answers():
    context = "w1 w2 w3 w4 w5 w6"
    path_examples = [type("E", (), {"qid": "q", "context": context})()]
    # one window: [CLS] x1 [SEP] w1..w6 [SEP]
    offsets = [None, None, None] + [(3 * i, 3 * i + 2) for i in range(6)] + [None]
    # 10 real positions, 2 of padding: padding's logits (high here) never take an n-best place
    offsets += [None, None]
    features = type("F", (), {"example_index": [0], "offsets": [offsets], "max_context": [[o is not None for o in offsets]],
                              "lengths": [10]})()
    logits = np.full((1, 12, 2), -5.0, dtype=np.float32)
    logits[0, 10:] = 50.0
    logits[0, 4, 0], logits[0, 5, 1] = 3.0, 2.0  # w2..w3: score 5
    logits[0, 8, 0], logits[0, 3, 1] = 9.0, 9.0  # w6 .. w1: the end before the start, never an answer
    logits[0, 0] = [1.0, 1.0]  # null score 2
    predictions, nbest, odds = postprocess(path_examples, features, logits, "2.0", n_best_size=3, max_answer_length=5)
    assert predictions == {"q": "w2 w3"} and odds["q"] == pytest.approx(2.0 - 5.0)
    assert nbest["q"][0]["text"] == "w2 w3" and abs(sum(p["probability"] for p in nbest["q"]) - 1) < 1e-6
    predictions, _, _ = postprocess(path_examples, features, logits, "2.0", null_score_diff_threshold=-4.0)
    assert predictions == {"q": ""}  # odds -3 > -4: no answer
    logits[0, 5, 1] = -5.0
    logits[0, 9 - 1, 1] = 2.5  # w2..w6 is 5 tokens: longer than max_answer_length 4
    predictions, _, _ = postprocess(path_examples, features, logits, "1.1", max_answer_length=4)
    assert predictions["q"] != "w2 w3 w4 w5 w6"


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("data"), "expected {\"version\": ..., \"data\": [articles]}"),
    (lambda d: d["data"][0]["paragraphs"][0]["qas"][0].pop("question"), "qas[0]: needs 'id' and 'question'"),
    (lambda d: d["data"][0]["paragraphs"][0]["qas"][0].update(answers=[]), "no answers in a SQuAD 1.1 file"),
])
def test_bad_squad_files_are_named(tmp_path, edit, message):
    document = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "w1 w2", "qas": [
        {"id": "q", "question": "x1", "answers": [{"text": "w2", "answer_start": 3}]}]}]}]}
    edit(document)
    (tmp_path / "dev.json").write_text(json.dumps(document))
    with pytest.raises(TaskDataError) as error:
        read_squad(str(tmp_path / "dev.json"), "1.1", training=False)
    assert message in str(error.value)


def marker_task(path, n, version, seed):
    """Contexts of 20 words; the answer is the word after the marker x0; in 2.0 a third of the
    questions have no marker, hence no answer."""
    rng = random.Random(seed)
    questions = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(20)]
        answerable = version == "1.1" or rng.random() < 0.67
        qa = {"id": f"q{i}", "question": "x1 x2", "answers": []}
        if answerable:
            k = rng.randrange(19)
            words[k] = "x0"
            context = " ".join(words)
            start = len(" ".join(words[: k + 1])) + 1
            qa["answers"] = [{"text": words[k + 1], "answer_start": start}]
        else:
            context = " ".join(words)
            qa["is_impossible"] = True
        questions.append((context, [qa]))
    return squad_file(path, questions, version)


SPAN_TASKS = {"squad": "1.1", "squad2": "2.0"}


def fine_tune_on_markers(tiny, root, task, version):
    """The tiny model fine-tuned on the marker task: its output folder."""
    train = marker_task(root / "train.json", 1000, version, seed=1)
    dev = marker_task(root / "dev.json", 150, version, seed=2)
    out = root / "out"
    # 20 context tokens in windows of 24 - 2 - 3 = 19: every context needs two windows
    finetune(task, [f"model.init_from={tiny / 'hf'}", f"task.train_file={train}", f"task.dev_files=[{dev}]",
                    f"train.output_dir={out}", "train.epochs=8", "train.lr=1e-3", "task.max_seq_length=24", "task.max_query_length=8",
                    "task.doc_stride=8", "train.global_batch_size=32", "train.micro_batch_size=8"])
    return out


@pytest.fixture(scope="module")
def span_runs(request, tiny, tmp_path_factory):  # noqa: F811
    """The selected versions fine-tuned side by side (tests/side_by_side.py: each is one process):
    task -> its output folder."""
    chosen = {item.callspec.params["task"] for item in request.session.items
              if item.module is request.module and item.originalname == "test_span_extraction_learns"}
    return side_by_side({task: partial(fine_tune_on_markers, tiny, tmp_path_factory.mktemp(task), task, version)
                         for task, version in SPAN_TASKS.items() if task in chosen})


@pytest.mark.slow
@pytest.mark.parametrize("task, version", list(SPAN_TASKS.items()))
def test_span_extraction_learns(span_runs, task, version):
    from transformers import BertForQuestionAnswering

    out = span_runs[task]
    best = json.loads((out / "metrics.json").read_text())["best"]["metrics"]
    if version == "1.1":
        assert best["exact_match"] >= 90 and best["f1"] >= 90
    else:
        assert best["exact"] >= 90 and best["HasAns_exact"] >= 85 and best["NoAns_exact"] >= 85
        assert "best_f1_thresh" in best
        assert set(json.loads((out / "predictions" / "dev" / "null_odds.json").read_text())) == {f"q{i}" for i in range(150)}
    predictions = json.loads((out / "predictions" / "dev" / "predictions.json").read_text())
    assert len(predictions) == 150
    model, info = BertForQuestionAnswering.from_pretrained(out / "best", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert tuple(model.qa_outputs.weight.shape) == (2, 64) and torch.isfinite(model.qa_outputs.weight).all()
