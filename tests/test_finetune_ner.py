"""Token classification (CoNLL-2003 NER): reading CoNLL files and JSON lines, IOB1/IOB2,
first-sub-token labels and windows (every word predicted once, from its max-context window), the
entity metrics against hand-worked cases and a port of conlleval's counting, and end to end on a
learnable synthetic tagging task: fine-tuned (TP1 = TP2, the export predicts our tags in
transformers) and feature-based (a BiLSTM over cached frozen features)."""
import json
import random
import re

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distributed import run_python, run_ranks
from finetune.ner_metrics import tagging_scores
from finetune.tasks.tagging import (CONLL2003_LABELS, Document, Sentence, chunk_starts, conll_text, detect_scheme,
                              read_tagged, to_iob1, to_iob2)
from finetune.tasks.base import TaskDataError
from finetune.windows import max_context_owners, max_context_window, windows

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
OTHER = [f"w{i}" for i in range(10)]
NAMES = {"PER": ["p0", "p1", "p2", "p3"], "LOC": ["l0", "l1", "l2", "l3"], "ORG": ["o0", "o1", "o2", "o3"]}
VOCAB = SPECIALS + OTHER + [w for words in NAMES.values() for w in words] + ["-", "##z", "z"]
QUIET = ["train.progress=false", "model.hidden_dropout=0", "model.attention_dropout=0", "model.classifier_dropout=0"]


# ----------------------------------------------------------------------------- the synthetic task
def synthetic_sentence(rng):
    """Words and IOB2 tags. An entity is a first name of its type (p0 p1, l0 l1, o0 o1) followed
    by 0-2 more names (p2 p3, ...); entities of one type may follow each other directly (IOB1 then
    writes B-). "w3-w4" (three sub-tokens: w3 - w4) and "zz" (z ##z) are O words."""
    words, tags = [], []
    while len(words) < 6 + rng.randrange(5):
        if rng.random() < 0.35:
            kind = rng.choice(sorted(NAMES))
            for i in range(rng.randrange(1, 4)):
                words.append(rng.choice(NAMES[kind][:2] if i == 0 else NAMES[kind][2:]))
                tags.append(("B-" if i == 0 else "I-") + kind)
        else:
            words.append(rng.choice(OTHER + ["w3-w4", "zz"]))
            tags.append("O")
    return words, tags


def write_conll(path, documents, scheme="iob2"):
    lines = []
    for sentences in documents:
        lines += ["-DOCSTART- -X- -X- O", ""]
        for words, tags in sentences:
            tags = to_iob1(tags) if scheme == "iob1" else tags
            lines += [f"{w} NN I-NP {t}" for w, t in zip(words, tags)] + [""]
    path.write_text("\n".join(lines) + "\n")
    return path


def synthetic_files(root, seed=0, train_docs=60, dev_docs=12, scheme="iob1"):
    rng = random.Random(seed)
    files = {}
    for split, n in (("train", train_docs), ("dev", dev_docs)):
        documents = [[synthetic_sentence(rng) for _ in range(rng.randrange(2, 5))] for _ in range(n)]
        files[split] = write_conll(root / f"{split}.txt", documents, scheme)
    return files


