"""What the benchmarks share, so that each script keeps only what it measures: the one-rank world a
single-process measurement runs in, the alternating timing loop, and the JSON figures file.

Scripts run as `python tools/benchmarks/NAME.py` put the repository on sys.path and import this as
`tools.benchmarks.harness` (tests import the scripts the same way); tools/gpu/bench.py too.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from pretrain.distributed.ports import free_port


def one_rank_world(tensor_parallel: int = 1, pipeline_parallel: int = 1):
    """The Parallel of a one-process gloo world: rank 0 of 1 at 127.0.0.1 on a free port, the launch
    variables exported (DeepSpeed reads LOCAL_RANK and the master address from the environment), the
    libraries' known noise hidden (pretrain/common/quiet.py) before torch is imported here and
    DeepSpeed's info lines off (a benchmark prints its own figures)."""
    import logging

    from pretrain.common.quiet import hide_library_warnings

    hide_library_warnings()
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    from pretrain.distributed.parallel import discover_launch_env, init_parallel

    launch = discover_launch_env()
    launch.export_to(os.environ)
    return init_parallel(launch, tensor_parallel, pipeline_parallel)


def alternate(sides: Mapping[str, Callable[[int], Any]], steps: int, untimed: int = 1
              ) -> dict[str, list[tuple[float, Any]]]:
    """Round by round, each side's `step(round)` in turn, so that the machine's drift falls on every
    side alike; the first `untimed` rounds are not timed (start-up, first-touch, caches). Per side,
    the timed rounds' (seconds, what step returned)."""
    timed: dict[str, list[tuple[float, Any]]] = {name: [] for name in sides}
    for round_ in range(untimed + steps):
        for name, step in sides.items():
            started = time.perf_counter()
            result = step(round_)
            if round_ >= untimed:
                timed[name].append((time.perf_counter() - started, result))
    return timed


def token_rates(rounds: list[tuple[float, tuple[float, float]]]) -> dict[str, float]:
    """Rates of `alternate`'s rounds whose step returned (real tokens, computed tokens): real tokens are
    the work (padding is not), computed ones what the model ran over."""
    seconds = sum(s for s, _ in rounds)
    real = sum(r for _, (r, _) in rounds)
    computed = sum(c for _, (_, c) in rounds)
    return {"real_tokens_per_second": real / seconds, "computed_tokens_per_second": computed / seconds,
            "seconds_per_step": seconds / len(rounds), "real_share_of_computed": real / computed}


def launch_ranks(argv: list[str], ranks: int, threads: int, what: str) -> dict:
    """`python ARGV... --child-out OUT` as `ranks` processes of one world on this machine (127.0.0.1,
    a free port, the CPU: no test device), each with `threads` threads; what rank 0 wrote to OUT.
    A failed rank: the ranks' output tails, and an exit naming `what`."""
    import subprocess
    import sys
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        port = str(free_port())
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), RANK=str(rank),
                       LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       BERT_FAKE_GPU="0", PYTHONPATH=str(repo))
            procs.append(subprocess.Popen([sys.executable, *argv, "--child-out", str(out)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs) or not out.exists():
            sys.stderr.write("\n".join(o[-4000:] for o in outputs))
            raise SystemExit(f"{what} failed")
        return json.loads(out.read_text())


# a child's environment that keeps freed memory in the process, as a GPU's caching allocator does (glibc
# otherwise returns large blocks, and each step's fresh temporaries cost page faults)
KEEP_FREED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**32)}


def run_json_child(script: str | os.PathLike, argv: list[str], what: str, env: Mapping[str, str] | None = None) -> dict:
    """`python SCRIPT ARGV...` in the repository with `env` added to this environment; the JSON object
    its last line of output holds. A failed child: the end of its stderr, and an exit naming `what`."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, cwd=repo,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"{what} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_json(path: str | os.PathLike | None, payload: Any, indent: int = 1) -> None:
    """The figures as JSON at `path` (nothing when None), written whole: a file that exists is complete."""
    if path is None:
        return
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=indent) + "\n")
    partial.replace(path)
