"""Start N ranks of a Python script as separate processes (what torchrun does), for tests.

Every rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR=127.0.0.1/MASTER_PORT; a hang or a
crash fails the caller with every rank's output instead of blocking the test run. Warnings the
ranks print are raised again in the test process (once each), so that pytest's summary shows a
library's new deprecation instead of losing it in a passing rank's output.

The CPU tiers never see a GPU: the test session hides them (`hide_gpus`, from conftest.py) before
anything starts CUDA, so every rank and program a test starts, and the test process itself, select
the CPU as they do in CI, also on a GPU machine; the GPU tier hands them back (`gpu_env`).
"""
from __future__ import annotations

import atexit
import builtins
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from pretrain.distributed.ports import PortPicker

# The session's one picker: tests start jobs side by side (and a job binds its port seconds after
# the draw), so no two draws of the session may return the same port. The tests take it from here.
free_port = PortPicker()

REPO = Path(__file__).resolve().parents[1]
# CUDA_VISIBLE_DEVICES as the test session found it ("" for unset: every GPU), for the GPU tier
SESSION_GPUS_ENV = "BERT_TESTS_SESSION_GPUS"


def hide_gpus() -> None:
    """Hide every GPU from this process and whatever it starts (before CUDA is initialised)."""
    if SESSION_GPUS_ENV not in os.environ:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ[SESSION_GPUS_ENV] = "unset" if visible is None else f"set:{visible}"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def gpu_env(**extra) -> dict:
    """The environment of a GPU-tier subprocess: the GPUs the session found, plus `extra`. A value
    of None removes the variable (child_env)."""
    session = os.environ.get(SESSION_GPUS_ENV, "unset")
    return {"CUDA_VISIBLE_DEVICES": None if session == "unset" else session[len("set:"):], **extra}


def child_env(*overlays: dict | None) -> dict:
    """os.environ with the overlays applied in order; a value of None removes the variable."""
    env = dict(os.environ)
    for overlay in overlays:
        for key, value in (overlay or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return env


def session_gpu_count() -> int:
    """How many GPUs the session's own CUDA_VISIBLE_DEVICES shows, asked of torch in a child (this
    process must not initialise CUDA: its in-process tests belong to the CPU tiers)."""
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count() "
                           "if torch.cuda.is_available() else 0)"], env=child_env(gpu_env()), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"counting the GPUs failed: {done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1])




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


# how the warnings module prints one: "path.py:12: FutureWarning: message"
WARNING_LINE = re.compile(r"^(?P<file>\S+\.py):(?P<line>\d+): (?P<category>\w+Warning): (?P<message>.*)$", re.M)


def reraise_warnings(outputs: list[str]) -> None:
    """Warn, in this process, each distinct warning the ranks printed, with its category (so the
    session's filters, pretrain/common/quiet.py's list among them, apply as they do in-process)."""
    seen = set()
    for text in outputs:
        for m in WARNING_LINE.finditer(text):
            key = (m["file"], m["line"], m["category"], m["message"])
            if key in seen:
                continue
            seen.add(key)
            category = getattr(builtins, m["category"], None)
            if not (isinstance(category, type) and issubclass(category, Warning)):
                category = UserWarning
            warnings.warn_explicit(m["message"], category, m["file"], int(m["line"]), module="rank")


# BERT_TESTS_ZYGOTE=0 starts every rank as a fresh interpreter (zygote.py: the session's server that
# forks ranks with torch, DeepSpeed and megatron-core already imported)
ZYGOTE_ENV = "BERT_TESTS_ZYGOTE"


# Zygotes per session: forked children share their server's string-hash secret, so the ranks of a
# job alternate between two servers to differ in it as fresh interpreters do (a set iterated in
# another order on another rank stays visible)
ZYGOTES = 2


@functools.lru_cache(maxsize=None)
def _spawned_zygote(index: int):
    """The session's zygote `index`, started and not waited for (ended when the session's process exits)."""
    from zygote import Zygote

    server_env = child_env(dict(PYTHONPATH=ranks_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                                PYTHONHASHSEED=None))
    zygote = Zygote(str(REPO), server_env, os.path.join(tempfile.mkdtemp(prefix="bert-zygote-"), "socket"))
    atexit.register(zygote.close)
    return zygote


def start_session_zygotes() -> None:
    """Start every zygote of the session without waiting for their imports (about 4 s each), so
    that they load on a free core while the first tests run (conftest, after collection)."""
    if os.environ.get(ZYGOTE_ENV, "1") not in ("", "0"):
        for index in range(ZYGOTES):
            _spawned_zygote(index)


def session_zygote(index: int = 0):
    """The session's zygote `index`, ready (started on first use unless start_session_zygotes did)."""
    zygote = _spawned_zygote(index)
    if zygote.wait_ready():
        reraise_warnings([zygote.import_output])  # the imports' warnings, printed once by the server
    return zygote


