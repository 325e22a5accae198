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


# ----------------------------------------------------------------------------- headers and the read report
# Rows of GLUE MRPC as the GLUE download has them (train.tsv; test.tsv with an index for the label)
MRPC_ROWS = ["1\t702876\t702977\tAmrozi accused his brother , whom he called \" the witness \" , of deliberately "
             "distorting his evidence .\tReferring to him as only \" the witness \" , Amrozi accused his brother of "
             "deliberately distorting his evidence .",
             "0\t2108705\t2108831\tYucaipa owned Dominick 's before selling the chain to Safeway in 1998 for $ 2.5 "
             "billion .\tYucaipa bought Dominick 's in 1995 for $ 693 million and sold it to Safeway for $ 1.8 "
             "billion in 1998 .",
             "1\t1330381\t1330521\tThey had published an advertisement on the Internet on June 10 , offering the "
             "cargo for sale , he added .\tOn June 10 , the ship 's owners had published an advertisement on the "
             "Internet , offering the explosives for sale ."]


@pytest.mark.parametrize("split", ["train", "dev"])
def test_a_headerless_mrpc_file_is_refused_not_short_of_its_first_example(tmp_path, split):
    """The GLUE download's MRPC files begin with a header line; without it the first example
    was read as the header and lost (119 of 120, exit 0)."""
    path = write(tmp_path / f"{split}.tsv", MRPC_ROWS)
    with pytest.raises(TaskDataError) as error:
        read_examples(TASKS["mrpc"], path, split)
    assert str(error.value) == (
        f"{path}:1: this row is data (label '1') where the mrpc train/dev layout has its header line "
        "(GLUE's: Quality, #1 ID, #2 ID, #1 String, #2 String); add a header line, or give the rows as "
        ".csv/.jsonl or a .tsv whose header names its columns (docs/finetuning.md)")
    examples, report = read_examples(TASKS["mrpc"], write(tmp_path / "whole.tsv", [MRPC_HEADER, *MRPC_ROWS]), split)
    assert len(examples) == 3 and (report.rows, report.examples, report.skipped) == (3, 3, {})
    assert report.summary() == f"{tmp_path / 'whole.tsv'}: 3 rows after the header line, 3 examples"


# One data row of each task's standard layout (train/dev; test) as the GLUE download has it
STANDARD_ROWS = {
    "sst2": ("hide new secretions from the parental units \t0", "0\tuneasy mishmash of styles and genres ."),
    "stsb": ("0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\tAn air plane is taking "
             "off.\t5.000", "0\tmain-news\theadlines\t2015\t0001\tnone\tnone\tA man.\tA woman."),
    "qqp": ("133273\t213221\t213222\tHow is the life of a math student?\tWhich level of prepration is enough?\t0",
            "0\tWhy am I mentally very lonely?\tWhat is the best way to become lonely?"),
    "mnli": ("0\t31193\t31193n\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tConceptually cream skimming has two "
             "dimensions.\tProduct and geography are what make cream skimming work.\tneutral\tneutral",
             "0\t31193\t31193n\tgovernment\t( x )\t( y )\t(ROOT x)\t(ROOT y)\tP.\tH."),
    "qnli": ("0\tWhen did the third Digimon series begin?\tUnlike the two seasons before it, ...\tnot_entailment",
             "0\tWhat organization is devoted to Jihad against Israel?\tFor some decades prior ..."),
    "rte": ("0\tNo Weapons of Mass Destruction Found in Iraq Yet.\tWeapons of Mass Destruction Found in Iraq."
            "\tnot_entailment", "0\tMexico's new president.\tMexico has a president."),
    "wnli": ("0\tI stuck a pin through a carrot.\tThe carrot has a hole.\t1", "0\tThe cat sat.\tIt sat."),
    "mrpc": (MRPC_ROWS[0], "0\t1089874\t1089925\tPCCW 's chief operating officer .\tCurrent Chief Operating "
             "Officer ."),
    "cola": (None, "0\tBill whistled past the house."),
}


@pytest.mark.parametrize("task, split", [(task, split) for task, rows in STANDARD_ROWS.items()
                                         for split, row in zip(("train", "test"), rows) if row is not None])
