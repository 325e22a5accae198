"""Fine-tuning never replaces a previous run's outputs (invariant 12): a run whose train.output_dir
holds what a fine-tuning run writes there (metrics.json, best/, predictions/, submission/,
tensorboard/) is refused before any rank starts, in one line naming the directory, what it found and
the ways out, exit 2, nothing in the directory touched; train.overwrite_output_dir=true lets it
replace them; the feature cache and the user's own files never count. On several nodes, which may
not share the directory, the logging rank (the one that writes there) decides for every rank."""
import hashlib
import json
import os

import pytest

from distributed import child_env, REPO, run_python, run_ranks

from finetune.config import load_finetune_config, output_dir_problems, previous_outputs

FOUND = "metrics.json, best/, predictions/, submission/, tensorboard/"


def config(tmp_path, out, *overrides):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for name in ("train.tsv", "dev.tsv"):
        (data / name).touch()
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    return [f"model.init_from={tmp_path / 'ckpt'}", f"task.train_file={data / 'train.tsv'}",
            f"task.dev_files=[{data / 'dev.tsv'}]", f"train.output_dir={out}", *overrides]


def cfg_of(tmp_path, out, *overrides):
    return load_finetune_config(None, ["task.name=rte", *config(tmp_path, out, *overrides)])


def previous_run(out):
    """What a finished fine-tuning run leaves (the names finetuner.py writes), beside the feature
    cache and a file of the user's."""
    files = {"metrics.json": '{"best": {}}', "best/config.json": "{}", "best/model.safetensors": "weights",
             "predictions/dev.tsv": "index\tprediction\n0\t1\n", "submission/RTE.tsv": "index\tprediction\n",
             "tensorboard/events.out.tfevents.1.host.1.0": "events", "feature_cache/train-0.safetensors": "cache",
             "notes.txt": "mine"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def fingerprint(directory):
    """Every file and directory under `directory` with its sha256 (None for a directory) and mtime."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            digest = None if name in dirs else hashlib.sha256(open(path, "rb").read()).hexdigest()
            found[os.path.relpath(path, directory)] = (digest, os.stat(path).st_mtime_ns)
    return found


def refusal(out, found=FOUND):
    return (f"train.output_dir {out} already holds a previous run's outputs ({found}), which this run would "
            "replace: give another train.output_dir, or set train.overwrite_output_dir=true to replace them")


def test_a_second_run_is_refused_in_one_line_before_it_starts_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    previous_run(out)
    before = fingerprint(out)
    done = run_python(["-m", "finetune", "rte", *config(tmp_path, out)], timeout=120,
                      env=child_env({key: None for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}))
    assert done.returncode == 2, done.stderr[-3000:]
    # the config report's heading, then the refusal: one line naming the directory, what it found, the ways out
    assert done.stderr.splitlines() == [f"invalid configuration ({REPO / 'configs/finetune/rte.yaml'} + command line):",
                                        refusal(out)]
    assert "feature_cache" not in done.stderr and "notes.txt" not in done.stderr
    assert fingerprint(out) == before


def test_overwrite_output_dir_lets_the_run_replace_them_and_says_so(tmp_path, monkeypatch):
    import finetune.output_dir
    import pretrain.distributed.device

    out = tmp_path / "out"
    previous_run(out)
    assert output_dir_problems(cfg_of(tmp_path, out)) == [refusal(out)]
    replacing = cfg_of(tmp_path, out, "train.overwrite_output_dir=true")
    assert replacing.train.overwrite_output_dir is True and output_dir_problems(replacing) == []
    warnings = []
    monkeypatch.setattr(finetune.output_dir.logger, "warning", warnings.append)
    monkeypatch.setattr(pretrain.distributed.device, "all_gather_object", lambda view, group=None: [view])
    finetune.output_dir.agree_on_output_dir(replacing, FakeParallel(rank=0, world_size=1))
    assert warnings == [f"train.overwrite_output_dir: this run replaces the previous run's outputs in {out} ({FOUND})"]


def test_the_feature_cache_unrelated_files_and_empty_directories_are_accepted(tmp_path):
    out = tmp_path / "out"
    assert previous_outputs(cfg_of(tmp_path, out)) == []  # not made yet
    out.mkdir()
    assert previous_outputs(cfg_of(tmp_path, out)) == []  # empty
    for name in ("feature_cache/train-0123.safetensors", "feature_based/metrics.json", "notes.txt", "my_run.yaml"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("x")
    for name in ("best", "predictions", "tensorboard"):  # made, never filled: nothing to lose
        (out / name).mkdir()
    assert previous_outputs(cfg_of(tmp_path, out)) == [] and output_dir_problems(cfg_of(tmp_path, out)) == []
    # events written elsewhere (train.tensorboard_dir): <output_dir>/tensorboard is not this run's
    (out / "tensorboard" / "events.out.tfevents.1").write_text("x")
    assert previous_outputs(cfg_of(tmp_path, out, f"train.tensorboard_dir={tmp_path / 'tb'}")) == []
    assert previous_outputs(cfg_of(tmp_path, out)) == ["tensorboard/"]
    (out / "metrics.json").write_text("{}")
    assert previous_outputs(cfg_of(tmp_path, out)) == ["metrics.json", "tensorboard/"]


class FakeParallel:
    def __init__(self, rank, world_size, logging_rank=0):
        self.rank, self.world_size, self.logging_rank = rank, world_size, logging_rank


def test_every_rank_follows_the_logging_ranks_verdict(tmp_path, monkeypatch):
    """Where the ranks may not share train.output_dir (several nodes) the check waits for the
    rendezvous: the logging rank looks, every rank refuses with its verdict (exit 2), none waits."""
    import finetune.output_dir
    import pretrain.distributed.device
    from pretrain.common.errors import UsageError

    out = tmp_path / "out"
    previous_run(out)
    cfg = cfg_of(tmp_path, out)
    sent = []

    def gather(view, group=None):  # rank 0's view, whichever rank asks
        sent.append(view)
        return [(output_dir_problems(cfg), previous_outputs(cfg)), None]

    monkeypatch.setattr(pretrain.distributed.device, "all_gather_object", gather)
    for rank in (0, 1):
        with pytest.raises(UsageError) as error:
            finetune.output_dir.agree_on_output_dir(cfg, FakeParallel(rank=rank, world_size=2))
        assert str(error.value) == refusal(out) and error.value.exit_status == 2
    assert sent[1] is None  # rank 1 did not look: only the rank that writes there does

    assert finetune.output_dir.one_node(1, {})
    assert finetune.output_dir.one_node(4, {"LOCAL_WORLD_SIZE": "4"}) and finetune.output_dir.one_node(2, {"LOCAL_SIZE": "2"})
    assert not finetune.output_dir.one_node(4, {"LOCAL_WORLD_SIZE": "2"}) and not finetune.output_dir.one_node(2, {})


@pytest.mark.slow
def test_a_real_run_then_refused_on_every_rank_then_replaced(tmp_path):
    """A real tiny run's outputs; a 2-rank run into them (no ranks-per-node variable: decided after
    the rendezvous) ends on both ranks with exit 2, one line from the logging rank, every file as it
    was; with train.overwrite_output_dir=true the run replaces them."""
    from test_finetune_tasks import QUIET, repeat_task, tiny_bert, write_tsv

    hf = tiny_bert(tmp_path)
    files = repeat_task(tmp_path, train=32, dev=16)
    test = write_tsv(tmp_path / "test.tsv", ["index", "sentence1", "sentence2"], [(0, "w1 w2", "w1 w2")])
    out = tmp_path / "out"
    args = ["-m", "finetune", "rte", *QUIET, f"model.init_from={hf}", f"task.train_file={files['train']}",
            f"task.dev_files=[{files['dev']}]", f"task.test_files=[{test}]", f"train.output_dir={out}",
            "train.epochs=1", "task.max_seq_length=12", "train.global_batch_size=16", "train.micro_batch_size=8"]
    first, = run_ranks(args, 1, timeout=300)
    before = fingerprint(out)
    assert {name for name in before if os.sep not in name} == {"metrics.json", "best", "predictions", "submission",
                                                               "tensorboard"}

    ranks = run_ranks(args, 2, timeout=300, expect_success=False)
    assert [r.returncode for r in ranks] == [2, 2], [r.stdout[-2000:] for r in ranks]
    assert ranks[0].stdout.splitlines() == [f"error: {refusal(out)}"] and ranks[1].stdout == ""
    assert fingerprint(out) == before

    again, = run_ranks(args + ["train.overwrite_output_dir=true"], 1, timeout=300)
    assert (f"train.overwrite_output_dir: this run replaces the previous run's outputs in {out} ({FOUND})"
            in again.stdout)
    after = fingerprint(out)
    assert after["metrics.json"] != before["metrics.json"] and after["best/model.safetensors"] != \
        before["best/model.safetensors"]
    assert json.loads((out / "metrics.json").read_text())["best"]["epoch"] == 1
