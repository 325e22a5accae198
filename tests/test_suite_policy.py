"""The suite's own rules: nothing skips silently in CI, and no warning is hidden wholesale.

- Network-namespace tests (the multi-node ones) skip with the reason where namespaces cannot be
  made, and fail instead under REQUIRE_NETNS=1, which .ci/run sets.
- Test workers hide only the library noise listed in pretrain/common/quiet.py; what a rank prints as a
  warning is raised again in the test process, where pytest's summary shows it.
"""
import os
import re
import shutil
import subprocess
import sys
import warnings
import pytest

from distributed import REPO, SESSION_GPUS_ENV, reraise_warnings, run_ranks


def pytest_run(args, env):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
def test_netns_tests_skip_with_the_reason_and_fail_when_required():
    # Without iproute2's `ip` on the PATH namespaces cannot be made: what a machine without
    # root or iproute2 looks like. One test selected; the marker acts before its fixtures run.
    no_ip = dict(os.environ, PATH=os.path.dirname(sys.executable))
    assert shutil.which("ip", path=no_ip["PATH"]) is None
    selected = ["tests/test_multinode.py", "-k", "rank_killed and 0"]
    skipped = pytest_run(selected, dict(no_ip, REQUIRE_NETNS="0"))
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    assert "network namespaces cannot be created here: iproute2's `ip` command is not installed" in skipped.stdout
    failed = pytest_run(selected, dict(no_ip, REQUIRE_NETNS="1"))
    assert failed.returncode == 1 and "1 error" in failed.stdout, failed.stdout[-2000:]
    assert "namespaces cannot be created here" in failed.stdout and "REQUIRE_NETNS=1: it fails rather than skips" \
        in failed.stdout


# A stand-in for a CUDA machine, loaded by every Python process started with it on the PYTHONPATH:
# torch reports as many GPUs as CUDA_VISIBLE_DEVICES lists (and fails, as a CPU build does, when one
# is actually used).
CUDA_STANDIN = """
import os
import torch

def _visible():
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len(listed.split(",")) if listed else 0

torch.cuda.is_available = lambda: _visible() > 0
torch.cuda.device_count = _visible
"""


def test_a_rank_selects_the_cpu():
    """Every rank a CPU-tier test starts selects the CPU, and so does DeepSpeed's accelerator."""
    script = ("from pretrain.distributed.device import select_device\n"
              "from deepspeed.accelerator import get_accelerator\n"
              "print('selected', select_device(0), get_accelerator().device_name())\n")
    outputs = run_ranks(["-c", script], 1, timeout=300)
    assert "selected cpu cpu" in outputs[0].stdout, outputs[0].stdout[-2000:]


@pytest.mark.slow
def test_cpu_tiers_select_the_cpu_where_cuda_is_present(tmp_path):
    """`pytest` on a machine that reports GPUs (the stand-in above, CUDA_VISIBLE_DEVICES=0,1): the
    test process and every rank it starts still select the CPU (the session hides the GPUs before
    anything starts CUDA), while the GPU tier sees the two GPUs the session found."""
    standin = tmp_path / "standin"
    standin.mkdir()
    (standin / "sitecustomize.py").write_text(CUDA_STANDIN)
    env = dict(os.environ, PYTHONPATH=f"{standin}{os.pathsep}{REPO}", CUDA_VISIBLE_DEVICES="0,1")
    env.pop(SESSION_GPUS_ENV, None)  # a new session, finding these GPUs
    selected = ["tests/test_device.py", "tests/test_suite_policy.py::test_a_rank_selects_the_cpu",
                "tests/test_devices.py::test_gpu_tests_skip_without_a_gpu_and_fail_when_one_is_required"]
    done = pytest_run(selected, env)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "1 skipped" in done.stdout and "the switch is about machines without a GPU" in done.stdout, \
        done.stdout[-2000:]


def test_ci_requires_what_this_machine_can_do():
    ci = (REPO / ".ci" / "run").read_text()
    assert "REQUIRE_NETNS=1" in ci