@functools.lru_cache(maxsize=None)
def _zygote_python() -> tuple[str, dict] | None:
    """A folder holding `python` (and `python3`) that forks programs from the session's zygotes
    (tests/zygote_python.py), and the variables it reads; None with BERT_TESTS_ZYGOTE=0."""
    if os.environ.get(ZYGOTE_ENV, "1") in ("", "0"):
        return None
    folder = tempfile.mkdtemp(prefix="bert-zygote-python-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for name in ("python", "python3"):
        wrapper = os.path.join(folder, name)
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{REPO / "tests" / "zygote_python.py"}" '
                    f'"{sys.executable}" "{wrapper}" "$@"\n')
        os.chmod(wrapper, 0o755)
    return folder, {"BERT_TESTS_ZYGOTE_SOCKETS": os.pathsep.join(session_zygote(i).socket_path for i in range(ZYGOTES)),
                    "BERT_TESTS_ZYGOTE_PYTHONPATH": ranks_pythonpath(),
                    "BERT_TESTS_ZYGOTE_LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}


def shell_env(**variables: str) -> dict:
    """The environment of a shell command a test runs as a user would (a documented block): this
    session's Python first on PATH, one thread per process, and `python` (with launcher.sh and the
    ranks torchrun starts from it) forked from the session's zygote as `start_python` forks the
    tests' own programs, where `forkable` allows."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **variables)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    return with_zygote_python(env)


def with_zygote_python(env: dict) -> dict:
    """`env` with the zygote's `python` first on its PATH (see shell_env); for a launch whose
    processes are ended by the programs themselves, not by a test signalling a process group or
    looking processes up by pid (zygote_python.py)."""
    served = _zygote_python()
    if served is None:
        return env
    folder, zygote_variables = served
    return dict(env, **zygote_variables, PATH=folder + os.pathsep + env.get("PATH", os.environ["PATH"]))


def ranks_pythonpath() -> str:
    return f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def _path_entries(value: str | None) -> set[str]:
    return {os.path.abspath(entry) for entry in (value or "").split(os.pathsep) if entry}


def forkable(env: dict) -> bool:
    """Whether a program with `env` may be forked from the zygote: not on the GPU tier (a process
    whose CUDA is its own from the start), nothing on its PYTHONPATH the server's lacks (a stand-in
    torch or sitecustomize there must be loaded at start-up), no other LD_PRELOAD and no fixed
    PYTHONHASHSEED (both act at start-up), and not BERT_TESTS_ZYGOTE=0."""
    return (env.get("CUDA_VISIBLE_DEVICES", "") == "" and os.environ.get(ZYGOTE_ENV, "1") not in ("", "0")
            and _path_entries(env.get("PYTHONPATH")) <= _path_entries(ranks_pythonpath())
            and env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD") and "PYTHONHASHSEED" not in env)


def start_python(args: list[str], env: dict, cwd=REPO, separate_stderr: bool = False, children_too: bool = False,
                 output=None):
    """`python ARGS...` (text output; stderr with stdout, or apart; or both into the open file
    `output`): forked from the session's zygote where `forkable`, else a fresh interpreter. children_too: the Python processes it starts itself
    (multiprocessing's forkserver of the data loaders) come from the zygote as well, through the
    `python` of `shell_env` as its sys.executable (not for a program that ends its children with a
    process group's SIGKILL: the zygote's child would outlive the `python` standing for it)."""
    if not forkable(env):
        return subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=output or subprocess.PIPE,
                                stderr=subprocess.PIPE if separate_stderr and output is None else subprocess.STDOUT,
                                text=True)
    executable, served = None, _zygote_python() if children_too else None
    if served is not None:
        folder, zygote_variables = served
        env, executable = {**env, **zygote_variables}, os.path.join(folder, "python")
    rank = env.get("RANK", "0")
    return session_zygote(int(rank) % ZYGOTES if rank.isdigit() else 0).start(args, env, cwd, separate_stderr,
                                                                             executable, output)


def run_python(args: list[str], env: dict | None = None, cwd=REPO, timeout: float = 600, children_too: bool = False
               ) -> subprocess.CompletedProcess:
    """subprocess.run([python, *args], capture_output=True, text=True) through start_python (with
    its children_too): a CompletedProcess with stdout and stderr apart; a process past `timeout` is
    killed and TimeoutExpired raised, as subprocess.run does."""
    proc = start_python(args, dict(os.environ) if env is None else env, cwd, separate_stderr=True,
                        children_too=children_too)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess([sys.executable, *args], proc.returncode, out, err)


def run_ranks(args: list[str], nprocs: int, timeout: float = 600, env: dict | None = None,
              expect_success: bool = True) -> list[subprocess.CompletedProcess]:
    port = free_port()
    base = child_env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nprocs),
                          PYTHONPATH=ranks_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                          # what pretrain/cli.py sets with tensor parallelism (workers start the groups themselves)
                          CUDA_DEVICE_MAX_CONNECTIONS="1"), env)
    procs = []
    for rank in range(nprocs):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(start_python(args, rank_env, children_too=True))
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
    reraise_warnings([o.stdout or "" for o in outputs])
    if expect_success and any(o.returncode != 0 for o in outputs):
        dump = "\n".join(f"--- rank {r} (exit {o.returncode}) ---\n{o.stdout[-4000:]}" for r, o in enumerate(outputs))
        raise AssertionError(f"a rank failed:\n{dump}")
    return outputs