@pytest.fixture(scope="module")
def tiny_ner(tmp_path_factory):
    """A random-init tiny BertForPreTraining directory whose vocabulary holds the synthetic words."""
    from transformers import BertConfig, BertForPreTraining

    root = tmp_path_factory.mktemp("tiny-ner")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)).save_pretrained(root / "hf")
    (root / "hf" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return root / "hf"


def finetune(overrides, nprocs=1, extra_args=()):
    args = ["-m", "finetune", "conll2003", *extra_args, *QUIET, *overrides]
    if nprocs == 1:
        done = run_python(args, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done
    return run_ranks(args, nprocs, timeout=600)


def tokenizer():
    from pretrain.data.preprocess.tokenizer import bert_wordpiece_tokenizer

    return bert_wordpiece_tokenizer({t: i for i, t in enumerate(VOCAB)}, lowercase=True)


def section(**values):
    from finetune.config import TaskSection

    return TaskSection(name="conll2003", **values)


def ner_task(**values):
    from finetune.tasks import TASKS

    return TASKS["conll2003"].configured(section(**values))


# ----------------------------------------------------------------------------- reading
CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP I-ORG
rejects VBZ B-VP O
German JJ B-NP I-MISC

Peter NNP B-NP I-PER
Blackburn NNP B-NP I-PER

-DOCSTART- -X- -X- O

BRUSSELS NNP B-NP I-LOC
"""


def test_reads_conll_documents_sentences_and_the_chosen_column(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text(CONLL)
    documents, report = read_tagged(str(path), -1, CONLL2003_LABELS)
    assert [[s.words for s in d.sentences] for d in documents] == [
        [["EU", "rejects", "German"], ["Peter", "Blackburn"]], [["BRUSSELS"]]]
    assert [d.docstart for d in documents] == [True, True] and report.examples == 3
    assert documents[0].sentences[1].tags == ["I-PER", "I-PER"] and documents[0].sentences[1].lines == [7, 8]
    chunks, _ = read_tagged(str(path), 2, CONLL2003_LABELS)  # the chunk column
    assert chunks[0].sentences[0].tags == ["B-NP", "B-VP", "B-NP"]
    assert detect_scheme([s for d in documents for s in d.sentences]) == "iob1"  # I-ORG starts an entity
    untagged = tmp_path / "test.txt"
    untagged.write_text("-DOCSTART-\n\nEU\nrejects\n\nPeter\n")
    documents, _ = read_tagged(str(untagged), -1, CONLL2003_LABELS)
    assert [s.tags for d in documents for s in d.sentences] == [None, None]
    # sentence context: each sentence alone, the document marks kept for the predictions file
    read = ner_task(context="sentence").read(str(path), "train", section(context="sentence"))
    assert [len(d.sentences) for d in read.examples] == [1, 1, 1] and [d.docstart for d in read.examples] == [True, False, True]
    assert read.reference == "iob1"


def test_reads_json_lines_with_string_or_integer_tags(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"tokens": ["-DOCSTART-"], "ner_tags": [0]}, {"tokens": ["EU", "rejects"], "ner_tags": [3, 0]},
            {"tokens": ["Peter", "Blackburn"], "tags": ["B-PER", "I-PER"]}, {"tokens": [], "tags": []}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    documents, report = read_tagged(str(path), -1, CONLL2003_LABELS)
    assert len(documents) == 1 and documents[0].docstart
    assert [s.tags for s in documents[0].sentences] == [["B-ORG", "O"], ["B-PER", "I-PER"]]
    assert report.skipped == {"no tokens": 1}  # counted, not silent


@pytest.mark.parametrize("name, text, column, message", [
    ("a.txt", "EU NNP I-ORG\nrejects VBZ\n", -1, "a.txt:2: 2 columns where the file's first token line has 3"),
    ("b.txt", "EU NNP I-ORG\nrejects VBZ O\n", 1, "b.txt:1: tag 'NNP' is not O, B-TYPE or I-TYPE"),
    ("c.txt", "EU NNP I-ORG\n", 5, "c.txt:1: task.tag_column 5 is not a tag column"),
    ("d.jsonl", '{"tokens": ["EU"], "tags": ["O"]}\n{"tokens": ["EU"]\n', -1, "d.jsonl:2: not valid JSON"),
    ("e.jsonl", '{"tokens": ["EU", "x"], "tags": ["O"]}\n', -1, "e.jsonl:1: 2 tokens but 1 tags"),
    ("f.jsonl", '{"tokens": ["EU"], "ner_tags": [9]}\n', -1, "f.jsonl:1: integer tags index task.labels (9 labels): 9"),
    ("g.jsonl", '{"tokens": ["EU"], "tags": ["O"]}\n{"tokens": ["EU"]}\n', -1, "g.jsonl:2: this sentence has no tags"),
    ("h.jsonl", '{"tokens": ["E U"], "tags": ["O"]}\n', -1, "h.jsonl:1: every token must be a non-empty string"),
])
def test_bad_lines_are_named(tmp_path, name, text, column, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TaskDataError) as error:
        read_tagged(str(path), column, CONLL2003_LABELS)
    assert str(error.value).startswith(f"{path.parent}/{message}"), str(error.value)


def test_unknown_tags_and_a_wrong_scheme_are_named(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("EU I-ORG\nrejects O\n\nJohn B-PER\nSmith I-PERSON\n")
    with pytest.raises(TaskDataError, match=r"train.txt:5: tag I-PERSON: the task's labels have the types LOC, MISC, "
                                            r"ORG, PER; this file also has PERSON: give task.labels"):
        ner_task().read(str(path), "train", section())
    path.write_text("EU I-ORG\nrejects O\n")
    with pytest.raises(TaskDataError, match=r"train.txt:1: an entity starts with I-, which is IOB1"):
        ner_task().read(str(path), "train", section(tag_scheme="iob2"))
    with pytest.raises(TaskDataError, match="no tag column"):
        (tmp_path / "dev.txt").write_text("EU\n")
        ner_task().read(str(tmp_path / "dev.txt"), "dev", section())
    from finetune.config import TaskSection

    bad = TaskSection(name="conll2003", data_dir=str(tmp_path), labels=["O", "B-PER"], tag_scheme="bio",
                      context="paragraph", tag_column=0)
    from finetune.tasks import TASKS

    assert bad.problems(TASKS) == [
        "task.labels needs both B- and I- for every type (IOB2); missing for PER",
        "task.tag_scheme 'bio' must be one of auto, iob1, iob2",
        "task.context 'paragraph' must be one of document, sentence",
        "task.tag_column 0 is the word; CoNLL-2003's entity tags are column 3 (or -1, the last)"]


def test_feature_based_needs_a_token_task_and_no_data_parallelism(tmp_path):
    from finetune.config import FinetuneConfig, ModelSection, ParallelSection, TaskSection
    from finetune.tasks import TASKS
    from pretrain.config import ConfigError

    (tmp_path / "ckpt").mkdir()
    model = ModelSection(init_from=str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match="--feature-based trains a token tagger; rte is not token classification"):
        FinetuneConfig(task=TaskSection(name="rte", data_dir=str(tmp_path)), model=model).validate(1, TASKS, feature_based=True)
    ner = TaskSection(name="conll2003", data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"the world size \(2\) must equal parallel.tensor_parallel \(1\)"):
        FinetuneConfig(task=ner, model=model).validate(2, TASKS, feature_based=True)
    FinetuneConfig(task=ner, model=model, parallel=ParallelSection(tensor_parallel=2)).validate(2, TASKS, feature_based=True)
    FinetuneConfig(task=ner, model=model).validate(2, TASKS)  # fine-tuning takes DP


# ----------------------------------------------------------------------------- schemes and metrics
def test_iob1_and_iob2_mark_the_same_entities():
    iob1 = ["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-ORG", "I-ORG"]
    iob2 = ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "B-ORG", "I-ORG"]
    assert to_iob2(iob1) == iob2 and to_iob1(iob2) == iob1
    assert chunk_starts(iob1) == chunk_starts(iob2) == [True, False, True, False, True, True, False]
    assert to_iob2(["O", "I-PER", "B-LOC", "I-PER"]) == ["O", "B-PER", "B-LOC", "B-PER"]  # a stray I- starts one


def conlleval_counts(gold, predicted):
    """A port of conlleval.pl's chunk counting (startOfChunk/endOfChunk over the token stream):
    (correct chunks, gold chunks, predicted chunks, correct tokens, tokens)."""
    def parts(tag):
        return ("O", "") if tag == "O" else tuple(tag.split("-", 1))

    def end_of_chunk(prev_tag, tag, prev_type, kind):
        return (prev_tag in "BI" and tag in "BO" and prev_tag != "O") or (prev_tag in "BI" and tag == "I" and prev_type != kind) \
            or (prev_tag != "O" and prev_type != kind and prev_tag != "")

    def start_of_chunk(prev_tag, tag, prev_type, kind):
        return tag == "B" or (prev_tag in ("", "O") and tag == "I") or (prev_tag == "B" and tag == "I" and prev_type != kind) \
            or (prev_tag == "I" and tag == "I" and prev_type != kind) or (tag != "O" and prev_type != kind)

    correct = found_gold = found_guessed = correct_tokens = tokens = 0
    for gold_sentence, predicted_sentence in zip(gold, predicted):
        in_correct, last_gold, last_guess, last_gold_type, last_guess_type = False, "O", "O", "", ""
        for g, p in [*zip(gold_sentence, predicted_sentence), ("O", "O")]:  # the sentence break closes chunks
            (gt, gtype), (pt, ptype) = parts(g), parts(p)
            gold_end, guess_end = end_of_chunk(last_gold, gt, last_gold_type, gtype), end_of_chunk(last_guess, pt, last_guess_type, ptype)
            gold_start, guess_start = start_of_chunk(last_gold, gt, last_gold_type, gtype), start_of_chunk(last_guess, pt, last_guess_type, ptype)
            if in_correct:
                if gold_end and guess_end and last_guess_type == last_gold_type:
                    in_correct, correct = False, correct + 1
                elif gold_end != guess_end or gtype != ptype:
                    in_correct = False
            if gold_start and guess_start and gtype == ptype:
                in_correct = True
            found_gold += gold_start
            found_guessed += guess_start
            last_gold, last_guess, last_gold_type, last_guess_type = gt, pt, gtype, ptype
        tokens += len(gold_sentence)
        correct_tokens += sum(a == b for a, b in zip(gold_sentence, predicted_sentence))
    return correct, found_gold, found_guessed, correct_tokens, tokens


HAND_WORKED = [
    # (gold, predicted, (precision, recall, f1, accuracy)) worked out by hand
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "I-PER", "O", "B-LOC"]], (1, 1, 1, 1)),
    # one entity cut short, one type wrong: 0 of 2 predicted right
    ([["B-PER", "I-PER", "O", "B-LOC"]], [["B-PER", "O", "O", "B-ORG"]], (0, 0, 0, 2 / 4)),
    # IOB1 gold (two adjacent PER entities, then LOC), IOB2 prediction finding the first PER and LOC: P 2/2, R 2/3
    ([["I-PER", "I-PER", "B-PER", "O", "I-LOC"]], [["B-PER", "I-PER", "O", "O", "B-LOC"]], (1, 2 / 3, 0.8, 2 / 5)),
    # two sentences; a predicted entity split in two: P 1/3, R 1/2, F1 0.4
    ([["B-ORG", "I-ORG", "O"], ["B-MISC"]], [["B-ORG", "B-ORG", "O"], ["B-MISC"]], (1 / 3, 1 / 2, 0.4, 3 / 4)),
    # an entity across a window edge predicted whole vs. split at the edge (left half I-, right half B-)
    ([["O", "B-LOC", "I-LOC", "I-LOC", "O"]], [["O", "B-LOC", "I-LOC", "B-LOC", "O"]], (0, 0, 0, 4 / 5)),
]


@pytest.mark.parametrize("gold, predicted, expected", HAND_WORKED)
def test_entity_scores_equal_hand_worked_values_and_conlleval(gold, predicted, expected):
    scores = tagging_scores(gold, predicted)
    assert [scores[k] for k in ("precision", "recall", "f1", "accuracy")] == pytest.approx(expected)
    correct, found_gold, found_guessed, correct_tokens, tokens = conlleval_counts(gold, predicted)
    precision = correct / found_guessed if found_guessed else 0.0
    recall = correct / found_gold if found_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    assert (scores["precision"], scores["recall"], scores["f1"], scores["accuracy"]) == pytest.approx(
        (precision, recall, f1, correct_tokens / tokens))
    # the same entities written in the other scheme score the same
    converted = tagging_scores([to_iob1(s) for s in gold], [to_iob1(s) for s in predicted])
    assert [converted[k] for k in ("precision", "recall", "f1")] == pytest.approx(expected[:3])


# ----------------------------------------------------------------------------- sub-tokens and windows
def test_max_context_owners_match_the_window_rule():
    rng = random.Random(0)
    for _ in range(50):
        n, window, stride = rng.randrange(1, 60), rng.randrange(2, 12), rng.randrange(1, 12)
        spans = windows(n, window, stride)
        positions = sorted(rng.sample(range(n), rng.randrange(1, n + 1)))
        assert max_context_owners(spans, positions) == [max_context_window(spans, p) for p in positions]


def test_first_sub_token_labels_and_every_word_predicted_once():
    from finetune.tasks.ner import build_tagging_features

    words = ["p0", "w3-w4", "zz", "l0", "l2", "l3", "w1", "o0", "o2", "w2", "w5", "p1"]
    tags = ["B-PER", "O", "O", "B-LOC", "I-LOC", "I-LOC", "O", "B-ORG", "I-ORG", "O", "O", "B-PER"]
    document = Document([Sentence(words[:6], tags[:6], list(range(6))), Sentence(words[6:], tags[6:], list(range(6)))])
    # 15 sub-tokens (w3-w4: 3, zz: 2) in windows of 8 starting 4 apart: 0-7, 4-11, 8-14
    features = build_tagging_features(tokenizer(), [document], CONLL2003_LABELS, max_seq_length=10, stride=4)
    assert features.windows_per_example == [3] and features.split_words == 2
    tokens = [[VOCAB[i] for i in row] for row in features.input_ids.tolist()]
    assert tokens[0] == ["[CLS]", "p0", "w3", "-", "w4", "z", "##z", "l0", "l2", "[SEP]"]
    labels = features.labels.tolist()
    label = {t: CONLL2003_LABELS.index(t) for t in CONLL2003_LABELS}
    # only first sub-tokens carry a tag (w3 of w3-w4, z of zz); -100 elsewhere
    assert labels[0] == [-100, label["B-PER"], label["O"], -100, -100, label["O"], -100, label["B-LOC"],
                         label["I-LOC"], -100]
    assert features.attention_mask.tolist()[2] == [1] * 9 + [0] and tokens[2][-2:] == ["[SEP]", "[PAD]"]
    # each word exactly once, from the window where it has the most context
    predicted = sorted(word for window in features.predicts for word, _ in window)
    assert predicted == list(range(12))
    first = [0, 1, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # each word's first sub-token
    for window, pairs in enumerate(features.predicts):
        for word, position in pairs:
            assert position == first[word] - 4 * window + 1
            assert max_context_window(windows(15, 8, 4), first[word]) == window


def test_an_entity_across_a_window_edge_is_predicted_whole():
    """Windows that disagree: each predicts the gold tag where it holds the word's max context
    and a wrong one elsewhere. Taking every word from its max-context window gives the gold
    entities; taking each word from the first window that holds it would split the entity."""
    from finetune.tasks.base import Dataset
    from finetune.tasks.ner import build_tagging_features, sentence_tags, word_predictions

    words = ["w1", "w2", "w5", "l0", "l2", "l3", "l2", "w6", "w7", "w8"]  # LOC over words 3-6
    gold = ["O", "O", "O", "B-LOC", "I-LOC", "I-LOC", "I-LOC", "O", "O", "O"]
    document = Document([Sentence(words, gold, list(range(10)))])
    features = build_tagging_features(tokenizer(), [document], CONLL2003_LABELS, max_seq_length=8, stride=3)
    assert features.windows_per_example == [3]  # sub-tokens 0-5, 3-8, 6-9: the entity crosses both edges
    label = {t: i for i, t in enumerate(CONLL2003_LABELS)}
    logits = np.zeros((3, 8, len(CONLL2003_LABELS)), dtype=np.float32)
    owners = {word: window for window, pairs in enumerate(features.predicts) for word, _ in pairs}
    for window in range(3):
        start = 3 * window
        for word in range(start, min(start + 6, 10)):
            right = gold[word] if owners[word] == window else ("B-LOC" if gold[word] != "O" else "B-PER")
            logits[window, word - start + 1, label[right]] = 1.0
    predicted = sentence_tags([document], word_predictions(features, logits), CONLL2003_LABELS, "iob2")
    assert predicted == [gold]
    task = ner_task()
    evaluation = task.evaluate(Dataset("dev", [document], features, "iob2"), logits, section())
    assert evaluation.metrics["f1"] == 1.0
    assert evaluation.files["dev.txt"].splitlines()[3:5] == ["l0 B-LOC B-LOC", "l2 I-LOC I-LOC"]
    # the counter-example: each word from the first window holding it splits the entity
    first_holder = [next(k for k in range(3) if 3 * k <= word < 3 * k + 6) for word in range(10)]
    naive = [int(logits[k, word - 3 * k + 1].argmax()) for word, k in enumerate(first_holder)]
    assert tagging_scores([gold], [to_iob2([CONLL2003_LABELS[i] for i in naive])])["f1"] < 1.0


def test_conll_predictions_file(tmp_path):
    documents = [Document([Sentence(["EU", "rejects"], ["I-ORG", "O"], [3, 4]), Sentence(["Peter"], ["I-PER"], [6])],
                          docstart=True)]
    assert conll_text(documents, [["I-ORG", "O"], ["O"]]) == \
        "-DOCSTART- O O\n\nEU I-ORG I-ORG\nrejects O O\n\nPeter I-PER O\n\n"
    untagged = [Document([Sentence(["EU"], None, [1])])]
    assert conll_text(untagged, [["B-ORG"]]) == "EU B-ORG\n\n"


# ----------------------------------------------------------------------------- end to end
def untagged_copy(path, target):
    """The file with only its words (a test file to predict)."""
    target.write_text("\n".join(line.split()[0] if line.strip() else "" for line in path.read_text().splitlines()) + "\n")
    return target


def prediction_rows(path):
    return [line.split() for line in path.read_text().splitlines() if line and not line.startswith("-DOCSTART-")]


@pytest.mark.slow
def test_fine_tuning_learns_and_the_export_predicts_our_tags(tiny_ner, tmp_path):
    from transformers import AutoTokenizer, BertForTokenClassification

    from finetune.tasks.ner import build_tagging_features, sentence_tags, word_predictions

    files = synthetic_files(tmp_path, scheme="iob1")
    test = untagged_copy(files["dev"], tmp_path / "test.txt")
    out = tmp_path / "out"
    # documents of ~25 words in windows of 22 sub-tokens, 8 apart: most need two or more
    done = finetune([f"model.init_from={tiny_ner}", f"task.train_file={files['train']}",
                     f"task.dev_files=[{files['dev']}]", f"task.test_files=[{test}]", f"train.output_dir={out}",
                     "train.epochs=4", "train.lr=1e-3", "task.max_seq_length=24", "task.doc_stride=8",
                     "train.global_batch_size=16"])
    assert re.search(r"12 documents, [\d,]+ words -> (\d+) windows \((\d+) need more than one\)", done.stderr + done.stdout)
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["best"]["metrics"]["f1"] >= 0.9  # predicting O everywhere scores 0
    assert summary["history"][0]["metrics"]["f1"] < 0.5  # it learned it, it was not given
    assert {"precision", "recall", "accuracy", "f1_PER", "f1_LOC", "f1_ORG"} <= set(summary["best"]["metrics"])

    # the dev predictions: conlleval's input, in the files' IOB1, scoring the best epoch's F1
    rows = prediction_rows(out / "predictions" / "dev.txt")
    gold_rows = prediction_rows(files["dev"])
    assert [r[:2] for r in rows] == [[g[0], g[-1]] for g in gold_rows]
    assert (out / "predictions" / "dev.txt").read_text().count("-DOCSTART- O O") == 12
    written, _ = read_tagged(str(out / "predictions" / "dev.txt"), -1, CONLL2003_LABELS)  # the predicted column
    predicted_sentences = [s.tags for d in written for s in d.sentences]
    documents, _ = read_tagged(str(files["dev"]), -1, CONLL2003_LABELS)
    gold = [s.tags for d in documents for s in d.sentences]
    assert [to_iob1(s) for s in predicted_sentences] == predicted_sentences  # written in the file's scheme
    assert tagging_scores(gold, predicted_sentences)["f1"] == pytest.approx(summary["best"]["metrics"]["f1"])
    submission = prediction_rows(out / "submission" / "conll2003.txt")
    assert [r[0] for r in submission] == [g[0] for g in gold_rows] and all(len(r) == 2 for r in submission)

    # the export: a BertForTokenClassification that transformers loads whole, with our labels,
    # its tokenizer cutting words as ours, predicting our tags from the same windows
    model, info = BertForTokenClassification.from_pretrained(out / "best", output_loading_info=True,
                                                             attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert [model.config.id2label[i] for i in range(9)] == list(CONLL2003_LABELS)
    hf_tokenizer = AutoTokenizer.from_pretrained(out / "best")
    features = build_tagging_features(tokenizer(), documents, CONLL2003_LABELS, 24, 8)
    first = hf_tokenizer(documents[0].words, is_split_into_words=True, add_special_tokens=False)["input_ids"]
    assert first == [t for w in documents[0].words for t in tokenizer().encode(w, add_special_tokens=False).ids]
    with torch.no_grad():
        logits = model.eval()(input_ids=features.input_ids, attention_mask=features.attention_mask,
                              token_type_ids=features.token_type_ids).logits.numpy()
    hf_tags = sentence_tags(documents, word_predictions(features, logits), CONLL2003_LABELS, "iob1")
    assert hf_tags == predicted_sentences
    # and our runner takes the export back (its token-classification head included)
    again = finetune([f"model.init_from={out / 'best'}", f"task.dev_files=[{files['dev']}]", "train.eval_only=true",
                      f"train.output_dir={tmp_path / 'again'}", "task.max_seq_length=24", "task.doc_stride=8"])
    assert "task head (classifier.weight, classifier.bias) taken from" in again.stdout + again.stderr
    assert json.loads((tmp_path / "again" / "metrics.json").read_text())["best"]["metrics"] == \
        pytest.approx(summary["best"]["metrics"])


@pytest.mark.slow
def test_tp1_and_tp2_give_the_same_losses_and_metrics(tiny_ner, tmp_path):
    """The same run at TP1 from the Hugging Face directory and at TP2 from its native conversion."""
    files = synthetic_files(tmp_path, seed=4, train_docs=40, dev_docs=8)
    native = tmp_path / "native"
    converted = run_python(["tools/convert_checkpoint.py", "hf-to-native", "--input", str(tiny_ner),
                            "--output", str(native), "--tp", "1", "--pp", "1"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    common = [f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]", "train.epochs=2",
              "train.lr=1e-3", "task.max_seq_length=24", "task.doc_stride=8", "train.keep_best=false",
              "train.global_batch_size=16", "train.micro_batch_size=8"]
    tp1 = finetune(common + [f"model.init_from={tiny_ner}", f"train.output_dir={tmp_path / 'tp1'}"])
    tp2 = finetune(common + [f"model.init_from={native}", f"train.output_dir={tmp_path / 'tp2'}",
                             "parallel.tensor_parallel=2"], nprocs=2)
    assert "TP1 x PP1 x DP1" in tp1.stderr + tp1.stdout and "TP2 x PP1 x DP1" in tp2[0].stdout  # the layouts ran
    one, two = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("tp1", "tp2"))
    assert len(one["train_losses"]) == len(two["train_losses"]) >= 10
    assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-4)
    assert [h["metrics"] for h in two["history"]] == [h["metrics"] for h in one["history"]]


@pytest.mark.slow
def test_feature_based_tagger_learns_from_cached_features(tiny_ner, tmp_path):
    files = synthetic_files(tmp_path, seed=6)
    out = tmp_path / "out"
    common = [f"model.init_from={tiny_ner}", f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]",
              f"train.output_dir={out}", "task.max_seq_length=24", "task.doc_stride=8", "features.layers=[-1,-2,-3]",
              "features.lstm_hidden=32"]
    first = finetune(common + ["features.epochs=10", "features.batch_size=8"], extra_args=["--feature-based"])
    log = first.stdout + first.stderr
    assert log.count("cached in") == 2 and "from the cache" not in log
    summary = json.loads((out / "feature_based" / "metrics.json").read_text())
    best = summary["best"]["metrics"]
    documents, _ = read_tagged(str(files["dev"]), -1, CONLL2003_LABELS)
    tags = [t for d in documents for s in d.sentences for t in s.tags]
    # chance: tagging every word O (the majority tag) scores entity F1 0 and this accuracy (~0.5);
    # the margin asked: entity F1 at least 0.8 above it, accuracy at least 0.3 above it
    all_o = tags.count("O") / len(tags)
    assert best["f1"] >= 0.8 and best["accuracy"] >= all_o + 0.3, (best, all_o)
    assert summary["history"][0]["metrics"]["f1"] < best["f1"]
    assert (out / "feature_based" / "predictions" / "dev.txt").exists()
    events = EventAccumulator(str(out / "feature_based" / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("eval/f1")) == len(events.Scalars("train/loss")) == 10
    tagger = json.loads((out / "feature_based" / "tagger.json").read_text())
    assert tagger["features"] == 3 * 64 and tagger["labels"] == list(CONLL2003_LABELS)
    # the second run reads the cache instead of running the encoder; a damaged entry is computed again
    train_cache, = (out / "feature_cache").glob("train-*.safetensors")
    dev_cache, = (out / "feature_cache").glob("dev-*.safetensors")
    stamp = train_cache.stat().st_mtime_ns
    dev_cache.write_bytes(b"not a safetensors file")
    again = finetune(common + ["features.epochs=1"], extra_args=["--feature-based"])
    log = again.stdout + again.stderr
    assert log.count("from the cache") == 1 and log.count("cached in") == 1 and "not readable" in log
    assert train_cache.stat().st_mtime_ns == stamp and dev_cache.stat().st_size > 1000
