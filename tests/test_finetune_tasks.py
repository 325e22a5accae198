"""Fine-tuning end to end (GLUE classification and regression, SWAG multiple choice) on small
synthetic tasks built to be learnable: a tiny random BERT reaches near-perfect dev scores; TP1 and
TP2 agree; a Hugging Face checkpoint and its native conversion fine-tune alike; the best weights
load in transformers and predict what we predicted."""
import csv
import json
import random
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
import torch

from distributed import run_python, run_ranks
from finetune.official_metrics import official_score

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

WORDS = [f"w{i}" for i in range(12)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
QUIET = ["train.progress=false", "model.hidden_dropout=0", "model.attention_dropout=0", "model.classifier_dropout=0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """root/hf: a random-init tiny BertForPreTraining directory (see tiny_bert)."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_bert(root)
    return root


def tiny_bert(root):
    """root/hf: a random-init tiny BertForPreTraining directory (vocab: specials + w0..w11 + fillers)."""
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=32)).save_pretrained(root / "hf")
    (root / "hf" / "vocab.txt").write_text("\n".join(SPECIALS + WORDS + [f"x{i}" for i in range(15)]) + "\n")
    return root / "hf"


def write_tsv(path, header, rows):
    path.write_text("\n".join(["\t".join(header)] + ["\t".join(map(str, r)) for r in rows]) + "\n")
    return path


def repeat_task(root, seed=2, train=1500, dev=200):
    """RTE layout; entailment iff sentence2 repeats sentence1."""
    rng = random.Random(seed)
    files = {}
    for split, n in (("train", train), ("dev", dev)):
        rows = []
        for i in range(n):
            a = [rng.choice(WORDS) for _ in range(4)]
            same = rng.random() < 0.5
            b = a if same else [rng.choice(WORDS) for _ in range(4)]
            rows.append((i, " ".join(a), " ".join(b), "entailment" if same else "not_entailment"))
        files[split] = write_tsv(root / f"repeat_{split}.tsv", ["index", "sentence1", "sentence2", "label"], rows)
    return files


def finetune(task, overrides, nprocs=1, expect_success=True):
    if nprocs == 1:
        done = run_python(["-m", "finetune", task, *QUIET, *overrides], timeout=600)
        if expect_success:
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done
    return run_ranks(["-m", "finetune", task, *QUIET, *overrides], nprocs, timeout=600, expect_success=expect_success)


def test_pair_classification_learns_and_best_weights_load_in_transformers(tiny, tmp_path):
    from transformers import AutoTokenizer, BertForSequenceClassification

    files = repeat_task(tmp_path)
    out = tmp_path / "out"
    done = finetune("rte", [f"model.init_from={tiny / 'hf'}", f"task.train_file={files['train']}",
                            f"task.dev_files=[{files['dev']}]", f"train.output_dir={out}", "train.epochs=14",
                            "train.lr=1e-3", "task.max_seq_length=12", "train.progress=true"])
    # progress into a pipe (a batch job's log): plain lines every few seconds and the final count,
    # never a bar's carriage-return redraws
    assert "\r" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fine-tuning rte: ")]
    assert 1 <= len(lines) <= 20 and re.match(r"fine-tuning rte: (\d+)/\1 \(100%\)", lines[-1]), lines
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["best"]["metrics"]["accuracy"] >= 0.9  # chance: 0.5
    assert summary["history"][0]["metrics"]["accuracy"] < 0.8  # it learned, it was not given
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "eval/accuracy"} <= tags, tags
    speed = {"perf/real_tokens_per_second", "perf/tokens_per_second", "perf/examples_per_second", "perf/real_token_share"}
    assert speed <= tags, tags
    # every pair is [CLS] 4 words [SEP] 4 words [SEP]: batches cut to those 11 tokens (on the CPU no
    # rounding up to 8), all of them real; max_length would pad to 12
    assert {e.value for e in events.Scalars("perf/real_token_share")} == {1.0}
    assert len(events.Scalars("eval/accuracy")) == 14  # one evaluation per epoch

    # the best epoch's weights, in Hugging Face format, predict what we predicted
    model = BertForSequenceClassification.from_pretrained(out / "best", attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "best")
    rows = [line.split("\t") for line in files["dev"].read_text().splitlines()[1:]]
    batch = tokenizer([r[1] for r in rows], [r[2] for r in rows], padding="max_length", max_length=12,
                      truncation=True, return_tensors="pt")
    with torch.no_grad():
        hf = model(**batch).logits.argmax(-1).tolist()
    ours = [line.split("\t")[1] for line in (out / "predictions" / "repeat_dev.tsv").read_text().splitlines()[1:]]
    assert [model.config.id2label[i] for i in hf] == ours
    # the prediction file is the best epoch's (not the last one's): it scores the best accuracy
    gold = [r[3] for r in rows]
    assert sum(o == g for o, g in zip(ours, gold)) / len(gold) == pytest.approx(summary["best"]["metrics"]["accuracy"])
    assert json.loads((out / "best" / "finetune_result.json").read_text())["epoch"] == summary["best"]["epoch"]


