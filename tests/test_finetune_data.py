"""Fine-tuning data and metrics: GLUE readers on files in each official layout, GLUE metrics on
known vectors, SQuAD evaluation = the official scripts (hand-computed cases)."""
import json
import subprocess
import sys

import pytest

from distributed import REPO
from finetune.tasks import TASKS
from finetune.tasks.base import TaskDataError
from finetune.tasks.glue import read_examples, submission_text
from finetune.glue_metrics import accuracy_and_f1, matthews, pearson_and_spearman
from finetune.squad_metrics import evaluate_v1, evaluate_v2, f1_v1, f1_v2, normalize_answer


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


# ----------------------------------------------------------------------------- GLUE readers
def test_every_task_reads_its_standard_layout(tmp_path):
    cola = write(tmp_path / "cola.tsv", ["gj04\t1\t\tThe sailors rode the breeze clear of the rocks.",
                                         "gj04\t0\t*\tThe more you eat, the more you want me."])
    examples, _ = read_examples(TASKS["cola"], cola, "train")  # CoLA train/dev: no header
    assert [(e.text_a[:11], e.label) for e in examples] == [("The sailors", "1"), ("The more yo", "0")]
    test = write(tmp_path / "cola_test.tsv", ["index\tsentence", "0\tBill whistled past the house."])
    examples, _ = read_examples(TASKS["cola"], test, "test")
    assert (examples[0].guid, examples[0].text_a, examples[0].label) == ("0", "Bill whistled past the house.", None)

    mrpc = write(tmp_path / "mrpc.tsv", ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "1\t702876\t702977\tA \"quoted\" one.\tB."])
    e = read_examples(TASKS["mrpc"], mrpc, "dev")[0][0]
    assert (e.text_a, e.text_b, e.label) == ('A "quoted" one.', "B.", "1")  # no CSV quoting in GLUE TSVs

    stsb = write(tmp_path / "stsb.tsv", ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
                                         "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane.\tAn air plane.\t5.000"])
    e = read_examples(TASKS["stsb"], stsb, "train")[0][0]
    assert (e.text_a, e.text_b, e.label) == ("A plane.", "An air plane.", 5.0)

    mnli_header = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse"
                   "\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")
    mnli = write(tmp_path / "dev_matched.tsv", [mnli_header, "0\t1\t1e\tfiction\t(x)\t(y)\t(X)\t(Y)\tP one.\tH one."
                                                "\tneutral\tneutral\tentailment\tneutral\tneutral\tneutral"])
    e = read_examples(TASKS["mnli"], mnli, "dev")[0][0]
    assert (e.text_a, e.text_b, e.label) == ("P one.", "H one.", "neutral")

    for name, header in (("qnli", "index\tquestion\tsentence\tlabel"), ("rte", "index\tsentence1\tsentence2\tlabel")):
        path = write(tmp_path / f"{name}.tsv", [header, "0\tA?\tB.\tnot_entailment"])
        assert read_examples(TASKS[name], path, "train")[0][0].label == "not_entailment"
    sst = write(tmp_path / "sst.tsv", ["sentence\tlabel", "hide new secretions \t0"])
    assert read_examples(TASKS["sst2"], sst, "train")[0][0].label == "0"
    ax = write(tmp_path / "diagnostic.tsv", ["index\tsentence1\tsentence2", "0\tThe cat sat.\tThe cat did not sit."])
    e = read_examples(TASKS["mnli"], ax, "test")[0][0]
    assert (e.guid, e.text_a, e.text_b) == ("0", "The cat sat.", "The cat did not sit.")


def test_qqp_malformed_rows_are_skipped_and_counted(tmp_path):
    qqp = write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                                       "1\t1\t2\tHow?\tWhy?\t0", "2\t3\t4\tbroken row", "3\t5\t6\tWhat?\tWhat?\t1"])
    examples, report = read_examples(TASKS["qqp"], qqp, "train")
    assert [e.label for e in examples] == ["0", "1"]
    assert report.skipped == {"missing fields": 1}
    assert "qqp.tsv:3" in report.summary()


