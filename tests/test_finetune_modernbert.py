"""Fine-tuning from ModernBERT checkpoints (issue 40, part 5): a tiny transformers
ModernBertForMaskedLM with a byte-level BPE tokenizer.json is fine-tuned a few steps on each task
kind (GLUE pairs with cls and with mean pooling, SWAG, SQuAD 2.0, CoNLL NER) at TP1 from the
transformers directory and at TP2 from a native TP2 conversion; each best/ export is the
ModernBertFor* class transformers loads with no missing or unexpected key and that gives our
evaluation's logits and predictions. The task head starts as transformers starts it from a
ModernBertForMaskedLM (its `head` from the MLM head's transform, its `classifier` fresh)."""
import csv
import json
import random

import numpy as np
import pytest
import torch

from distributed import run_python, run_ranks
from test_finetune_ner import synthetic_files
from test_finetune_squad import marker_task
from test_finetune_tasks import QUIET, WORDS, repeat_task
from test_modernbert import SHAPES, hf_config, randomise

pytestmark = pytest.mark.slow  # multi-process and end to end: not in the fast tier

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0-4, as hf_config's pad/cls/sep ids say
VOCAB = 384  # the byte alphabet, the specials and merges enough for the synthetic tasks' words
CLASSES = {"rte": "ModernBertForSequenceClassification", "rte-mean": "ModernBertForSequenceClassification",
           "swag": "ModernBertForMultipleChoice", "squad2": "ModernBertForQuestionAnswering",
           "conll2003": "ModernBertForTokenClassification"}


