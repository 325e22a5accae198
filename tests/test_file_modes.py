"""Every file the project writes honours the user's umask (issue 37): 0644 files and 0755
directories under umask 022, 0600 and 0700 under 077, whatever wrote them first (safetensors
writes its files 0600). Here the writers on their own: atomic outputs, a directory written whole,
native-to-hf (which fine-tuning's best/ uses too) and the converted native checkpoint; a training
run's checkpoint save is in tests/test_checkpoint_crashes.py."""
import contextlib
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from pretrain.common.atomic import atomic_outputs, directory_output, replace_durably, umask
from test_checkpoint_interop import hf_model, save_hf

UMASKS = [0o022, 0o077]


@contextlib.contextmanager
def process_umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def assert_modes(root, mask: int) -> None:
    """root and everything under it: files 0o666 & ~mask, directories 0o777 & ~mask."""
    paths = [str(root)] + [os.path.join(top, name) for top, dirs, files in os.walk(root) for name in dirs + files]
    wrong = {}
    for path in paths:
        mode, expected = stat.S_IMODE(os.stat(path).st_mode), (0o777 if os.path.isdir(path) else 0o666) & ~mask
        if mode != expected:
            wrong[os.path.relpath(path, root)] = f"{mode:o} (expected {expected:o})"
    assert not wrong, wrong


def test_umask_is_read_without_changing_it():
    with process_umask(0o027):
        assert umask() == 0o027
        assert umask() == 0o027  # still: reading did not set it


@pytest.mark.parametrize("mask", UMASKS, ids=oct)
def test_atomic_writes_honour_the_umask(tmp_path, mask):
    weights, notes, directory = tmp_path / "w.safetensors", tmp_path / "notes.json", tmp_path / "model"
    with process_umask(mask):
        with atomic_outputs([str(weights), str(notes)]) as temps:
            save_file({"w": torch.zeros(2)}, temps[str(weights)])  # safetensors: 0600 whatever the umask
            with open(temps[str(notes)], "w") as f:
                f.write("{}")
        replace_durably(str(tmp_path / "latest"), "iter_0000001")
        with directory_output(str(directory), "a test model") as tmp:
            os.makedirs(os.path.join(tmp, "sub"))
            save_file({"w": torch.zeros(2)}, os.path.join(tmp, "sub", "model.safetensors"))
    for path in (weights, notes, tmp_path / "latest"):
        assert_modes(path, mask)
    assert_modes(directory, mask)
    assert sorted(os.listdir(tmp_path)) == ["latest", "model", "notes.json", "w.safetensors"]  # no temporary left


@pytest.mark.parametrize("mask", UMASKS, ids=oct)
def test_conversions_honour_the_umask(tmp_path, mask):
    """hf-to-native's checkpoint and native-to-hf's model directory (model.safetensors was 0600)."""
    from pretrain.checkpoint.hf import read_hf, write_hf
    from pretrain.checkpoint.logical import read_native, write_native

    source = save_hf(hf_model(), tmp_path / "hf")
    with process_umask(mask):
        write_native(read_hf(str(source)), str(tmp_path / "native"), tp=2, pp=1)
        write_hf(read_native(str(tmp_path / "native")), str(tmp_path / "back"))
    assert_modes(tmp_path / "native", mask)
    assert "model.safetensors" in os.listdir(tmp_path / "back")
    assert_modes(tmp_path / "back", mask)
