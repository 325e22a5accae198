"""What each rank tells the launcher that started it (launcher.sh), through files in the directory
it names in BERT_LAUNCH_STATUS_DIR (nothing happens without it):

- pid-<rank>: this rank's process id, written at start, so that a SIGTERM the launcher receives
  reaches the ranks themselves and not only the tool between them (torchrun's agent answers a
  SIGTERM by killing its workers 30 s later; DeepSpeed's launcher likewise);
- rank-<rank>: how the rank ended when the launcher must know more than an exit status: "stopped
  MESSAGE" (a SIGTERM or time limit: a complete checkpoint was saved, so the job exits 0 whatever
  the tool between reports, and the launcher says so) or "failed MESSAGE" (bad input, non-finite
  training: restarting would fail the same way, so the launcher does not restart, and it repeats
  MESSAGE as the job's last line, after the launching tool's own report).
"""
from __future__ import annotations

import os
from pathlib import Path

STATUS_DIR_ENV = "BERT_LAUNCH_STATUS_DIR"


def _directory() -> Path | None:
    path = os.environ.get(STATUS_DIR_ENV)
    return Path(path) if path and os.path.isdir(path) else None


def _write(name: str, text: str) -> None:
    directory = _directory()
    if directory is None:
        return
    temporary = directory / f".{name}.tmp-{os.getpid()}"
    try:
        temporary.write_text(text + "\n", encoding="utf-8")
        os.replace(temporary, directory / name)  # the launcher never reads half a line
    except OSError:  # the launcher's own directory: its absence costs only the status
        pass


# Where each launcher puts the process's rank: torchrun and DeepSpeed (and cli.run_distributed, for
# every launcher), SLURM, MPICH, Open MPI.
_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def own_rank() -> int:
    """This process's rank as its launcher gave it (0 for a lone process)."""
    found = next((os.environ[name] for name in _RANK_VARIABLES if os.environ.get(name, "").isdigit()), "0")
    return int(found)


def register(rank: int) -> None:
    _write(f"pid-{rank}", str(os.getpid()))


def stopped(rank: int, message: str) -> None:
    _write(f"rank-{rank}", f"stopped {message}")


def failed(rank: int, message: str) -> None:
    _write(f"rank-{rank}", "failed " + " ".join(message.split()))  # one line
