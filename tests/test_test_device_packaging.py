"""The CPU test device stays out of the product.

fakegpu is the tests' own distribution (bert-fakegpu, tests/bert-fakegpu/), installed beside the
product by tools/install.sh; the product keeps only the device-type hook of
pretrain/distributed/device.py. These tests hold that:
- the product's wheel (what `pip install .` installs) has no fakegpu file, and the test device's
  wheel carries its C++ source, found where an installed (non-editable) copy looks for it;
- BERT_FAKE_GPU=1 where the package is not installed is one line on stderr and exit status 1,
  through the programs' own spine (pretrain/cli.py), and a folder named fakegpu without the
  package (an empty namespace package) counts as not installed;
- the hook's device-type and backend names are the package's.
"""
import importlib.util
import os
import subprocess
import sys
import types
import zipfile

import pytest

from distributed import REPO
from pretrain.distributed import device

DEVICE_SOURCES = {"fakegpu/__init__.py", "fakegpu/_device.py", "fakegpu/_lstm.py", "fakegpu/csrc/fakegpu.cpp"}


def source_copy(destination):
    """The working tree's files that git knows or would add, as prepare.sh copies them (setuptools
    writes build/ beside what it builds: never into the checkout)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return destination


@pytest.mark.slow
def test_the_products_wheel_has_no_test_device_and_the_test_devices_wheel_has_its_source(tmp_path):
    assert not (REPO / "pretrain" / "fakegpu").exists()
    assert importlib.util.find_spec("pretrain.fakegpu") is None
    source = source_copy(tmp_path / "source")
    # the venv's setuptools where there is one (fast, offline); pip's isolated build otherwise
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w",
                            str(tmp_path / "wheels"), str(source), str(source / "tests" / "bert-fakegpu")],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [product] = (tmp_path / "wheels").glob("bert_pretrain-*.whl")
    [test_device] = (tmp_path / "wheels").glob("bert_fakegpu-*.whl")

    def dist_info(wheel):  # bert_pretrain-0.1.0-py3-none-any.whl -> bert_pretrain-0.1.0.dist-info
        return wheel.name.split("-py")[0] + ".dist-info"

    names = zipfile.ZipFile(product).namelist()
    assert "pretrain/distributed/device.py" in names and "finetune/main.py" in names  # it is the product
    assert [name for name in names if "fakegpu" in name.lower()] == []
    assert {name.split("/")[0] for name in names} == {"pretrain", "finetune", dist_info(product)}
    metadata = zipfile.ZipFile(product).read(f"{dist_info(product)}/METADATA").decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [line for line in requires if "fakegpu" in line]  # nor does any extra pull it in

    device_names = set(zipfile.ZipFile(test_device).namelist())
    assert DEVICE_SOURCES <= device_names, sorted(device_names)
    assert {name.split("/")[0] for name in device_names} == {"fakegpu", dist_info(test_device)}

    # installed as a plain copy (the GPU check kit installs it so): it finds the C++ source it compiles
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                "--target", str(site), str(test_device)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = "import fakegpu; print(fakegpu.__file__); print(fakegpu._SRC.is_file())"
    found = subprocess.run([sys.executable, "-c", where], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(site)))
    assert found.returncode == 0, found.stderr[-3000:]
    assert found.stdout.split() == [str(site / "fakegpu" / "__init__.py"), "True"]


# A program on the programs' own spine (pretrain/cli.py: run_command, run_distributed), in a process
# where the test device is not installed: every program meets BERT_FAKE_GPU=1 there, before any
# process group starts.
PROGRAM = """
import sys
sys.modules["fakegpu"] = None  # not installed: `import fakegpu` raises ModuleNotFoundError
from pretrain.cli import run_command, run_distributed
sys.exit(run_command(lambda argv: None, lambda args: run_distributed(lambda parallel: 0, 1)))
"""


@pytest.mark.slow
def test_the_test_device_missing_is_one_line_and_exit_1(tmp_path):
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", PROGRAM], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(env, BERT_FAKE_GPU="1", PYTHONPATH=str(REPO)))
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines() == [f"error: {device.FAKE_GPU_MISSING}"]
    assert "pip install -e tests/bert-fakegpu" in device.FAKE_GPU_MISSING
    assert (REPO / "tests" / "bert-fakegpu" / "pyproject.toml").is_file()  # what the line tells to install


@pytest.mark.parametrize("found", ["nothing", "a-bare-folder"])
def test_the_hook_refuses_a_test_device_that_is_not_installed(monkeypatch, found):
    if found == "nothing":
        monkeypatch.setitem(sys.modules, "fakegpu", None)
    else:  # a folder named fakegpu on sys.path, without the package's files: an empty namespace package
        bare = types.ModuleType("fakegpu")
        bare.__path__ = ["/somewhere/fakegpu"]
        monkeypatch.setitem(sys.modules, "fakegpu", bare)
    with pytest.raises(device.DeviceError) as refused:
        device.select_device(0, {"BERT_FAKE_GPU": "1"})
    assert str(refused.value) == device.FAKE_GPU_MISSING and "\n" not in str(refused.value)


def test_the_hooks_names_are_the_test_devices():
    import fakegpu  # importing it enables nothing (enable() does)

    assert (device.FAKE_DEVICE_TYPE, device.FAKE_BACKEND) == (fakegpu.DEVICE_TYPE, fakegpu.BACKEND)
    assert device.FAKE_BACKEND in device.DEVICE_ONLY_BACKENDS
    assert not fakegpu.is_enabled()
