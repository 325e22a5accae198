"""`python -m finetune sweep` end to end (finetune/sweep/: runner and worker; the protocol's pieces on
their own: tests/test_sweep_protocol.py). The tiny BERT on two small tasks (RTE's layout: does
sentence 2 repeat sentence 1; SST-2's: does the sentence hold w0), a 2 x 2 grid with 2 restarts:
- it completes, the selection is the dev maximum of the trials' own metrics files, the table and
  the GLUE bundle (GLUE's file names and header) are written, every trial is in TensorBoard's
  HParams view, and each task file is tokenized once (the other trials load it: their log says so);
- two trials at once (two slots, each its own worker process) give the table of one after another;
- SIGTERM, then SIGKILL, of a running sweep: relaunched, the finished trials are not run again (their
  files unchanged) and the table equals the uninterrupted sweep's;
- a grid point with a bad value fails with its one-line error; the others complete;
- a slot of 2 ranks; its worker killed: the trial is recorded as failed, and --retry-failed runs it again;
- SQuAD 2.0 and SWAG: selected by F1 and accuracy, their prediction and submission files copied.
"""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distributed import REPO, run_python
from test_finetune_tasks import WORDS, repeat_task, tiny_bert, write_tsv

pytestmark = pytest.mark.slow  # worker processes and real fine-tuning


def word_task(root, seed=5, train=160, dev=40, test=12):
    """SST-2 layout: label 1 iff the sentence holds w0."""
    rng = random.Random(seed)
    files = {}
    for split, n in (("train", train), ("dev", dev)):
        rows = []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(4)]
            rows.append((" ".join(words), int("w0" in words)))
        files[split] = write_tsv(root / f"word_{split}.tsv", ["sentence", "label"], rows)
    rows = [(i, " ".join(rng.choice(WORDS) for _ in range(4))) for i in range(test)]
    files["test"] = write_tsv(root / "word_test.tsv", ["index", "sentence"], rows)
    return files


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-data")
    hf = tiny_bert(root)
    rte = repeat_task(root, train=160, dev=40)
    rng = random.Random(9)
    rows = [(i, " ".join(rng.choice(WORDS) for _ in range(4)), " ".join(rng.choice(WORDS) for _ in range(4)))
            for i in range(12)]
    rte["test"] = write_tsv(root / "repeat_test.tsv", ["index", "sentence1", "sentence2"], rows)
    return {"root": root, "hf": hf, "rte": rte, "sst2": word_task(root)}


def spec(data, out, grid=None, tasks=("rte", "sst2"), restarts=2, **extra):
    """The sweep's YAML (written beside its output directory) and its path."""
    files = {task: data[task] for task in tasks}
    doc = {"sweep": {
        "tasks": list(tasks), "restarts": restarts, "output_dir": str(out),
        "grid": grid or {"train.lr": [1e-3, 3e-4], "train.epochs": [1, 2]},
        "overrides": [f"model.init_from={data['hf']}", "task.max_seq_length=12", "model.hidden_dropout=0",
                      "model.attention_dropout=0", "train.global_batch_size=16", "train.micro_batch_size=8"],
        "task_overrides": {task: [f"task.train_file={f['train']}", f"task.dev_files=[{f['dev']}]",
                                  f"task.test_files=[{f['test']}]"] for task, f in files.items()},
        **extra}}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(json.dumps(doc))
    return path