def test_every_glue_layout_with_a_header_refuses_a_file_without_it(tmp_path, task, split):
    """A first row that reads as data (a valid label, or a test file's numeric index) where the
    header belongs is named, for every task whose files have a header (CoLA's train/dev have none)."""
    row = STANDARD_ROWS[task][split == "test"]
    headerless = write(tmp_path / f"{task}.tsv", [row, row])
    with pytest.raises(TaskDataError, match=rf"{task}.tsv:1: this row is data \((label|index) '[^']+'\) where the "
                                            rf"{task} {'test' if split == 'test' else 'train/dev'} layout has its header"):
        read_examples(TASKS[task], headerless, split)
    header = "\t".join(f"c{i}" for i in range(len(row.split("\t"))))  # any names: what matters is that it is no data
    examples, report = read_examples(TASKS[task], write(tmp_path / f"{task}_h.tsv", [header, row, row]), split)
    assert len(examples) == 2 and report.rows == 2


def test_cola_train_is_read_without_a_header_and_a_header_line_is_recognised(tmp_path):
    rows = ["gj04\t1\t\tThe sailors rode the breeze clear of the rocks.", "gj04\t0\t*\tThe more you eat."]
    examples, report = read_examples(TASKS["cola"], write(tmp_path / "train.tsv", rows), "train")
    assert len(examples) == 2 and report.summary() == f"{tmp_path / 'train.tsv'}: 2 rows (no header line), 2 examples"
    named = write(tmp_path / "named.tsv", ["source\tlabel\tauthor\tsentence", *rows])
    examples, report = read_examples(TASKS["cola"], named, "train")
    assert [e.label for e in examples] == ["1", "0"] and report.summary().endswith("2 rows after the header line, 2 examples")
    unnamed = write(tmp_path / "unnamed.tsv", ["a\tb\tc\td", *rows])
    with pytest.raises(TaskDataError, match=r"unnamed.tsv:1: unknown label 'b' for cola .*; the cola train/dev layout "
                                            r"has no header line: is this one\?"):
        read_examples(TASKS["cola"], unnamed, "train")


def test_every_row_is_counted_in_the_read_report(tmp_path):
    qqp = write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t1\t2\tHow?\tWhy?\t0",
                                       "2\t3\t4\tbroken row", "", "3\t5\t6\tWhat?\tWhat?\t1"])
    examples, report = read_examples(TASKS["qqp"], qqp, "train")
    assert (report.rows, report.examples, report.skipped) == (4, 2, {"missing fields": 1, "blank line": 1})
    assert report.summary().startswith(f"{qqp}: 4 rows after the header line, 2 examples; skipped 1 (missing fields), "
                                       f"1 (blank line) — e.g. {qqp}:3: missing fields; {qqp}:4: blank line")
    jsonl = write(tmp_path / "rte.jsonl", [json.dumps({"sentence1": "A", "sentence2": "B", "label": "entailment"})] * 3)
    assert read_examples(TASKS["rte"], jsonl, "train")[1].summary() == f"{jsonl}: 3 lines, 3 examples"


HF_MRPC = ["sentence1\tsentence2\tlabel\tidx",
           '"Amrozi accused his brother , whom he called "" the witness "" ."\t"Referring to him as "" the witness "" ."'
           '\t1\t0',
           "Yucaipa owned Dominick 's .\tYucaipa bought Dominick 's in 1995 .\t0\t1"]


@pytest.mark.parametrize("task", ["mrpc", "rte"])
def test_a_tsv_whose_header_names_its_columns_is_read_by_name(tmp_path, task):
    """Hugging Face datasets' layout (sentence1, sentence2, label, idx; written by pandas, so with
    CSV quoting). RTE's standard layout has 4 columns too: read by position it took sentence2 for
    sentence1 and idx for the label."""
    lines = HF_MRPC if task == "mrpc" else [HF_MRPC[0], "A.\tB.\tentailment\t0", "C.\tD.\tnot_entailment\t1"]
    path = write(tmp_path / f"{task}.tsv", lines)
    examples, report = read_examples(TASKS[task], path, "dev")
    first = examples[0]
    if task == "mrpc":
        assert (first.text_a, first.text_b, first.label) == ('Amrozi accused his brother , whom he called " the '
                                                             'witness " .', 'Referring to him as " the witness " .', "1")
    else:
        assert (first.text_a, first.text_b, first.label) == ("A.", "B.", "entailment")
    assert [e.guid for e in examples] == ["0", "1"] and report.summary() == f"{path}: 2 rows after the header line, 2 examples"
    test = write(tmp_path / "test.tsv", [HF_MRPC[0], "A.\tB.\t-1\t0"])
    assert read_examples(TASKS[task], test, "test")[0][0].guid == "0"