def bpe_tokenizer_json(path, corpus) -> None:
    """A byte-level BPE tokenizer.json (ModernBERT's kind) with [PAD] [UNK] [CLS] [SEP] [MASK]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    tokenizer.save(str(path))


def tiny_modernbert(path, shape_name: str, corpus) -> None:
    """A random transformers ModernBertForMaskedLM (test_modernbert's shapes) and its tokenizer."""
    from transformers import ModernBertForMaskedLM

    config = hf_config(SHAPES[shape_name])
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(config).eval()
    randomise(model)
    model.save_pretrained(path)
    bpe_tokenizer_json(path / "tokenizer.json", corpus)


def swag_files(root, n_train=48, n_dev=16):
    rng = random.Random(4)
    families = [WORDS[:6], WORDS[6:]]
    header = ["video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1", "ending2",
              "ending3", "label"]
    for split, n in (("train", n_train), ("val", n_dev)):
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for i in range(n):
                family = rng.randrange(2)
                label = rng.randrange(4)
                endings = [" ".join(rng.choice(families[1 - family]) for _ in range(rng.randint(1, 3)))
                           for _ in range(3)]
                endings.insert(label, rng.choice(families[family]))
                writer.writerow([f"v{i}", 1000 + i, "", " ".join(rng.choice(families[family])
                                                                  for _ in range(rng.randint(2, 5))),
                                 "", "gold", *endings, label])
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every task fine-tuned one short epoch at TP1 (from the transformers directories) and at TP2
    (from native TP2 conversions), with the worker's records."""
    root = tmp_path_factory.mktemp("modern-finetune")
    data = {"rte": repeat_task(root, seed=2, train=48, dev=24)}
    data["squad2_train"] = marker_task(root / "squad_train.json", 40, "2.0", seed=1)
    data["squad2_dev"] = marker_task(root / "squad_dev.json", 12, "2.0", seed=2)
    (root / "ner").mkdir()
    data["ner"] = synthetic_files(root / "ner", seed=0, train_docs=6, dev_docs=3)
    swag = swag_files(root)
    corpus = ([path.read_text() for path in (data["rte"]["train"], data["ner"]["train"], swag / "train.csv")]
              + [open(data["squad2_train"]).read()]) * 4
    models = {}
    for shape in ("every2-window8", "every3-window16-biases"):
        models[shape] = root / f"hf-{shape}"
        tiny_modernbert(models[shape], shape, corpus)

    def runs_from(model, biases_model, out):
        common = [*QUIET, "train.epochs=1", "train.lr=1e-3", "train.global_batch_size=8", "train.micro_batch_size=4",
                  "train.eval_batch_size=5", "train.overwrite_output_dir=true"]
        rte = [f"task.train_file={data['rte']['train']}", f"task.dev_files=[{data['rte']['dev']}]",
               "task.max_seq_length=24"]
        return [
            {"name": "rte", "task": "rte", "overrides": [*common, *rte, f"model.init_from={model}",
                                                         f"train.output_dir={out / 'rte'}"]},
            {"name": "rte-mean", "task": "rte", "overrides": [*common, *rte, f"model.init_from={biases_model}",
                                                              "model.classifier_pooling=mean",
                                                              f"train.output_dir={out / 'rte-mean'}"]},
            {"name": "swag", "task": "swag", "overrides": [*common, f"task.data_dir={swag}", "task.max_seq_length=16",
                                                           f"model.init_from={model}", f"train.output_dir={out / 'swag'}"]},
            {"name": "squad2", "task": "squad2", "overrides": [
                *common, f"task.train_file={data['squad2_train']}", f"task.dev_files=[{data['squad2_dev']}]",
                "task.max_seq_length=32", "task.max_query_length=8", "task.doc_stride=8", f"model.init_from={model}",
                f"train.output_dir={out / 'squad2'}"]},
            {"name": "conll2003", "task": "conll2003", "overrides": [
                *common, f"task.train_file={data['ner']['train']}", f"task.dev_files=[{data['ner']['dev']}]",
                "task.max_seq_length=32", "task.doc_stride=8", f"model.init_from={model}",
                f"train.output_dir={out / 'conll2003'}"]},
        ]

    # and our runner takes two exports back, eval only: their task heads and rte-mean's pooling
    again = [{"name": f"{run['name']}-again", "task": run["task"], "overrides": [
        *[o for o in run["overrides"] if not o.startswith(("model.", "train.output_dir=", "task.train_file="))],
        "train.eval_only=true", f"model.init_from={root / 'tp1' / run['name'] / 'best'}",
        f"train.output_dir={root / 'tp1' / (run['name'] + '-again')}"]}
        for run in runs_from(models["every2-window8"], models["every3-window16-biases"], root / "tp1")
        if run["name"] in ("rte-mean", "squad2")]
    results = {}
    out = root / "tp1.json"
    run_ranks(["tests/_finetune_modern_worker.py", str(out), "1",
               *map(json.dumps, runs_from(models["every2-window8"], models["every3-window16-biases"], root / "tp1")
                    + again)], 1, timeout=900)
    results[1] = json.loads(out.read_text())
    native = {}
    for shape, model in models.items():
        native[shape] = root / f"native-tp2-{shape}"
        done = run_python(["tools/convert_checkpoint.py", "hf-to-native", "--input", str(model),
                           "--output", str(native[shape]), "--tp", "2", "--pp", "1"], timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = root / "tp2.json"
    run_ranks(["tests/_finetune_modern_worker.py", str(out), "2",
               *map(json.dumps, runs_from(native["every2-window8"], native["every3-window16-biases"], root / "tp2"))],
              2, timeout=900)
    results[2] = json.loads(out.read_text())
    return {"root": root, "results": results, "models": models, "data": data}


def export_dir(runs, tp, name):
    return runs["root"] / f"tp{tp}" / name / "best"


def transformers_logits(directory, name, dev):
    """The export's logits on our dev inputs, as our evaluation lays them out."""
    import transformers

    model, info = getattr(transformers, CLASSES[name]).from_pretrained(directory, output_loading_info=True,
                                                                       attn_implementation="eager")
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    return transformers_logits_of(model.eval(), name, dev)


def transformers_logits_of(model, name, dev):
    """A transformers task model's logits on our dev inputs ([N, seq, 2] start/end for SQuAD)."""
    inputs = {"input_ids": torch.tensor(dev["input_ids"]), "attention_mask": torch.tensor(dev["attention_mask"])}
    with torch.no_grad():
        out = model(**inputs)
    if name == "squad2":
        return torch.stack([out.start_logits, out.end_logits], dim=-1).numpy(), model
    return out.logits.numpy(), model


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CLASSES))
def test_export_loads_in_transformers_and_gives_our_logits(runs, tp, name):
    record = runs["results"][tp][name]
    assert record["tp"] == tp and record["architecture"] == CLASSES[name]
    assert record["local_qkv_rows"][0] == 3 * 64 // tp  # the heads really are split over TP
    directory = export_dir(runs, tp, name)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [CLASSES[name]] and config["model_type"] == "modernbert"
    assert config["classifier_pooling"] == ("mean" if name == "rte-mean" else "cls")
    hf, model = transformers_logits(directory, name, record["dev"])
    ours = np.array(record["logits"])
    if ours.ndim == 3:  # token-level: the real positions (ours are zeros at padding)
        real = np.arange(ours.shape[1])[None, :] < np.array(record["dev"]["lengths"])[:, None]
        hf, ours = hf[real], ours[real]
    assert np.abs(ours).max() > 0.1  # not trivially small
    np.testing.assert_allclose(hf, ours, atol=2e-5, rtol=1e-5, err_msg=f"{name} at TP{tp}")
    # the names are transformers' (the head transform under `head.`, no tanh pooler, no MLM head)
    names = set(model.state_dict())
    assert {"head.dense.weight", "head.norm.weight", "classifier.weight", "classifier.bias"} <= names
    assert not any(n.startswith(("decoder.", "model.head")) for n in names)


