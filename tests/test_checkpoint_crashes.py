"""Checkpoints under crashes (invariant 7): a save killed half-way never moves `latest` and never
looks complete; a damaged checkpoint is refused naming the file, never a silent fresh start;
pruning removes exactly the oldest checkpoints and nothing else; a SIGTERM to one rank stops
every rank at the same step with one consistent checkpoint, and resuming it equals a straight run.

The processes run tests/_crash_worker.py (the tiny model, the trainer's log on stdout, an optional
SIGKILL in the middle of a checkpoint file) or `python -m pretrain` (its error output)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from _train_worker import TINY
from distributed import REPO, free_port, run_python, start_python
from pretrain.checkpoint.exact import _drop_recovery_scripts, _prune, _recovery_scripts
from test_file_modes import assert_modes
from pretrain.checkpoint.format import CheckpointError, latest_tag, resolve_tag_dir, tag_for, verify_checkpoint

# Dropout on: a resumed run must also restore the RNG streams to draw the same masks. ZeRO-1 so a
# checkpoint has an optimizer shard besides the model states. A long schedule that the runs stop
# early (resilience.exit_after_steps), so the learning rates of every run agree.
COMMON = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "optimizer.name=lamb",
          "parallel.zero_stage=1", "train.train_steps=1000", "resilience.dist_timeout_minutes=0.5"]
MODEL, OPTIMIZER, RNG = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank00000.pt"


# ----------------------------------------------------------------------------- helpers
class Job:
    """world ranks of tests/_crash_worker.py, each rank's output in tmp_path/<name>.rank<R>.log."""

    def __init__(self, tmp_path, name, overrides, world=1, env=None):
        self.out = tmp_path / f"{name}.json"
        self.logs = [tmp_path / f"{name}.rank{rank}.log" for rank in range(world)]
        port = free_port()
        self.procs = []
        for rank in range(world):
            rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO),
                            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
            with open(self.logs[rank], "w") as log:
                self.procs.append(start_python(["tests/_crash_worker.py", str(self.out), *COMMON, *overrides],
                                               rank_env, output=log))

    def log(self, rank=0) -> str:
        return self.logs[rank].read_text()

    def dump(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}) ---\n{self.log(r)[-3000:]}" for r, p in enumerate(self.procs))

    def wait(self, timeout=300) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ranks still running after {timeout}s:\n{self.dump()}") from None
        finally:
            self.kill()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def result(self, timeout=300) -> dict:
        codes = self.wait(timeout)
        assert codes == [0] * len(codes), self.dump()
        return json.loads(self.out.read_text())


def run(tmp_path, name, overrides, world=1, env=None) -> dict:
    return Job(tmp_path, name, overrides, world, env).result()


def assert_same_steps(got: list[dict], expected: list[dict], rel: float = 0.0):
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        for key in ("loss", "lm_loss", "nsp_loss", "grad_norm", "learning_rate"):
            assert a[key] == pytest.approx(b[key], rel=rel, abs=0.0), f"step {step} of {len(got)}: {key}"


def iter_dirs(save_dir) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if p.is_dir() and p.name.startswith("iter_"))


def assert_complete(tag_dir):
    """meta.json lists exactly the files of the directory, at their sizes."""
    meta = json.loads((tag_dir / "meta.json").read_text())
    on_disk = {str(p.relative_to(tag_dir)): p.stat().st_size for p in tag_dir.rglob("*")
               if p.is_file() and p.name != "meta.json"}
    assert meta["files"] == on_disk
    return meta