def sweep(config, *overrides, wait=True):
    """The sweep command. Run to its end (wait): the runner and its workers forked from the session's
    zygote. Left running (not wait), for a test that kills the runner's process group or a worker by
    pid: fresh processes, in a session of their own."""
    command = ["-m", "finetune", "sweep", "--config", str(config), *overrides]
    if not wait:
        return subprocess.Popen([sys.executable, *command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    return run_python(command, timeout=600, children_too=True)


def trial_dirs(out):
    """The finished trials' directories, looked up while the sweep runs: a directory it renames
    while the walk is in it (a trial's best.new becoming best) is looked up again."""
    while True:
        try:
            return sorted(p.parent for p in out.rglob("trial.json"))
        except FileNotFoundError:
            continue


def table_numbers(out) -> dict:
    """What the results say of each task: the selected trial, its score, mean and std, counts."""
    return json.loads((out / "results.json").read_text())


def files_of(directory) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "sweep"
    done = sweep(spec(data, out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done


def test_the_grid_completes_and_selects_the_dev_maximum(straight):
    out, done = straight
    dirs = trial_dirs(out)
    assert len(dirs) == 16 and "16 of 16 trials finished" in done.stdout
    results = json.loads((out / "results.json").read_text())
    for task, metric in (("rte", "accuracy"), ("sst2", "accuracy")):
        mine = [d for d in dirs if d.relative_to(out).parts[0] == task]
        scores = {str(d.relative_to(out)): json.loads((d / "metrics.json").read_text())["best"]["metrics"][metric]
                  for d in mine}
        records = [json.loads((d / "trial.json").read_text()) for d in mine]
        assert {r["status"] for r in records} == {"done"} and {r["seed"] for r in records} == {42, 43}
        best = max(scores.values())
        first_best = next(k for k in sorted(scores, key=lambda k: _expand_order(k)) if scores[k] == best)
        selected = next(t for t in results["tasks"] if t["task"] == task)
        assert selected["selected"] == first_best, (selected, scores)
        assert selected["score"] == pytest.approx(best) and selected["done"] == 8 and selected["failed"] == 0
    assert (out / "results.md").read_text().startswith("## GLUE")
    assert (out / "results.csv").exists()
    # the GLUE bundle: the selected runs' test predictions under GLUE's names
    with zipfile.ZipFile(out / "glue_submission.zip") as bundle:
        assert sorted(bundle.namelist()) == ["RTE.tsv", "SST-2.tsv"]
        for name in bundle.namelist():
            lines = bundle.read(name).decode().splitlines()
            assert lines[0] == "index\tprediction" and len(lines) == 13, (name, lines[:3])
        assert set(line.split("\t")[1] for line in bundle.read("RTE.tsv").decode().splitlines()[1:]) <= \
            {"entailment", "not_entailment"}


def _expand_order(trial_id: str):
    """A trial directory's place in the sweep's order: task, lr (grid order 1e-3 first), epochs, restart."""
    task, point, restart = trial_id.split("/")
    lr, epochs = (part.split("-", 1)[1] for part in point.split("_"))
    return (task != "rte", lr != "0.001", int(epochs), int(restart.split("-")[1]))


def test_each_task_file_is_tokenized_once_and_every_trial_is_in_the_hparams_view(straight):
    out, _ = straight
    for task in ("rte", "sst2"):
        logs = {d: (d / "trial.log").read_text() for d in trial_dirs(out) if d.relative_to(out).parts[0] == task}
        tokenized = [d for d, log in logs.items() if "tokenized, cached in" in log]
        assert len(tokenized) == 1, tokenized  # the first trial of the task; the other 7 load it
        assert sum("tokenized inputs from the cache" in log for log in logs.values()) == 7
    for d in trial_dirs(out):
        events = EventAccumulator(str(out / "tensorboard" / d.relative_to(out) / "hparams"))
        events.Reload()
        assert "hparam/dev_score" in events.Tags()["scalars"], d
        assert events.PluginTagToContent("hparams"), d  # the HParams plugin's session summary


def test_two_trials_at_once_give_the_table_of_one_after_another(data, straight, tmp_path):
    out = tmp_path / "sweep"
    done = sweep(spec(data, out, parallel_trials=2))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert table_numbers(out) == table_numbers(straight[0])
    spans, everything = [], []
    for slot in (0, 1):
        log = (out / "logs" / f"slot-{slot}.log").read_text()
        ran = [line.split("trial ")[1].split(":")[0] for line in log.splitlines()
               if line.startswith("trial ") and line.endswith(": done")]
        # how the queue shares the trials is the machine's business; that both slots took some is
        # what running two at once means
        assert ran, log[-2000:]
        everything += ran
        started = [time.mktime(time.strptime((out / t / "trial.log").read_text()[:19], "%Y-%m-%d %H:%M:%S"))
                   for t in ran]  # the trial log's first line: "trial ...: starting"
        ended = [os.path.getmtime(out / t / "trial.json") for t in ran]
        spans.append((min(started), max(ended)))
    assert sorted(everything) == sorted(str(d.relative_to(out)) for d in trial_dirs(out)), everything  # each once
    (a0, a1), (b0, b1) = spans
    assert a0 < b1 and b0 < a1, spans  # the two slots ran side by side


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_killed_sweep_relaunched_reruns_only_unfinished_trials(data, straight, tmp_path, how):
    out = tmp_path / "sweep"
    config = spec(data, out)
    running = sweep(config, wait=False)
    deadline = time.monotonic() + 300
    while len(trial_dirs(out)) < 3 and time.monotonic() < deadline and running.poll() is None:
        time.sleep(0.1)
    assert running.poll() is None, running.communicate()
    if how == signal.SIGKILL:
        os.killpg(running.pid, signal.SIGKILL)  # the runner; its workers end with it (PR_SET_PDEATHSIG)
    else:
        running.send_signal(signal.SIGTERM)
    stdout, stderr = running.communicate(timeout=120)
    if how == signal.SIGTERM:
        assert running.returncode == 143, stderr
        assert "sweep: stopped by SIGTERM" in stderr and "run the same command again" in stderr
    time.sleep(1)  # a worker ending with the runner has stopped writing
    finished = {d: files_of(d) for d in trial_dirs(out)}
    assert 3 <= len(finished) < 16
    done = sweep(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"({len(finished)} finished before)" in done.stderr + done.stdout
    for d, before in finished.items():
        assert files_of(d) == before, d  # not run again
    assert len(trial_dirs(out)) == 16
    assert table_numbers(out) == table_numbers(straight[0])


def test_a_trial_on_two_ranks_and_a_worker_that_dies(data, tmp_path):
    """A slot of 2 ranks (torch.distributed.run, data parallel) runs its trials; its worker killed
    during a trial: that trial is recorded as failed naming the slot's log, a new worker runs the rest,
    and each worker read model.init_from once."""
    import psutil

    out = tmp_path / "sweep"
    running = sweep(spec(data, out, grid={"train.lr": [1e-3, 3e-4]}, tasks=("rte",), restarts=2, ranks_per_trial=2),
                    wait=False)
    deadline = time.monotonic() + 300
    while len(trial_dirs(out)) < 1 and time.monotonic() < deadline and running.poll() is None:
        time.sleep(0.1)
    workers = [p for p in psutil.Process(running.pid).children(recursive=True)
               if "finetune.sweep.worker" in " ".join(p.cmdline()) and "torch.distributed.run" not in " ".join(p.cmdline())]
    assert len(workers) == 2, [p.cmdline() for p in workers]  # the slot's two ranks
    workers[1].kill()
    stdout, stderr = running.communicate(timeout=300)
    assert running.returncode == 0, stdout[-3000:] + stderr[-3000:]
    records = {str(d.relative_to(out)): json.loads((d / "trial.json").read_text()) for d in trial_dirs(out)}
    assert len(records) == 4
    failed = [r for r in records.values() if r["status"] == "failed"]
    assert len(failed) == 1 and "the worker of slot 0 exited with status" in failed[0]["error"], records
    assert "slot-0.log" in failed[0]["error"]
    done = [t for t, r in records.items() if r["status"] == "done"]
    assert len(done) == 3
    for trial in done:
        assert "TP1 x PP1 x DP2" in (out / trial / "trial.log").read_text()
    # the first worker's first trial, and the new worker's (the killed trial may have died before its
    # log began: the kill comes after the first trial's record, during the next trial or just before it)
    reads = sum("kept for this worker's other trials" in (out / t / "trial.log").read_text() for t in done)
    assert reads == 2

    # --retry-failed runs the killed trial again, and only it
    killed = next(t for t, r in records.items() if r["status"] == "failed")
    before = {t: files_of(out / t) for t in done}
    again = sweep(spec(data, out, grid={"train.lr": [1e-3, 3e-4]}, tasks=("rte",), restarts=2, ranks_per_trial=2),
                  "--retry-failed")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"--retry-failed: 1 failed trial(s) run again: {killed}" in again.stderr + again.stdout
    assert json.loads((out / killed / "trial.json").read_text())["status"] == "done"
    assert {t: files_of(out / t) for t in done} == before
    assert json.loads((out / "results.json").read_text())["tasks"][0]["failed"] == 0


def test_a_failed_trial_is_recorded_with_its_error_and_the_others_complete(data, tmp_path):
    out = tmp_path / "sweep"
    done = sweep(spec(data, out, grid={"train.warmup_ratio": [0.1, 1.5]}, tasks=("rte",), restarts=1))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = {str(d.relative_to(out)): json.loads((d / "trial.json").read_text()) for d in trial_dirs(out)}
    bad = records["rte/warmup_ratio-1.5/restart-0"]
    assert bad["status"] == "failed" and "train.warmup_ratio" in bad["error"] and "\n" not in bad["error"]
    assert records["rte/warmup_ratio-0.1/restart-0"]["status"] == "done"
    results = json.loads((out / "results.json").read_text())
    rte = next(t for t in results["tasks"] if t["task"] == "rte")
    assert rte["selected"] == "rte/warmup_ratio-0.1/restart-0" and rte["failed"] == 1
    assert rte["failed_trials"] == [{"id": "rte/warmup_ratio-1.5/restart-0", "error": bad["error"]}]
    assert "train.warmup_ratio" in (out / "results.md").read_text()


def test_squad_and_swag_in_a_sweep_select_by_their_metric_and_copy_the_predictions(data, tmp_path):
    """SQuAD 2.0 (F1) and SWAG (accuracy) through the sweep: each task's selected trial is the first
    maximum of its trials' own metrics, and its prediction and submission files are copied."""
    from test_finetune_modernbert import swag_files
    from test_finetune_squad import marker_task

    root = tmp_path / "data"
    (root / "swag").mkdir(parents=True)
    squad_train, squad_dev = marker_task(root / "train.json", 60, "2.0", seed=1), marker_task(root / "dev.json", 12, "2.0", seed=2)
    out = tmp_path / "sweep"
    config = tmp_path / "sweep.yaml"
    config.write_text(json.dumps({"sweep": {
        "tasks": ["squad2", "swag"], "output_dir": str(out), "grid": {"train.lr": [1e-3, 3e-4]},
        "overrides": [f"model.init_from={data['hf']}", "model.hidden_dropout=0", "model.attention_dropout=0",
                      "train.global_batch_size=16", "train.micro_batch_size=8", "train.epochs=1"],
        "task_overrides": {
            "squad2": [f"task.train_file={squad_train}", f"task.dev_files=[{squad_dev}]", f"task.test_files=[{squad_dev}]",
                       "task.max_seq_length=24", "task.max_query_length=8", "task.doc_stride=8"],
            "swag": [f"task.data_dir={swag_files(root / 'swag', n_train=32, n_dev=8)}", "task.max_seq_length=16"]}}}))
    done = sweep(config)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {t["task"]: t for t in json.loads((out / "results.json").read_text())["tasks"]}
    for task, metric in (("squad2", "f1"), ("swag", "accuracy")):
        trials = [f"{task}/lr-0.001/restart-0", f"{task}/lr-0.0003/restart-0"]
        scores = [json.loads((out / t / "metrics.json").read_text())["best"]["metrics"][metric] for t in trials]
        assert results[task]["selected"] == trials[scores.index(max(scores))], (task, scores, results[task])
    selected = out / results["squad2"]["selected"]
    copied = {str(p.relative_to(out / "squad2")) for p in (out / "squad2").rglob("*.json")
              if "restart-" not in str(p.relative_to(out / "squad2"))}
    assert {"predictions/dev/predictions.json", "predictions/dev/null_odds.json", "submission/SQuAD.json"} <= copied, copied
    for name in copied:
        assert (out / "squad2" / name).read_bytes() == (selected / name).read_bytes(), name
    swag_copied = {str(p.relative_to(out / "swag")) for p in (out / "swag").glob("predictions/*.tsv")}
    assert swag_copied == {"predictions/val.tsv"}, swag_copied
    assert "(n=1)" in (out / "results.md").read_text() and "±" not in (out / "results.md").read_text().split("restarts |")[1]