@pytest.mark.parametrize("name", ["rte", "swag", "squad2", "conll2003"])
def test_transformers_predictions_equal_our_prediction_files(runs, name):
    """What transformers' logits predict, through our post-processing, is what we wrote."""
    from finetune.config import TaskSection
    from finetune.tasks import TASKS

    record = runs["results"][1][name]
    out = runs["root"] / "tp1" / name
    hf, _ = transformers_logits(out / "best", name, record["dev"])
    predictions = out / "predictions"
    if name in ("rte", "swag"):
        written = [line.split("\t")[1] for line in (predictions / f"{record['dev']['name']}.tsv").read_text()
                   .splitlines()[1:]]
        labels = ["entailment", "not_entailment"] if name == "rte" else ["0", "1", "2", "3"]
        assert [labels[i] for i in hf.argmax(-1)] == written
        return
    task = TASKS[name]
    if name == "squad2":
        section = TaskSection(name=name, max_seq_length=32, max_query_length=8, doc_stride=8)
        read = task.read(runs["data"]["squad2_dev"], "dev", section)
    else:
        section = TaskSection(name=name, max_seq_length=32, doc_stride=8)
        read = task.read(str(runs["data"]["ner"]["dev"]), "dev", section)
    from pretrain.data.preprocess.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_json=str(out / "best" / "tokenizer.json"))
    features = task.encode(tokenizer.tokenizer, read.examples, section, False, tokenizer.specials)
    assert features.input_ids.tolist() == record["dev"]["input_ids"]  # the export's tokenizer cuts as ours did
    from finetune.tasks.base import Dataset

    evaluation = task.evaluate(Dataset(record["dev"]["name"], read.examples, features, read.reference), hf, section)
    for path, content in evaluation.files.items():
        if path.endswith("predictions.json") and "nbest" not in path:
            assert json.loads(content) == json.loads((predictions / path).read_text())
        elif path.endswith(".txt"):
            assert content == (predictions / path).read_text()
    assert evaluation.metrics == pytest.approx(record["summary"]["best"]["metrics"])