def test_named_columns_and_integer_labels(tmp_path):
    csv_path = write(tmp_path / "mnli.csv", ["premise,hypothesis,label", "A man.,A person.,0", '"Two, dogs.",Cats.,2'])
    examples, _ = read_examples(TASKS["mnli"], csv_path, "train")
    assert [(e.text_a, e.label) for e in examples] == [("A man.", "entailment"), ("Two, dogs.", "contradiction")]
    jsonl = write(tmp_path / "rte.jsonl", [json.dumps({"sentence1": "A", "sentence2": "B", "label": "entailment", "idx": 7})])
    e = read_examples(TASKS["rte"], jsonl, "dev")[0][0]
    assert (e.guid, e.label) == ("7", "entailment")
    as_json = tmp_path / "stsb.json"
    as_json.write_text(json.dumps([{"sentence1": "x", "sentence2": "y", "label": 3.2}]))
    assert read_examples(TASKS["stsb"], str(as_json), "train")[0][0].label == 3.2


@pytest.mark.parametrize("task, lines, split, message", [
    ("rte", ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tmaybe"], "train", "rte.tsv:2: unknown label 'maybe'"),
    ("mnli", ["premise,hypothesis,label", "a,b,7"], "train", "out of range for mnli"),
    ("rte", ["index\tsentence1\tsentence2\tlabel", "0\tonly one"], "train", "rte.tsv:2: 2 column(s)"),
    ("stsb", ["sentence1,sentence2,label", "a,b,high"], "train", "score 'high' is not a number"),
    ("qnli", ["question,label", "a,entailment"], "train", "missing column(s) sentence"),
    ("rte", [], "train", "empty file"),
    ("rte", ["index\tsentence1\tsentence2\tlabel"], "dev", "no examples"),
])
def test_bad_glue_files_are_named(tmp_path, task, lines, split, message):
    suffix = ".csv" if lines and "," in lines[0] else ".tsv"
    path = write(tmp_path / f"{task}{suffix}", lines)
    with pytest.raises(TaskDataError) as error:
        read_examples(TASKS[task], path, split)
    assert message in str(error.value)


MRPC_HEADER = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"


@pytest.mark.parametrize("task, lines, message", [
    # an MRPC file given as SST-2: the width is named, not the first label that cannot be SST-2's
    ("sst2", [MRPC_HEADER, "1\t1\t2\tA.\tB."], "sst2.tsv:1 (header): 5 column(s), the sst2 train/dev layout has 2"),
    ("mrpc", [MRPC_HEADER, "1\t1\t2\tA.\tB.", "0\t3\t4\tC.\tD.\textra"], "mrpc.tsv:3: 6 column(s), the mrpc train/dev "
     "layout has 5"),
    ("cola", ["1\t1\t2\tA.\tB."], "cola.tsv:1: 5 column(s), the cola train/dev layout has 4 (tab-separated, no "
     "quoting); 5 is the layout of mrpc"),
])
def test_a_file_of_another_layout_is_named_by_its_width(tmp_path, task, lines, message):
    path = write(tmp_path / f"{task}.tsv", lines)
    with pytest.raises(TaskDataError) as error:
        read_examples(TASKS[task], path, "train")
    assert message in str(error.value)


def test_qqp_rows_of_another_width_are_skipped_and_counted(tmp_path):
    qqp = write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t1\t2\tHow?\tWhy?\t0",
                                       "2\t3\t4\tWhat?\tWhat?\t1\tsurplus"])
    examples, report = read_examples(TASKS["qqp"], qqp, "train")
    assert len(examples) == 1 and report.skipped == {"extra fields": 1}


def _latin1(path, lines):
    path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))
    return str(path)


@pytest.mark.parametrize("name, lines, column", [
    ("rte.tsv", ["index\tsentence1\tsentence2\tlabel", "0\tA.\tB.\tentailment", "1\tCaf\u00e9.\tB.\tentailment"], 5),
    ("rte.csv", ["sentence1,sentence2,label", "A.,B.,entailment", "Caf\u00e9.,B.,entailment"], 3),
    ("rte.jsonl", ['{"sentence1": "A.", "sentence2": "B.", "label": "entailment"}', "",
                   '{"sentence1": "Caf\u00e9.", "sentence2": "B.", "label": "entailment"}'], 18),
])
def test_invalid_utf8_in_a_glue_file_names_its_line(tmp_path, name, lines, column):
    path = _latin1(tmp_path / name, lines)
    with pytest.raises(TaskDataError) as error:
        read_examples(TASKS["rte"], path, "train")
    assert f"{path}:3: not valid UTF-8 (byte 0xe9 at byte {column} of the line)" in str(error.value)