def test_regression_learns(tiny, tmp_path):
    """STS-B layout; the score is 5/4 x the number of w0 in sentence1."""
    rng = random.Random(3)
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]
    files = {}
    for split, n in (("train", 1200), ("dev", 200)):
        rows = []
        for i in range(n):
            k = rng.randrange(5)
            a = ["w0"] * k + [rng.choice(WORDS[1:]) for _ in range(4 - k)]
            rng.shuffle(a)
            rows.append((i, "g", "f", "y", i, "s", "s", " ".join(a), " ".join(rng.choice(WORDS) for _ in range(3)),
                         f"{1.25 * k:.3f}"))
        files[split] = write_tsv(tmp_path / f"{split}.tsv", header, rows)
    out = tmp_path / "out"
    finetune("stsb", [f"model.init_from={tiny / 'hf'}", f"task.data_dir={tmp_path}", f"train.output_dir={out}",
                      "train.epochs=6", "train.lr=1e-3", "task.max_seq_length=12", "train.keep_best=false"])
    summary = json.loads((out / "metrics.json").read_text())
    best = summary["best"]["metrics"]
    assert best["pearson"] > 0.95 and best["spearman"] > 0.9
    # the best epoch is the one with the best official score (mean of Pearson and Spearman), the
    # score a sweep selects by, not Pearson alone
    assert summary["selected_by"] == "mean of Pearson and Spearman"
    scores = [official_score("stsb", h["metrics"]) for h in summary["history"]]
    assert [h["score"] for h in summary["history"]] == pytest.approx(scores)
    assert summary["best"]["epoch"] == summary["history"][scores.index(max(scores))]["epoch"]


def test_tp1_and_tp2_agree_and_a_converted_checkpoint_fine_tunes(tiny, tmp_path):
    """The same run at TP1 from the Hugging Face directory and at TP2 from its native conversion."""
    files = repeat_task(tmp_path, seed=5, train=256, dev=64)
    native = tmp_path / "native"
    converted = run_python(["tools/convert_checkpoint.py", "hf-to-native", "--input", str(tiny / "hf"),
                            "--output", str(native), "--tp", "1", "--pp", "1"])
    assert converted.returncode == 0, converted.stderr[-3000:]
    common = [f"task.train_file={files['train']}", f"task.dev_files=[{files['dev']}]", "train.epochs=2",
              "train.lr=1e-3", "task.max_seq_length=12", "train.keep_best=false", "train.global_batch_size=32",
              "train.micro_batch_size=8"]
    finetune("rte", common + [f"model.init_from={tiny / 'hf'}", f"train.output_dir={tmp_path / 'tp1'}"])
    finetune("rte", common + [f"model.init_from={native}", f"train.output_dir={tmp_path / 'tp2'}",
                              "parallel.tensor_parallel=2"], nprocs=2)
    tp1, tp2 = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("tp1", "tp2"))
    assert len(tp1["train_losses"]) == len(tp2["train_losses"]) == 16
    assert tp2["train_losses"] == pytest.approx(tp1["train_losses"], rel=1e-4)
    assert [h["metrics"]["accuracy"] for h in tp2["history"]] == [h["metrics"]["accuracy"] for h in tp1["history"]]