def test_tp2_fine_tunes_as_tp1(runs):
    """The same runs at TP2 from native TP2 checkpoints give TP1's losses and metrics."""
    for name in CLASSES:
        one, two = runs["results"][1][name]["summary"], runs["results"][2][name]["summary"]
        assert len(one["train_losses"]) == len(two["train_losses"]) >= 3, name
        assert two["train_losses"] == pytest.approx(one["train_losses"], rel=1e-4), name
        assert two["history"][0]["metrics"] == pytest.approx(one["history"][0]["metrics"], rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("name, shape", [("rte", "every2-window8"), ("rte-mean", "every3-window16-biases"),
                                         ("squad2", "every2-window8")])
def test_the_head_starts_as_transformers_starts_it_from_a_masked_lm(runs, name, shape):
    """transformers loading the ModernBertForMaskedLM into the task class takes `head` from the MLM
    head; with our fresh classifier in place it gives our logits before any training step."""
    import transformers

    record = runs["results"][1][name]
    model = getattr(transformers, CLASSES[name]).from_pretrained(
        runs["models"][shape], attn_implementation="eager", classifier_pooling=record["pooling"],
        **({} if name == "squad2" else {"num_labels": 2})).eval()
    head = {k: torch.tensor(v) for k, v in record["head_before"].items()}
    mlm = transformers.ModernBertForMaskedLM.from_pretrained(runs["models"][shape]).state_dict()
    for key in head:
        if key.startswith("head."):
            assert torch.equal(head[key], mlm[key]), key  # the MLM head's transform, as it is
    classifier = head["classifier.weight"]
    std = 64 ** -0.5  # hidden_size ** -0.5, cut at 2 standard deviations (transformers' "final_out")
    assert classifier.abs().max() <= 2 * std and 0.5 * std < classifier.std() < 1.5 * std
    assert not head["classifier.bias"].any()
    model.classifier.load_state_dict({"weight": classifier, "bias": head["classifier.bias"]})
    hf, _ = transformers_logits_of(model, name, record["dev"])
    ours = np.array(record["logits_before"])
    if ours.ndim == 3:
        real = np.arange(ours.shape[1])[None, :] < np.array(record["dev"]["lengths"])[:, None]
        hf, ours = hf[real], ours[real]
    np.testing.assert_allclose(hf, ours, atol=2e-5, rtol=1e-5)


def test_the_export_predicts_alone_in_a_fresh_process(runs):
    """AutoTokenizer + AutoModelForSequenceClassification on the export directory, in a process of
    their own, tokenise the dev pairs as we did and predict our labels."""
    record = runs["results"][1]["rte"]
    directory = export_dir(runs, 1, "rte")
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        "directory, tsv = sys.argv[1], sys.argv[2]\n"
        "rows = [line.split('\\t') for line in open(tsv).read().splitlines()[1:]]\n"
        "tokenizer = AutoTokenizer.from_pretrained(directory)\n"
        "model = AutoModelForSequenceClassification.from_pretrained(directory).eval()\n"
        "batch = tokenizer([r[1] for r in rows], [r[2] for r in rows], padding='max_length', max_length=24,\n"
        "                  truncation=True, return_tensors='pt')\n"
        "with torch.no_grad():\n"
        "    logits = model(input_ids=batch['input_ids'], attention_mask=batch['attention_mask']).logits\n"
        "print(json.dumps({'class': type(model).__name__, 'input_ids': batch['input_ids'].tolist(),\n"
        "                  'labels': [model.config.id2label[i] for i in logits.argmax(-1).tolist()]}))\n")
    done = run_python(["-c", script, str(directory), str(runs["data"]["rte"]["dev"])], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["class"] == "ModernBertForSequenceClassification"
    assert result["input_ids"] == record["dev"]["input_ids"]
    written = [line.split("\t")[1] for line in (runs["root"] / "tp1" / "rte" / "predictions" / "repeat_dev.tsv")
               .read_text().splitlines()[1:]]
    assert result["labels"] == written


@pytest.mark.parametrize("name", ["rte-mean", "squad2"])
def test_our_runner_takes_its_export_back(runs, name):
    """Fine-tuning from a ModernBertFor* export (eval only) takes its whole task head, and its
    pooling from its config.json: the logits it ended with."""
    exported, again = runs["results"][1][name], runs["results"][1][f"{name}-again"]
    assert again["pooling"] == exported["pooling"]
    assert set(again["head_before"]) == set(exported["head_before"])
    np.testing.assert_allclose(np.array(again["logits_before"]), np.array(exported["logits"]), atol=1e-6)


def test_special_tokens_are_the_tokenizers_own(tmp_path):
    """A RoBERTa-style BPE (<s> <pad> </s> <unk> <mask>, no post-processor, no [CLS] anywhere):
    every task kind's rows start with its cls, end their segments with its sep and pad with its pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from finetune.inputs import TextFeatures
    from finetune.tasks.ner import build_tagging_features
    from finetune.tasks.squad import SquadExample, build_features
    from finetune.tasks.tagging import Document, Sentence

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, pad, sep = 0, 1, 2
    pair = TextFeatures(tokenizer, [("w1", "w2 w3")], None, 12)
    ids = pair.input_ids[0].tolist()
    length = int(pair.attention_mask.sum())
    assert ids[0] == cls and ids[length - 1] == sep and ids.count(sep) == 2 and ids[length:] == [pad] * (12 - length)
    windows = build_features(tokenizer, [SquadExample("q", "w1", "w2 w3", [], True)], 12, 4, 4, False)
    ids = windows.input_ids[0].tolist()
    assert ids[0] == cls and ids.count(sep) == 2 and ids[-1] == pad
    tagged = build_tagging_features(tokenizer, [Document([Sentence(["w1", "w2"], None, [1, 1])])], ("O",), 8, 4)
    assert tagged.input_ids[0].tolist()[:1] == [cls] and tagged.input_ids[0].tolist()[-3:] == [sep, pad, pad]


def test_classifier_pooling_is_refused_for_a_bert_checkpoint(tmp_path):
    from test_finetune_tasks import tiny_bert

    bert = tiny_bert(tmp_path)
    files = repeat_task(tmp_path, train=8, dev=8)
    done = run_python(["-m", "finetune", "rte", *QUIET, f"model.init_from={bert}", f"task.train_file={files['train']}",
                       f"task.dev_files=[{files['dev']}]", "model.classifier_pooling=mean",
                       f"train.output_dir={tmp_path / 'out'}"], timeout=300)
    assert done.returncode == 1 and "model.classifier_pooling is ModernBERT's" in done.stderr, done.stderr[-2000:]
