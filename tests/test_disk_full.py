"""A full disk, for every program that writes: one line naming the path and the space left, exit 1,
nothing under a final name (a later run can never take a half-written file for a whole one).

The disk is a small tmpfs mounted for the test (root, as the network-namespace tests need, and
under the same rule: skipped with the reason elsewhere, failed under REQUIRE_NETNS=1), filled
but for a few KiB before each program runs: the program's small files (directories, logs) fit,
its main output does not. The writers: tools/build_vocab.py, tools/preprocess_data.py, a
pretraining checkpoint save (bf16, ZeRO-1: DeepSpeed's torch.save fails with `unexpected pos`, not
an errno), both directions of tools/convert_checkpoint.py (torch.save; safetensors), and a
fine-tuning run's best weights.
"""
import os
import subprocess

import pytest

from _train_worker import TINY
from distributed import free_port, run_python
from test_finetune_tasks import QUIET, repeat_task, tiny_bert
from toy_corpus import write_jsonl

pytestmark = pytest.mark.slow

SIZE = 4 << 20


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at tmp_path/small; yields a function leaving `n` bytes free on it."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:  # root-only, as the network-namespace tests: the same rule (conftest.py)
        reason = f"mount -t tmpfs failed (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}"
        if os.environ.get("REQUIRE_NETNS", "0") not in ("", "0"):
            pytest.fail(f"{reason}, and REQUIRE_NETNS=1 (the root-only tests): it fails rather than skips")
        pytest.skip(reason)
    def leave_free(n: int):
        filler = mount / "filler"
        if filler.exists():
            filler.unlink()
        stats = os.statvfs(mount)
        with open(filler, "wb") as f:
            f.write(b"\0" * (stats.f_bavail * stats.f_frsize - n))
        return mount

    try:
        yield leave_free
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def run(args, **kwargs):
    return run_python(list(args), timeout=300, **kwargs)


def assert_one_line(done, path, program=""):
    """Exit 1, one error line naming `path` and the space left (besides the program's usual notes)."""
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(program) and f"{path}: no space left on device while writing" in errors[0], errors
    assert " free of 4.0 MiB on " in errors[0] and "Traceback" not in output, errors


def finals(directory):
    """Every file under `directory` but the filler."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.name != "filler")


def test_data_tools_on_a_full_disk(small_disk, tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", 600, seed=0)
    disk = small_disk(2 << 10)
    done = run(["tools/build_vocab.py", "--input", str(tmp_path / "corpus.jsonl"), "--vocab-size", "400",
                "--output-dir", str(disk / "vocab")])
    assert_one_line(done, disk / "vocab", "build_vocab: ")
    assert finals(disk) == ["vocab"]  # the directory, nothing in it

    done = run(["tools/build_vocab.py", "--input", str(tmp_path / "corpus.jsonl"), "--vocab-size", "400",
                "--output-dir", str(tmp_path / "vocab")])
    assert done.returncode == 0, done.stderr
    disk = small_disk(16 << 10)
    done = run(["tools/preprocess_data.py", "--input", str(tmp_path / "corpus.jsonl"), "--output-prefix",
                str(disk / "toy"), "--vocab-file", str(tmp_path / "vocab" / "vocab.txt"), "--workers", "1"])
    assert_one_line(done, disk, "preprocess_data: ")
    assert finals(disk) == ["vocab"]


def test_conversions_on_a_full_disk(small_disk, tmp_path):
    from pretrain.checkpoint.hf import read_hf
    from pretrain.checkpoint.logical import write_native

    hf = tiny_bert(tmp_path)
    write_native(read_hf(str(hf)), str(tmp_path / "native"), tp=1, pp=1)
    disk = small_disk(64 << 10)
    done = run(["tools/convert_checkpoint.py", "hf-to-native", "--input", str(hf), "--output", str(disk / "native")])
    assert_one_line(done, disk / "native", "convert_checkpoint: ")
    done = run(["tools/convert_checkpoint.py", "native-to-hf", "--input", str(tmp_path / "native"), "--output",
                str(disk / "hf")])
    assert_one_line(done, disk / "hf", "convert_checkpoint: ")
    assert finals(disk) == []


def test_a_checkpoint_save_and_fine_tuning_outputs_on_a_full_disk(small_disk, tmp_path):
    disk = small_disk(64 << 10)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = run(["-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY, "train.precision=bf16",
                "parallel.zero_stage=1", "resilience.exit_after_steps=1", f"checkpoint.save_dir={disk / 'ckpt'}"], env=env)
    staging = disk / "ckpt" / "iter_0000001.partial"
    assert_one_line(done, staging)
    assert "; this save is never loaded; `latest` is unchanged" in done.stderr
    assert [name for name in finals(disk) if "/" not in name] == ["ckpt"]
    assert not (disk / "ckpt" / "latest").exists() and not (disk / "ckpt" / "iter_0000001").exists()

    hf = tiny_bert(tmp_path)
    files = repeat_task(tmp_path, train=64, dev=32)
    disk = small_disk(64 << 10)
    done = run(["-m", "finetune", "rte", *QUIET, f"model.init_from={hf}", f"task.train_file={files['train']}",
                f"task.dev_files=[{files['dev']}]", "train.epochs=1", "task.max_seq_length=12",
                f"train.output_dir={disk / 'out'}"])
    assert_one_line(done, disk / "out" / "best.new")
    assert not (disk / "out" / "best").exists() and not (disk / "out" / "best.new").exists()