def test_eval_only_predicts_a_submission_and_bad_vocab_is_refused(tiny, tmp_path):
    files = repeat_task(tmp_path, seed=7, train=64, dev=32)
    test = write_tsv(tmp_path / "test.tsv", ["index", "sentence1", "sentence2"], [(0, "w1 w2", "w1 w2"), (1, "w3", "w4")])
    out = tmp_path / "out"
    finetune("rte", [f"model.init_from={tiny / 'hf'}", f"task.dev_files=[{files['dev']}]", f"task.test_files=[{test}]",
                     "train.eval_only=true", f"train.output_dir={out}", "task.max_seq_length=12"])
    lines = (out / "submission" / "RTE.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and [l.split("\t")[0] for l in lines[1:]] == ["0", "1"]
    assert all(l.split("\t")[1] in ("entailment", "not_entailment") for l in lines[1:])

    big_vocab = tmp_path / "vocab.txt"
    big_vocab.write_text("\n".join(SPECIALS + [f"t{i}" for i in range(100)]) + "\n")
    done = finetune("rte", [f"model.init_from={tiny / 'hf'}", f"task.dev_files=[{files['dev']}]", "train.eval_only=true",
                            f"model.vocab_file={big_vocab}", f"train.output_dir={tmp_path / 'bad_vocab'}"],
                    expect_success=False)
    assert done.returncode == 1
    assert "has 105 tokens, the checkpoint's vocabulary 32: they do not belong together" in done.stderr
    done = finetune("rte", ["model.init_from=/nonexistent", "train.epochs=0"], expect_success=False)
    assert done.returncode == 2
    assert "model.init_from /nonexistent does not exist" in done.stderr and "task.data_dir" in done.stderr


def test_a_headerless_glue_directory_stops_the_run_in_one_line(tiny, tmp_path):
    """The GLUE MRPC files without their header line: the run lost the first example of each
    (exit 0); it now stops before training, naming the file, exit 1, no traceback."""
    rows = ["1\t702876\t702977\tw1 w2 w3\tw1 w2 w3", "0\t2108705\t2108831\tw4 w5\tw6 w7",
            "1\t1330381\t1330521\tw8\tw8"]
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    done = finetune("mrpc", [f"model.init_from={tiny / 'hf'}", f"task.data_dir={tmp_path}",
                             f"train.output_dir={tmp_path / 'out'}"], expect_success=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'train.tsv'}:1: this row is data (label '1') where the mrpc train/dev layout has its "
        "header line (GLUE's: Quality, #1 ID, #2 ID, #1 String, #2 String); add a header line, or give the rows as "
        ".csv/.jsonl or a .tsv whose header names its columns (docs/finetuning.md)")