def test_a_named_tsv_row_that_is_not_one_line_is_refused(tmp_path):
    path = write(tmp_path / "mrpc.tsv", [HF_MRPC[0], '"A quote never closed.\tB.\t1\t0', "C.\tD.\t0\t1"])
    with pytest.raises(TaskDataError, match=r"mrpc.tsv:2: a quoted field runs over 2 lines"):
        read_examples(TASKS["mrpc"], path, "train")
    wide = write(tmp_path / "wide.tsv", [HF_MRPC[0], "A.\tB.\t1\t0\textra"])
    with pytest.raises(TaskDataError, match=r"wide.tsv:2: 5 column\(s\), the header line has 4"):
        read_examples(TASKS["mrpc"], wide, "train")


def test_a_tsv_of_another_width_names_the_named_column_alternative(tmp_path):
    path = write(tmp_path / "mrpc.tsv", ["a\tb\tc\td", "x\ty\t1\t0"])
    with pytest.raises(TaskDataError) as error:
        read_examples(TASKS["mrpc"], path, "train")
    assert str(error.value) == (
        f"{path}:1 (header): 4 column(s), the mrpc train/dev layout has 5 (tab-separated, no quoting); 4 is the "
        "layout of cola, qnli, rte, wnli: is this another task's file? Other columns: a header line naming them "
        "(sentence1, sentence2, label; or set task.text_a_column, task.text_b_column, task.label_column) in a .tsv, "
        ".csv or .jsonl file")


def test_a_missing_data_dir_is_named_by_its_key(tmp_path, capsys):
    from finetune.main import main

    assert main(["mrpc", f"model.init_from={tmp_path}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("configs/finetune/mrpc.yaml + command line):")
    assert err[1] == ("task.data_dir is not set: give the task's directory on the command line, task.data_dir=DIR "
                      "(the directory of mrpc's train.tsv, dev.tsv), or its files: task.train_file=FILE task.dev_files=[FILE]")


def test_swag_squad_and_tagged_files_count_every_record(tmp_path):
    from finetune.tasks.squad import read_squad
    from finetune.tasks.swag import read_swag
    from finetune.tasks.tagging import read_tagged

    header = "video-id,fold-ind,sent1,sent2,ending0,ending1,ending2,ending3,label"
    swag = write(tmp_path / "val.csv", [header, "v1,7,A man,He,runs.,sits.,eats.,flies.,0", "",
                                        "v2,8,A dog,It,barks.,sings.,reads.,swims.,3"])
    examples, report = read_swag(swag, "dev")
    assert [e.guid for e in examples] == ["7", "8"] and report.skipped == {"blank line": 1}
    assert report.summary().startswith(f"{swag}: 3 rows after the header line, 2 examples; skipped 1 (blank line)")
    wide = write(tmp_path / "wide.csv", [header, "v1,7,A man,He,runs.,sits.,eats.,flies.,0,surplus"])
    with pytest.raises(TaskDataError, match=r"wide.csv:2: 10 column\(s\), the header line has 9"):
        read_swag(wide, "dev")  # a surplus column was ignored without a word

    qas = [{"id": "q1", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 0}]},
           {"id": "q2", "question": "What?", "answers": [{"text": "Paris", "answer_start": 3}]}]
    squad = tmp_path / "train.json"
    squad.write_text(json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "Paris is.", "qas": qas}]}]}))
    _, _, report = read_squad(str(squad), "1.1", training=True)
    assert report.summary().startswith(f"{squad}: 2 questions, 1 examples; skipped 1 (answer_start does not point")
    flat = tmp_path / "flat.json"  # Hugging Face's flattened export: one object per question, no paragraphs
    flat.write_text(json.dumps({"data": [{"id": "q1", "context": "Paris is.", "question": "Where?"}]}))
    with pytest.raises(TaskDataError, match=r'flat.json: data\[0\] has no "paragraphs" list'):
        read_squad(str(flat), "1.1", training=True)

    conll = write(tmp_path / "train.jsonl", ['{"tokens": ["EU", "rejects"], "tags": ["B-ORG", "O"]}',
                                             '{"tokens": [], "tags": []}'])
    _, report = read_tagged(conll, -1, ("O", "B-ORG", "I-ORG"))
    assert report.summary() == f"{conll}: 2 sentences, 1 examples; skipped 1 (no tokens) — e.g. {conll}:2: no tokens"