def test_invalid_utf8_in_squad_swag_and_feature_inputs_names_its_line(tmp_path):
    from finetune.features import FeatureError, read_lines
    from finetune.tasks.squad import read_squad
    from finetune.tasks.swag import read_swag

    squad = _latin1(tmp_path / "train.json", ['{"version": "1.1", "data": [', '{"title": "Caf\u00e9", "paragraphs": []}]}'])
    with pytest.raises(TaskDataError, match=r"train.json:2: not valid UTF-8 \(byte 0xe9 at byte 14 of the line\)"):
        read_squad(squad, "1.1", training=True)
    swag = _latin1(tmp_path / "val.csv", ["sent1,sent2,ending0,ending1,ending2,ending3,label",
                                          "Caf\u00e9,b,c,d,e,f,0"])
    with pytest.raises(TaskDataError, match=r"val.csv:2: not valid UTF-8"):
        read_swag(swag, "dev")
    lines = _latin1(tmp_path / "lines.txt", ["one", "two", "caf\u00e9 three"])
    with pytest.raises(FeatureError, match=r"lines.txt:3: not valid UTF-8 \(byte 0xe9 at byte 3 of the line\)"):
        read_lines(lines)


def test_feature_lines_split_as_text_mode_does(tmp_path):
    from finetune.features import read_lines

    path = tmp_path / "lines.txt"
    path.write_bytes("a\r\nb ||| c\rd \u2028 e\n".encode())
    assert read_lines(str(path)) == ["a", ("b", "c"), "d \u2028 e"]


def test_submission_format(tmp_path):
    examples, _ = read_examples(TASKS["mnli"], write(tmp_path / "t.tsv", [
        "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2",
        "0\t1\t1\tx\t()\t()\t()\t()\tA\tB", "1\t1\t1\tx\t()\t()\t()\t()\tC\tD"]), "test")
    assert submission_text(TASKS["mnli"], examples, [2, 0]) == "index\tprediction\n0\tcontradiction\n1\tentailment\n"
    assert submission_text(TASKS["stsb"], examples, [4.12345, 0.5]) == "index\tprediction\n0\t4.123\n1\t0.500\n"


# ----------------------------------------------------------------------------- GLUE metrics
def test_glue_metrics_on_known_vectors():
    assert matthews([1, 1, 0, 0], [1, 0, 0, 0])["matthews_corr"] == pytest.approx(2 / 12 ** 0.5)
    assert accuracy_and_f1([1, 0, 1, 1], [1, 1, 0, 1]) == pytest.approx({"accuracy": 0.5, "f1": 2 / 3})
    r = pearson_and_spearman([1, 2, 3, 4], [1, 3, 2, 4])
    assert r == pytest.approx({"pearson": 0.8, "spearman": 0.8})


# ----------------------------------------------------------------------------- SQuAD evaluation
@pytest.mark.parametrize("text, normalised", [
    ("The  Cat, sat!", "cat sat"),
    ("An apple a day", "apple day"),
    ("theater another", "theater another"),  # articles only as whole words
    ("café «bar» — ok", "café «bar» — ok"),  # non-ASCII punctuation is kept, as in the official script
    (" a\tb\n c ", "b c"),
    ("U.S.A.", "usa"),
])
def test_normalisation(text, normalised):
    assert normalize_answer(text) == normalised


