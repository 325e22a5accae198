"""A run never overwrites or deletes checkpoints it did not write (invariant 12, series.py): a new
run into a save_dir holding checkpoints is refused before any rank starts, naming the latest one
and the ways out; resuming one series into another's directory too; with checkpoint.overwrite the
new series writes beside the old one, and retention removes only its own checkpoints.

The rules are checked on hand-made directories (torch-free, fast); the slow test runs the case the
issue saw: a second `python -m pretrain` without checkpoint.load_dir into the first run's directory."""
import hashlib
import json
import os

import pytest

from _train_worker import TINY
from distributed import REPO, run_python
from pretrain.checkpoint.series import new_series, own_tags, save_dir_problems, series_of
from pretrain.config import Config


def _checkpoint(save_dir, step, series, latest=True):
    tag = f"iter_{step:07d}"
    os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    with open(os.path.join(save_dir, tag, "meta.json"), "w") as f:
        json.dump({"step": step, "series": series} if series else {"step": step}, f)
    if latest:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(tag)
    return tag


def _cfg(**checkpoint) -> Config:
    cfg = Config()
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def test_a_new_run_into_a_directory_holding_checkpoints_is_refused_naming_the_latest(tmp_path):
    ck = str(tmp_path / "ck")
    _checkpoint(ck, 4, "a")
    _checkpoint(ck, 6, "a")
    [line] = save_dir_problems(_cfg(save_dir=ck))
    assert f"already holds 2 checkpoints (latest: {ck}/iter_0000006)" in line
    assert "starts from scratch" in line and f"checkpoint.load_dir={ck}" in line and "checkpoint.overwrite=true" in line
    assert "\n" not in line
    [line] = save_dir_problems(_cfg(save_dir=ck, init_from=str(tmp_path / "elsewhere")))
    assert "starts a new run (from checkpoint.init_from)" in line
    # load_dir = save_dir with its `latest` gone: a resume finds nothing and would start over
    os.remove(os.path.join(ck, "latest"))
    [line] = save_dir_problems(_cfg(save_dir=ck, load_dir=ck))
    assert "no 'latest' file in checkpoint.load_dir" in line and "(latest: " in line and "iter_0000006" in line
    assert save_dir_problems(_cfg(save_dir=ck, overwrite=True)) == []


def test_resuming_a_series_writes_on_and_another_directory_is_checked(tmp_path):
    ck, other = str(tmp_path / "ck"), str(tmp_path / "other")
    _checkpoint(ck, 4, "a")
    assert save_dir_problems(_cfg(save_dir=ck, load_dir=ck)) == []
    assert save_dir_problems(_cfg(save_dir=str(tmp_path / "empty"), load_dir=ck)) == []  # a new, empty directory
    assert save_dir_problems(_cfg(load_dir=ck)) == []  # saves nothing
    _checkpoint(other, 2, "b")
    [line] = save_dir_problems(_cfg(save_dir=other, load_dir=ck))
    assert f"of another run than the one this run resumes ({ck}/iter_0000004)" in line
    _checkpoint(other, 8, "a")  # the same series copied there: its resume goes on writing it
    os.remove(os.path.join(other, "iter_0000002", "meta.json"))  # no longer a complete checkpoint
    assert save_dir_problems(_cfg(save_dir=other, load_dir=ck)) == []
    # checkpoints that record no series can't be told apart: resumed from elsewhere, refused
    legacy = str(tmp_path / "legacy")
    _checkpoint(legacy, 2, None)
    assert save_dir_problems(_cfg(save_dir=other, load_dir=legacy)) != []
    assert save_dir_problems(_cfg(save_dir=legacy, load_dir=legacy)) == []


def test_series_are_read_from_meta_and_own_tags_keep_to_theirs(tmp_path):
    ck = str(tmp_path / "ck")
    a, b = new_series(), new_series()
    assert a != b and len(a) == 32
    _checkpoint(ck, 2, a)
    _checkpoint(ck, 4, b)
    _checkpoint(ck, 6, None)
    assert series_of(os.path.join(ck, "iter_0000002")) == a
    assert series_of(os.path.join(ck, "iter_0000006")) is None
    assert series_of(os.path.join(ck, "missing")) is None
    assert own_tags(ck, a) == ["iter_0000002"] and own_tags(ck, None) == ["iter_0000006"]


def _sums(directory) -> dict[str, str]:
    return {os.path.relpath(os.path.join(root, name), directory):
            hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
            for root, _, names in os.walk(directory) for name in names}


def _pretrain(*overrides, check=True):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = run_python(["-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY, *overrides], env, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_a_forgotten_load_dir_loses_nothing_and_overwrite_keeps_the_other_series(tmp_path):
    """The issue's case: a 6-step series (iter 4 and 6 kept); the same command again without
    checkpoint.load_dir is refused with exit 2 and one line, every file unchanged; with
    checkpoint.overwrite a 2-step run writes its own series beside it, and its retention
    (keep_last 1) removes its own iter_1, never the other series' later steps."""
    ck = str(tmp_path / "ck")
    common = [f"checkpoint.save_dir={ck}", "checkpoint.save_interval=2", "checkpoint.keep_last=2",
              "data.kind=synthetic", "logging.interval=1"]
    _pretrain(*common, "train.train_steps=6")
    assert sorted(os.listdir(ck)) == ["iter_0000004", "iter_0000006", "latest"]
    before = _sums(ck)
    refused = _pretrain(*common, "train.train_steps=3", check=False)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if "already holds" in line]
    assert len(lines) == 1 and f"(latest: {ck}/iter_0000006)" in lines[0], refused.stderr
    assert _sums(ck) == before
    _pretrain(*common, "train.train_steps=3", "checkpoint.save_interval=1", "checkpoint.keep_last=1",
              "checkpoint.overwrite=true")
    assert sorted(os.listdir(ck)) == ["iter_0000003", "iter_0000004", "iter_0000006", "latest"]
    assert open(os.path.join(ck, "latest")).read() == "iter_0000003"
    assert {k: v for k, v in _sums(ck).items() if not k.startswith("iter_0000003") and k != "latest"} == \
        {k: v for k, v in before.items() if k != "latest"}
    assert series_of(os.path.join(ck, "iter_0000003")) != series_of(os.path.join(ck, "iter_0000006"))