# ----------------------------------------------------------------------------- 1. killed mid-save
@pytest.mark.slow
def test_kill_in_the_middle_of_a_save_keeps_latest_and_relaunch_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    saving = ["checkpoint.save_interval=2", f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]
    straight = run(tmp_path, "straight", ["resilience.exit_after_steps=6"])

    # The save at step 4 writes the model states, then dies half-way through the optimizer shard.
    crashed = Job(tmp_path, "crashed", saving + ["resilience.exit_after_steps=6"], env={"CRASH_IN_SAVE": "4:1"})
    assert crashed.wait() == [-signal.SIGKILL], crashed.dump()
    assert f"killed while writing {ckpt}/iter_0000004" in crashed.log()
    assert (ckpt / "latest").read_text() == "iter_0000002"
    # The half-written save is a .partial directory without meta.json: no reader takes it.
    assert iter_dirs(ckpt) == ["iter_0000002", "iter_0000004.partial"]
    partial = ckpt / "iter_0000004.partial"
    assert (partial / MODEL).exists() and (partial / OPTIMIZER).exists() and not (partial / "meta.json").exists()
    assert resolve_tag_dir(str(ckpt)) == str(ckpt / "iter_0000002")
    assert latest_tag(str(ckpt)) == "iter_0000002"

    resumed = Job(tmp_path, "resumed", saving + ["resilience.exit_after_steps=4"])
    second = resumed.result()
    assert f"resumed from {ckpt} at step 2 (16 samples)" in resumed.log()
    # bit for bit, as tests/test_resume.py's single-process resume
    assert_same_steps(second["history"], straight["history"][2:6])
    assert second["params_norm"] == straight["params_norm"]
    # The next save of step 4 replaced the leftover; nothing half-written remains.
    assert iter_dirs(ckpt) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert (ckpt / "latest").read_text() == "iter_0000006"
    for tag in iter_dirs(ckpt):
        assert assert_complete(ckpt / tag)["step"] == int(tag[5:])


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_no_complete_looking_directory(tmp_path):
    """DP2: rank 1 dies writing its RNG file, after DeepSpeed's files (whose save ends in a barrier
    of its own), while rank 0 has written all of its files. Before, rank 0 wrote meta.json at that
    point, and the directory looked complete without rank 1's RNG state."""
    ckpt = tmp_path / "ckpt"
    saving = ["checkpoint.save_interval=2", f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]
    # rank 1's files: its optimizer shard (0), its RNG file (1)
    crashed = Job(tmp_path, "crashed", saving + ["resilience.exit_after_steps=6"], world=2,
                  env={"CRASH_IN_SAVE": "4:1:1"})
    codes = crashed.wait()
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, crashed.dump()
    assert f"killed while writing {ckpt}/iter_0000004.partial/rng_rank00001.pt" in crashed.log(1)
    assert (ckpt / "latest").read_text() == "iter_0000002"
    assert iter_dirs(ckpt) == ["iter_0000002", "iter_0000004.partial"]
    partial = ckpt / "iter_0000004.partial"
    assert {MODEL, OPTIMIZER, "zero_pp_rank_1_mp_rank_00_optim_states.pt", RNG} <= {p.name for p in partial.iterdir()}
    assert not (partial / "meta.json").exists() and not (partial / "rng_rank00001.pt").exists()

    resumed = Job(tmp_path, "resumed", saving + ["resilience.exit_after_steps=2"], world=2)
    second = resumed.result()
    assert f"resumed from {ckpt} at step 2 (16 samples)" in resumed.log()
    assert len(second["history"]) == 2
    assert iter_dirs(ckpt) == ["iter_0000002", "iter_0000004"]
    assert (ckpt / "latest").read_text() == "iter_0000004"
    assert_complete(ckpt / "iter_0000004")


