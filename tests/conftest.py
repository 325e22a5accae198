import os
import sys

import pytest

# tests import their helpers (distributed.py) by module name
sys.path.insert(0, os.path.dirname(__file__))

# Subprocesses (launcher.sh, mpiexec, deepspeed) find this interpreter's environment first, so
# `.venv/bin/python -m pytest` works without activating the venv.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

REQUIRE_GPU_ENV = "REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu(n=1): needs n CUDA GPUs. Skipped with the reason on a machine without CUDA; fails instead "
                   "of skipping where CUDA is present (too few GPUs) or REQUIRE_GPU=1.")


def gpu_shortfall(needed: int) -> str | None:
    """Why a test needing `needed` GPUs cannot run here, or None when it can."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available >= needed:
        return None
    return f"needs {needed} CUDA GPU(s), this machine has {available}"


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    needed = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    reason = gpu_shortfall(needed)
    if reason is None:
        return
    import torch

    if os.environ.get(REQUIRE_GPU_ENV, "0") not in ("", "0") or torch.cuda.is_available():
        pytest.fail(f"GPU test {item.nodeid} {reason} ({REQUIRE_GPU_ENV}={os.environ.get(REQUIRE_GPU_ENV, 'unset')}, "
                    f"CUDA {'present' if torch.cuda.is_available() else 'absent'}): GPU tests fail rather than skip "
                    "where a GPU is expected", pytrace=False)
    pytest.skip(f"GPU test: {reason}")