def test_workers_hide_no_warning_wholesale():
    blanket = re.compile(r"""filterwarnings\(\s*["']ignore["']\s*\)|simplefilter\(\s*["']ignore["']""")
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests").glob("*.py")) if blanket.search(p.read_text())]
    offenders += [str(p.relative_to(REPO)) for d in ("pretrain", "finetune", "tools") for p in sorted((REPO / d).rglob("*.py"))
                  if blanket.search(p.read_text())]
    assert not offenders, f"blanket warning filters in {offenders}: list the noise in pretrain/common/quiet.py instead"


def test_a_rank_warning_reaches_the_test_session(tmp_path):
    script = tmp_path / "warns.py"
    script.write_text("from pretrain.common.quiet import hide_library_warnings\n"
                      "hide_library_warnings()\n"
                      "import warnings\n"
                      "warnings.warn('frobnicate() is deprecated', FutureWarning)\n"
                      "warnings.warn('Transformer Engine and Apex are not installed. Falling back', UserWarning)\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from pretrain.common.quiet import hide_library_warnings

        hide_library_warnings()
        run_ranks([str(script)], 2, timeout=120)
    messages = [(w.category, str(w.message)) for w in caught]
    assert messages.count((FutureWarning, "frobnicate() is deprecated")) == 1, messages  # once, not once per rank
    assert not any("Transformer Engine" in m for _, m in messages), messages  # listed noise stays hidden


def test_reraise_keeps_the_category():
    with pytest.warns(DeprecationWarning, match="old API"):
        reraise_warnings(["/x/lib.py:3: DeprecationWarning: old API\n  warnings.warn(\n"])
    with pytest.warns(UserWarning, match="custom"):
        reraise_warnings(["/x/lib.py:4: SomeLibraryWarning: custom\n"])


def test_listed_noise_is_valid_for_pytest_and_explained():
    from pretrain.common.quiet import LIBRARY_NOISE, pytest_filters

    assert all(line.count(":") == 2 for line in pytest_filters())  # action:message:category
    assert all(len(reason) > 20 for _, _, reason in LIBRARY_NOISE)


def _budget_run(tmp_path, budget_minutes, *args):
    """pytest on a two-test suite of its own (one slow test of 1.5 s, one fast), judged by
    suite_budget.py with `budget_minutes`."""
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntestpaths = checks\nslow_tier_budget_minutes = {budget_minutes}\n"
                                         "markers =\n    slow: slow\n")
    (tmp_path / "checks").mkdir(exist_ok=True)
    (tmp_path / "checks" / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from suite_budget import SlowTierBudget, add_budget_option\n"
        "def pytest_addoption(parser):\n    add_budget_option(parser)\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(SlowTierBudget(config))\n")
    (tmp_path / "checks" / "test_two.py").write_text(
        "import time, pytest\n@pytest.mark.slow\ndef test_deliberately_slowed():\n    time.sleep(1.5)\n"
        "def test_fast():\n    pass\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=""))


@pytest.mark.slow  # three pytest sessions of their own
def test_the_slow_tier_budget_fails_a_run_that_passes_it(tmp_path):
    over = _budget_run(tmp_path, 0.02)  # 1.2 s
    assert over.returncode == 1, over.stdout[-2000:]
    assert "2 passed" in over.stdout and "over its budget of 0.02 min" in over.stdout, over.stdout[-2000:]
    assert "s  checks/test_two.py::test_deliberately_slowed" in over.stdout  # the slowest, named
    within = _budget_run(tmp_path, 0.1)  # 6 s
    assert within.returncode == 0 and "of its 0.1-min budget" in within.stdout, within.stdout[-2000:]
    # a run that selects part of the suite is not judged: its total says nothing of CI's
    part = _budget_run(tmp_path, 0.02, "-k", "slowed")
    assert part.returncode == 0 and "budget" not in part.stdout, part.stdout[-2000:]