# ----------------------------------------------------------------------------- 2. damaged files
@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """One checkpoint at step 2 (single process, ZeRO-1), written by `python -m pretrain`."""
    tmp = tmp_path_factory.mktemp("damaged")
    ckpt = tmp / "ckpt"
    proc = pretrain(tmp, [f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (ckpt / "latest").read_text() == "iter_0000002"
    assert_complete(ckpt / "iter_0000002")
    return ckpt


def pretrain(tmp, overrides, umask=-1) -> subprocess.CompletedProcess:
    """`python -m pretrain` of the tiny model on one process (under `umask`, if given)."""
    config = tmp / "tiny.yaml"
    config.write_text("train:\n  train_steps: 1000\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    args = ["-m", "pretrain", "--config", str(config), *TINY, *COMMON, *overrides]
    if umask == -1:
        return run_python(args, env, timeout=300)
    # the zygote's children have its umask: this one needs its own
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          umask=umask)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def garble(path):
    path.write_bytes(b"\xff\xfe\x00 not json \x9c" * 10)


def without_file_list(tag_dir):
    """A checkpoint written before meta.json listed its files (and their CRC32s)."""
    meta = json.loads((tag_dir / "meta.json").read_text())
    del meta["files"], meta["crc32"]
    (tag_dir / "meta.json").write_text(json.dumps(meta))


def overwrite_in_place(path):
    """Bytes changed, size kept (a copy of another run's shard, a disk that flipped a block)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated model states": (MODEL, truncate, "has .* bytes, .* when saved"),
    "model states overwritten in place": (MODEL, overwrite_in_place, "has other bytes than when it was saved"),
    "missing model states": (MODEL, os.remove, "is missing"),
    "missing optimizer shard": (OPTIMIZER, os.remove, "is missing"),
    "truncated rng": (RNG, truncate, "has .* bytes, .* when saved"),
    "truncated meta.json": ("meta.json", truncate, "cannot read"),
    "garbled meta.json": ("meta.json", garble, "cannot read"),
}


def test_fingerprints_are_per_block_crc32s(tmp_path, monkeypatch):
    """A file's fingerprint: the CRC32 of each block (256 MiB; 1,000 bytes here), read by threads."""
    import zlib

    from pretrain.checkpoint import format as checkpoint_format

    monkeypatch.setattr(checkpoint_format, "_BLOCK_BYTES", 1000)
    data = os.urandom(2500)
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    expected = " ".join(f"{zlib.crc32(data[i:i + 1000]):08x}" for i in (0, 1000, 2000))
    assert checkpoint_format.fingerprints(str(tmp_path), ["a", "empty"]) == {"a": expected, "empty": "00000000"}
    assert checkpoint_format.fingerprints(str(tmp_path), ["a", "empty"], share=(1, 2)) == {"empty": "00000000"}
    meta = {"crc32": {"a": expected, "empty": "00000000", "gone": "00000000"}}
    (tmp_path / "a").write_bytes(data[:1500] + bytes([data[1500] ^ 1]) + data[1501:])
    problems = checkpoint_format.content_problems(str(tmp_path), meta)
    assert len(problems) == 2 and "gone is missing" in problems[0] and f"{tmp_path / 'a'} has other bytes" in problems[1]
    assert expected.split()[0] in problems[1].split("(CRC32 ")[1].split(",")[0]  # the first block is unchanged


# Every kind of damage is found by the in-process checks; the programs (a resume, a conversion) run
# for one damage of each check: sizes, meta.json, contents.
THROUGH_THE_PROGRAMS = ("truncated model states", "garbled meta.json", "model states overwritten in place")


@pytest.mark.slow
@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, saved_checkpoint, case):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(saved_checkpoint), str(ckpt)], check=True)
    name, damage, message = DAMAGE[case]
    path = ckpt / "iter_0000002" / name
    damage(path)
    before = sorted(p.name for p in ckpt.rglob("*"))

    # Found by the checks before anything is loaded (no process group, no engine here): sizes when
    # the resume looks for the latest checkpoint, contents (CRC32) before anything is loaded.
    with pytest.raises(CheckpointError, match=message) as found:
        verify_checkpoint(str(ckpt / latest_tag(str(ckpt))), contents=True)
    assert str(path) in str(found.value)
    if case not in THROUGH_THE_PROGRAMS:
        return

    proc = pretrain(tmp_path, [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}", "resilience.exit_after_steps=2"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(path) in errors[0], output
    assert "Traceback" not in output
    # never a fresh start: no step trained, nothing saved
    assert "starting from scratch" not in output and "step 1/" not in proc.stdout
    assert sorted(p.name for p in ckpt.rglob("*")) == before
    assert (ckpt / "latest").read_text() == "iter_0000002"

    converted = run_python(["tools/convert_checkpoint.py", "native-to-hf", "--input", str(ckpt),
                            "--output", str(tmp_path / "hf")], timeout=300)
    assert converted.returncode == 1 and str(path) in converted.stderr, converted.stdout + converted.stderr
    assert len(converted.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_damaged_checkpoint_without_file_list_fails_clearly(tmp_path, saved_checkpoint):
    """A checkpoint written before meta.json listed its files: DeepSpeed's own error (here its
    FileNotFoundError for the optimizer shard it reads after the model states) comes out as one
    line naming the checkpoint and the file, not as a traceback."""
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(saved_checkpoint), str(ckpt)], check=True)
    without_file_list(ckpt / "iter_0000002")
    os.remove(ckpt / "iter_0000002" / OPTIMIZER)
    proc = pretrain(tmp_path, [f"checkpoint.load_dir={ckpt}", "resilience.exit_after_steps=1"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "DeepSpeed could not load it" in errors[0], output
    assert str(ckpt / "iter_0000002" / OPTIMIZER) in errors[0]
    assert "Traceback" not in output and "step 1/" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_a_save_honours_the_umask_and_leaves_no_deepspeed_converter(tmp_path, umask):
    """Every file and directory of a save has the modes the user's umask gives (issue 37), and
    save_dir holds the checkpoint and `latest` only: not the zero_to_fp32.py and zero_to_torch.py
    that DeepSpeed copies there at every ZeRO save, which cannot convert our checkpoints."""
    ckpt = tmp_path / "ckpt"
    proc = pretrain(tmp_path, [f"checkpoint.save_dir={ckpt}", "resilience.exit_after_steps=1"], umask=umask)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest"]
    assert_complete(ckpt / "iter_0000001")
    assert_modes(ckpt, umask)


def test_deepspeeds_converters_are_removed_only_when_this_save_left_them(tmp_path):
    (tmp_path / "zero_to_fp32.py").write_text("# another program's, there before the save")
    before = _recovery_scripts(str(tmp_path))
    (tmp_path / "zero_to_fp32.py").write_text("# overwritten by DeepSpeed")
    (tmp_path / "zero_to_torch.py").write_text("# new")
    _drop_recovery_scripts(str(tmp_path), before)
    assert sorted(os.listdir(tmp_path)) == ["zero_to_fp32.py"]


# ----------------------------------------------------------------------------- 3. pruning
@pytest.mark.slow
def test_keep_last_prunes_exactly_the_oldest_and_nothing_else(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "notes").mkdir()
    (ckpt / "notes" / "a.txt").write_text("mine too")
    (ckpt / "iter_best").mkdir()  # looks like a checkpoint name, is not one
    (ckpt / "iter_best" / "w.pt").write_text("x")
    (ckpt / "iter_0000099.partial").mkdir()  # a killed save of another run
    overrides = ["train.train_steps=5", "checkpoint.save_interval=2", "checkpoint.keep_last=2",
                 f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]
    job = Job(tmp_path, "first", overrides)
    job.result()
    assert [line.split("/")[-1] for line in job.log().splitlines() if line.startswith("saved checkpoint")] == \
        ["iter_0000002", "iter_0000004", "iter_0000005"]
    assert iter_dirs(ckpt) == ["iter_0000004", "iter_0000005", "iter_best"]
    assert (ckpt / "latest").read_text() == "iter_0000005"
    assert (ckpt / "notes.txt").read_text() == "mine" and (ckpt / "notes" / "a.txt").read_text() == "mine too"
    assert (ckpt / "iter_best" / "w.pt").read_text() == "x"
    saved = assert_complete(ckpt / "iter_0000005")

    # Sent back to step 4 (`latest` edited, as a damaged checkpoint's message suggests): the run
    # saves step 5 once more, replacing the complete checkpoint of that step (a directory cannot
    # be renamed over another). (A finished run relaunched as it was trains and saves nothing.)
    (ckpt / "latest").write_text("iter_0000004")
    again = Job(tmp_path, "again", overrides)
    again.result()
    assert "resumed from" in again.log() and "saved checkpoint" in again.log()
    assert iter_dirs(ckpt) == ["iter_0000004", "iter_0000005", "iter_best"]
    assert (ckpt / "latest").read_text() == "iter_0000005"
    assert assert_complete(ckpt / "iter_0000005")["files"] == saved["files"]


def test_prune_orders_by_step_removes_only_its_own_series_and_clears_leftovers(tmp_path):
    def checkpoint(name, meta):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))

    for name in ["iter_9999998", "iter_9999999", "iter_10000000", "iter_10000001"]:
        checkpoint(name, {"series": "ours"})
    checkpoint("iter_20000000", {"series": "another run's"})  # a later step of another series: kept
    checkpoint("iter_0000002", {})  # written before series were recorded: not this run's, kept
    checkpoint("iter_0000007.replaced", {"series": "another run's"})  # no iter_0000007: the one to take back
    for name in ["iter_0000005.partial", "iter_10000000.replaced", "iter_x", "other", "iter_0000003"]:
        (tmp_path / name).mkdir()  # iter_0000003 has no meta.json: not a checkpoint of ours, left alone
    (tmp_path / "iter_0000001").write_text("a file, not a checkpoint")
    _prune(str(tmp_path), keep_last=2, keep="iter_10000001", series="ours")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "iter_0000007.replaced", "iter_10000000", "iter_10000001",
        "iter_20000000", "iter_x", "other"]