def test_f1_edge_cases():
    assert f1_v2("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    assert f1_v2("", "") == 1.0 and f1_v2("the", "") == 1.0 and f1_v2("", "cat") == 0.0 and f1_v2("cat", "") == 0.0
    assert f1_v1("cat", "the") == 0.0 and f1_v1("", "") == 0.0  # v1.1 has no no-answer rule


def _dataset(version):
    qas = [{"id": "q1", "answers": [{"text": "Paris", "answer_start": 0}, {"text": "paris city", "answer_start": 0}]},
           {"id": "q2", "answers": []},
           {"id": "q3", "answers": [{"text": "blue", "answer_start": 0}]}]
    if version == "1.1":
        qas = [qa for qa in qas if qa["answers"]]
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": "Paris blue", "qas": qas}]}]}


def test_v2_scores_breakdown_and_thresholds():
    data = _dataset("2.0")["data"]
    predictions = {"q1": "Paris", "q2": "", "q3": "dark blue"}
    na_probs = {"q1": 0.1, "q2": 0.9, "q3": 0.5}
    r = evaluate_v2(data, predictions, na_probs)
    assert list(r) == ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact", "NoAns_f1",
                       "NoAns_total", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"]
    assert r["exact"] == pytest.approx(200 / 3) and r["f1"] == pytest.approx(100 * (2 + 2 / 3) / 3)
    assert r["HasAns_exact"] == 50 and r["HasAns_f1"] == pytest.approx(100 * (1 + 2 / 3) / 2) and r["NoAns_f1"] == 100
    assert (r["best_exact"], r["best_exact_thresh"]) == (pytest.approx(200 / 3), 0.1)
    assert (r["best_f1"], r["best_f1_thresh"]) == (pytest.approx(100 * (2 + 2 / 3) / 3), 0.5)
    # above the threshold a question counts as answered "no answer"
    r = evaluate_v2(data, predictions, na_probs, na_prob_thresh=0.4)
    assert r["exact"] == pytest.approx(200 / 3) and r["f1"] == pytest.approx(200 / 3)
    # a non-empty answer to an unanswerable question costs one in the threshold search
    r = evaluate_v2(data, {"q1": "Paris", "q2": "Lyon", "q3": "blue"}, {"q1": 0.2, "q2": 0.3, "q3": 0.4})
    assert (r["best_exact"], r["best_exact_thresh"]) == (pytest.approx(200 / 3), 0.2)
    assert "best_exact" not in evaluate_v2(data, predictions)  # no probabilities: no search
    with pytest.raises(ValueError, match="1 question.s. have no prediction .first: q3"):
        evaluate_v2(data, {"q1": "Paris", "q2": ""})


def test_v1_counts_missing_predictions_as_zero():
    data = _dataset("1.1")["data"]
    assert evaluate_v1(data, {"q1": "the Paris", "q3": "blue sky"}) == pytest.approx({"exact_match": 50.0, "f1": 100 * (1 + 2 / 3) / 2})
    assert evaluate_v1(data, {"q1": "Paris"}) == {"exact_match": 50.0, "f1": 50.0}


def test_evaluate_squad_tool_is_a_drop_in(tmp_path):
    (tmp_path / "dev.json").write_text(json.dumps(_dataset("2.0")))
    (tmp_path / "pred.json").write_text(json.dumps({"q1": "Paris", "q2": "", "q3": "dark blue"}))
    (tmp_path / "na.json").write_text(json.dumps({"q1": 0.1, "q2": 0.9, "q3": 0.5}))
    tool = [sys.executable, str(REPO / "tools" / "evaluate_squad.py")]
    out = subprocess.run(tool + [str(tmp_path / "dev.json"), str(tmp_path / "pred.json"), "--na-prob-file",
                                 str(tmp_path / "na.json"), "--out-file", str(tmp_path / "eval.json")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "eval.json").read_text())["best_f1_thresh"] == 0.5
    (tmp_path / "v1.json").write_text(json.dumps(_dataset("1.1")))
    out = subprocess.run(tool + [str(tmp_path / "v1.json"), str(tmp_path / "pred.json")], capture_output=True, text=True)
    assert json.loads(out.stdout) == pytest.approx({"exact_match": 50.0, "f1": 100 * (1 + 2 / 3) / 2})
    bad = subprocess.run(tool + [str(tmp_path / "v1.json"), str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert bad.returncode == 1 and "prediction file" in bad.stderr and "missing.json" in bad.stderr


def test_fine_tuning_logs_only_the_heads_it_uses(tmp_path):
    """Reading a BertModel directory initialises the next-sentence and MLM heads (pretraining's):
    fine-tuning never runs them, so it does not log them; a missing pooler (BertForMaskedLM) it
    reads the [CLS] through, so that note stays."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    from finetune.finetuner import notes_that_matter
    from pretrain.checkpoint.load import read_any

    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    BertModel(config).save_pretrained(tmp_path / "model")
    BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    notes = read_any(str(tmp_path / "model"), with_optimizer=False).notes
    assert any("has no next-sentence head" in n for n in notes) and any("has no MLM head" in n for n in notes), notes
    kept = notes_that_matter(notes)
    assert not any("next-sentence head" in n or "MLM head" in n for n in kept) and kept, kept  # "read BertModel ..." stays
    mlm_notes = notes_that_matter(read_any(str(tmp_path / "mlm"), with_optimizer=False).notes)
    assert any("has no pooler" in n for n in mlm_notes), mlm_notes