def test_multiple_choice_learns_and_predicts(tiny, tmp_path):
    """SWAG layout; the right ending comes from the context's word family (w0-w5 or w6-w11),
    the three others from the other family: the choice needs context and ending together."""
    from transformers import AutoTokenizer, BertForMultipleChoice

    rng = random.Random(4)
    families = [WORDS[:6], WORDS[6:]]
    header = ["video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1", "ending2",
              "ending3", "label"]
    for split, n in (("train", 800), ("val", 100), ("test", 5)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header if split != "test" else header[:-1])
            for i in range(n):
                family = rng.randrange(2)
                context = [rng.choice(families[family]) for _ in range(4)]
                label = rng.randrange(4)
                endings = [rng.choice(families[1 - family]) for _ in range(3)]
                endings.insert(label, rng.choice(families[family]))
                writer.writerow([f"v{i}", 1000 + i, "", " ".join(context), "", "gold", *endings]
                                + ([label] if split != "test" else []))
    out = tmp_path / "out"
    finetune("swag", [f"model.init_from={tiny / 'hf'}", f"task.data_dir={tmp_path}", f"train.output_dir={out}",
                      "train.epochs=6", "train.lr=1e-3", "task.max_seq_length=8"])
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["best"]["metrics"]["accuracy"] >= 0.9  # chance: 0.25
    lines = (out / "submission" / "SWAG.csv").read_text().splitlines()
    assert lines[0] == "index,pred" and [l.split(",")[0] for l in lines[1:]] == ["1000", "1001", "1002", "1003", "1004"]

    model = BertForMultipleChoice.from_pretrained(out / "best", attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "best")
    rows = list(csv.DictReader(open(tmp_path / "val.csv")))
    firsts = [r["sent1"] for r in rows for _ in range(4)]
    seconds = [r[f"ending{i}"] for r in rows for i in range(4)]
    batch = tokenizer(firsts, seconds, padding="max_length", max_length=8, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hf = model(**{k: v.view(len(rows), 4, -1) for k, v in batch.items()}).logits.argmax(-1).tolist()
    ours = [int(line.split("\t")[1]) for line in (out / "predictions" / "val.tsv").read_text().splitlines()[1:]]
    assert hf == ours

    (tmp_path / "bad").mkdir()
    with open(tmp_path / "bad" / "val.csv", "w") as f:
        f.write("sent1,sent2,ending0,ending1,ending2,label\na,b,c,d,e,0\n")
    done = finetune("swag", [f"model.init_from={tiny / 'hf'}", f"task.dev_files=[{tmp_path / 'bad' / 'val.csv'}]",
                             "train.eval_only=true", f"train.output_dir={tmp_path / 'bad_out'}"], expect_success=False)
    assert done.returncode == 1 and "val.csv: missing column(s) ending3" in done.stderr


def test_feature_extraction_gives_hugging_face_hidden_states(tiny, tmp_path):
    from transformers import AutoTokenizer, BertModel

    lines = tmp_path / "lines.txt"
    lines.write_text("w1 w2 w3\nw4 w5 ||| w6 w7 w8\n")
    out = tmp_path / "features.jsonl"
    done = run_python(["tools/extract_features.py", "--checkpoint", str(tiny / "hf"), "--input-file", str(lines),
                       "--output-file", str(out), "--layers=-1,-2,0", "--max-seq-length", "16"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["linex_index"] for r in records] == [0, 1]
    assert [f["token"] for f in records[1]["features"]] == ["[CLS]", "w4", "w5", "[SEP]", "w6", "w7", "w8", "[SEP]"]

    model = BertModel.from_pretrained(tiny / "hf", attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny / "hf")
    with torch.no_grad():
        ref = model(**tokenizer("w4 w5", "w6 w7 w8", return_tensors="pt"), output_hidden_states=True).hidden_states
    for position, feature in enumerate(records[1]["features"]):
        for layer in feature["layers"]:
            expected = ref[layer["index"]][0, position]
            assert torch.tensor(layer["values"]) == pytest.approx(expected, abs=2e-5), (position, layer["index"])

    bad = tmp_path / "bad.txt"
    bad.write_text("w1\n\nw2\n")
    done = run_python(["tools/extract_features.py", "--checkpoint", str(tiny / "hf"), "--input-file", str(bad),
                       "--output-file", str(tmp_path / "x.jsonl"), "--layers=-1"], timeout=300)
    assert done.returncode == 1 and "bad.txt:2: empty line" in done.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_mnli_matched_mismatched_and_the_diagnostic_set(tiny, tmp_path):
    """MNLI's standard directory: both dev sets scored, both test sets and AX predicted (eval only)."""
    header = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2"]
    rng = random.Random(9)
    labels = ["entailment", "neutral", "contradiction"]

    def rows(n, labelled):
        return [[i, 0, 0, "g", "()", "()", "()", "()", "w1 w2", "w3"] + ([rng.choice(labels)] * 5 + [rng.choice(labels)]
                                                                       if labelled else []) for i in range(n)]
    dev_header = header + ["label1", "label2", "label3", "label4", "label5", "gold_label"]
    for name in ("dev_matched", "dev_mismatched"):
        write_tsv(tmp_path / f"{name}.tsv", dev_header, rows(12, True))
    for name in ("test_matched", "test_mismatched"):
        write_tsv(tmp_path / f"{name}.tsv", header, rows(7, False))
    write_tsv(tmp_path / "diagnostic.tsv", ["index", "sentence1", "sentence2"], [(i, "w1", "w2") for i in range(5)])
    out = tmp_path / "out"
    finetune("mnli", [f"model.init_from={tiny / 'hf'}", f"task.data_dir={tmp_path}", "train.eval_only=true",
                      f"train.output_dir={out}", "task.max_seq_length=12"])
    metrics = json.loads((out / "metrics.json").read_text())["best"]["metrics"]
    assert set(metrics) == {"dev_matched/accuracy", "dev_mismatched/accuracy"}
    submission = {f: (out / "submission" / f).read_text().splitlines() for f in ("MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv")}
    assert [len(lines) for lines in submission.values()] == [8, 8, 6]
    assert all(line.split("\t")[1] in labels for lines in submission.values() for line in lines[1:])
