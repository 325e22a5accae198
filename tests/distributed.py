"""Start N ranks of a Python script as separate processes (what torchrun does), for tests.

Every rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR=127.0.0.1/MASTER_PORT; a hang or a
crash fails the caller with every rank's output instead of blocking the test run.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_or_kill(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process until a shared deadline; kill whatever still runs after it."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_ranks(args: list[str], nprocs: int, timeout: float = 600, env: dict | None = None,
              expect_success: bool = True) -> list[subprocess.CompletedProcess]:
    port = free_port()
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs),
                PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    procs = []
    for rank in range(nprocs):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        dump = "\n".join(f"--- rank {r} ---\n{(p.communicate()[0] or '')[-3000:]}" for r, p in enumerate(procs))
        raise AssertionError(f"ranks did not finish within {timeout}s:\n{dump}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if expect_success and any(o.returncode != 0 for o in outputs):
        dump = "\n".join(f"--- rank {r} (exit {o.returncode}) ---\n{o.stdout[-4000:]}" for r, o in enumerate(outputs))
        raise AssertionError(f"a rank failed:\n{dump}")
    return outputs