def test_latest_takes_back_a_checkpoint_left_aside_by_a_killed_replacement(tmp_path):
    """A save replacing a complete checkpoint of its step renames it to <tag>.replaced, then the
    new one to <tag>: killed between the two, `latest` names a missing directory for a moment."""
    aside = tmp_path / "iter_0000004.replaced"
    aside.mkdir()
    (aside / "meta.json").write_text(json.dumps({"step": 4, "layout": {}, "config": {}, "files": {"x.pt": 3}}))
    (aside / "x.pt").write_bytes(b"abc")
    (tmp_path / "latest").write_text("iter_0000004")
    assert latest_tag(str(tmp_path)) == "iter_0000004"
    assert (tmp_path / "iter_0000004" / "x.pt").exists() and not aside.exists()
    verify_checkpoint(str(tmp_path / "iter_0000004"))
    (tmp_path / "latest").write_text("iter_0000006")
    with pytest.raises(CheckpointError, match="names 'iter_0000006', which is not a directory"):
        latest_tag(str(tmp_path))


def test_an_unfinished_save_is_named_so_and_the_complete_checkpoints_listed(tmp_path, capsys):
    """The converter (any reader of a checkpoint path) given a <tag>.partial directory, or a
    save_dir without `latest`, names the complete checkpoints to pass instead: the one `latest`
    names first, then the others newest first; never the .partial its advice once led to."""
    from tools import convert_checkpoint

    ckpt = tmp_path / "ckpt"
    for name in ("iter_0000002", "iter_0000004"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "meta.json").write_text(json.dumps({"layout": {}, "config": {}, "files": {}}))
    (ckpt / "latest").write_text("iter_0000002")  # a user who wrote an older one into it
    partial = ckpt / "iter_0000006.partial"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"half")
    assert convert_checkpoint.main(["native-to-hf", "--input", str(partial), "--output", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (
        f"convert_checkpoint: error: {partial} is an unfinished save (in progress, or killed before it completed), "
        f"not a checkpoint; pass a complete checkpoint: {ckpt}/iter_0000002 (latest), {ckpt}/iter_0000004\n")
    os.remove(ckpt / "latest")
    with pytest.raises(CheckpointError) as no_latest:
        resolve_tag_dir(str(ckpt))
    assert str(no_latest.value) == (f"{ckpt} has iter_* directories but no 'latest' file; pass a complete "
                                    f"checkpoint: {ckpt}/iter_0000004, {ckpt}/iter_0000002")
    for name in ("iter_0000002", "iter_0000004"):
        shutil.rmtree(ckpt / name)
    with pytest.raises(CheckpointError, match=f"no 'latest' file; {ckpt} holds no complete checkpoint yet$"):
        resolve_tag_dir(str(ckpt))
    with pytest.raises(CheckpointError, match=f"not a checkpoint; {ckpt} holds no complete checkpoint yet$"):
        resolve_tag_dir(str(partial))


# ----------------------------------------------------------------------------- 4. SIGTERM to one rank
def wait_for_line(job, text, timeout=300):
    deadline = time.monotonic() + timeout
    while text not in job.log():
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), job.dump()
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_one_consistent_checkpoint_and_resume_equals_straight(tmp_path):
    ckpt = tmp_path / "ckpt"
    saving = [f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}"]  # no save_interval: only the stop saves
    job = Job(tmp_path, "stopped", saving, world=2)
    try:
        wait_for_line(job, "step 3/")
        job.procs[1].send_signal(signal.SIGTERM)  # not the logging rank
        first = job.result(timeout=300)
    finally:
        job.kill()
    log = job.log()
    stopped_at = int(log.split("SIGTERM received: saving at step ")[1].split()[0])
    assert stopped_at % 5 == 0  # resilience.stop_check_interval: the ranks agree every 5 steps
    assert len(first["history"]) == stopped_at
    assert log.count("saved checkpoint") == 1
    tag = tag_for(stopped_at)
    assert (ckpt / "latest").read_text() == tag and iter_dirs(ckpt) == [tag]
    meta = assert_complete(ckpt / tag)
    assert meta["step"] == stopped_at and meta["consumed_samples"] == 8 * stopped_at
    # both ranks wrote their part of the same step
    assert {"rng_rank00000.pt", "rng_rank00001.pt", MODEL, OPTIMIZER,
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(meta["files"])

    resumed = Job(tmp_path, "resumed", saving + ["resilience.exit_after_steps=2"], world=2)
    second = resumed.result()
    assert f"resumed from {ckpt} at step {stopped_at}" in resumed.log()
    straight = run(tmp_path, "straight", [f"resilience.exit_after_steps={stopped_at + 2}"], world=2)
    assert_same_steps(first["history"] + second["history"], straight["history"], rel=1e-6)
    assert second["params_norm"] == pytest.approx(straight["params_norm"], rel=1e-6)


@pytest.mark.slow
def test_sigterm_on_a_save_step_saves_once(tmp_path):
    """A stop agreed at a step checkpoint.save_interval also saves: one save, not the same one twice."""
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path, "stopped", [f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=5"])
    try:
        wait_for_line(job, "step 2/")
        job.procs[0].send_signal(signal.SIGTERM)
        job.result()
    finally:
        job.kill()
    stopped_at = int(job.log().split("SIGTERM received: saving at step ")[1].split()[0])
    assert job.log().count(f"saved checkpoint {ckpt}/{tag_for(stopped_at)}") == 1
