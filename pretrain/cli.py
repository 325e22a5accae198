"""The skeleton every command-line program shares (kept free of heavy imports: --help stays fast).

    def main(argv=None) -> int:
        return run_command(parse_args, body, argv, name="fill_mask")

`run_command` hides the libraries' known noise, parses, runs `body(args)` and turns the outcome
into the exit status: 0 done (or the status `body` returns), 1 bad input (a UserError: its
message on stderr, no traceback), 2 bad usage (argparse's own SystemExit(2), or a UsageError),
130 interrupted where the program says what an interruption leaves behind. Anything else is a
bug: its traceback stays. A program with process groups calls `run_distributed` from its body.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from .common.errors import UserError
from .observability.console import configure_logging
from .common.quiet import hide_library_warnings
from .resilience import launch_status

if TYPE_CHECKING:  # the real imports start torch: only run_distributed pays for them
    from .distributed.parallel import LaunchEnv, Parallel

INTERRUPTED = 130  # the shell's status for a process stopped by SIGINT
TERMINATED = 143  # ... and by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that it unwinds as Ctrl-C does (temporary outputs
    removed by their context managers)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def positive_int(text: str) -> int:
    """argparse type of counts and sizes (--tp, --batch-size, ...): 0 or less is bad usage (exit 2,
    argparse's message naming the option), not an error deep in the program."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def accept_launcher_args(parser: argparse.ArgumentParser) -> None:
    """The deepspeed launcher appends --local_rank=N to every program's arguments; the rank is
    read from the environment (LOCAL_RANK), so the flag is accepted and ignored."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def run_command(parse: Callable[[Sequence[str] | None], argparse.Namespace],
                body: Callable[[argparse.Namespace], int | None],
                argv: Sequence[str] | None = None, *,
                name: str | None = None,
                input_errors: tuple[type[Exception], ...] = (),
                interrupted: str | None = None) -> int:
    """Run one program; returns its exit status.

    name: prefixes error lines ("NAME: error: ..."); None gives "error: ..." (the training commands).
    input_errors: further exception types this program reports like a UserError (exit 1), e.g.
        OSError for tools whose every OSError is an unreadable or unwritable file the user named.
    interrupted: what Ctrl-C leaves behind ("no output written"), printed as "NAME: interrupted;
        ..." with exit 130; None lets KeyboardInterrupt through as Python reports it. A
        program that says it also treats SIGTERM so (a scheduler's kill, `timeout`): exit 143.
    Usage errors: argparse prints the usage and raises SystemExit(2) itself; it passes through
    unchanged, so `main` behaves as argparse always did.
    """
    hide_library_warnings()
    configure_logging()  # plain lines until the rank is known (run_distributed)
    args = parse(argv)
    prefix = f"{name}: error: " if name else "error: "
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if interrupted is not None else None
    try:
        return body(args) or 0
    except UserError as error:
        _report(prefix, error)
        return error.exit_status
    except input_errors as error:
        _report(prefix, error)
        return 1
    except KeyboardInterrupt as stop:
        if interrupted is None:
            raise
        terminated = isinstance(stop, Terminated)
        print(f"{name}: {'terminated (SIGTERM)' if terminated else 'interrupted'}; {interrupted}", file=sys.stderr)
        return TERMINATED if terminated else INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _report(prefix: str, error: Exception) -> None:
    """Print the error, and tell launcher.sh (when it started this process) not to restart and to
    repeat the message as the job's last line, after what the launching tool prints."""
    print(f"{prefix}{error}", file=sys.stderr)
    launch_status.failed(launch_status.own_rank(), str(error))


def run_distributed(work: Callable[["Parallel"], int | None], tensor_parallel: int, pipeline_parallel: int = 1,
                    timeout_minutes: float = 10.0, launch: "LaunchEnv | None" = None,
                    rendezvous_timeout_minutes: float = 10.0, context_parallel: int = 1) -> int:
    """Start the process groups, run `work(parallel)`, shut the groups down (also on error);
    returns work's exit status (None: 0).

    launch: where this rank sits (default: discovered from the launcher's variables). It is
    exported to os.environ first, because DeepSpeed (its engine, deepspeed.comm, PipelineModule)
    reads RANK, LOCAL_RANK and the master address from there, not from us. With tensor
    parallelism CUDA_DEVICE_MAX_CONNECTIONS=1 is set there too (unless the user set it), before
    any CUDA context exists, whichever launcher started the rank (pretrain/distributed/device.py), and torch's
    hang diagnostics are switched on (flight recorder; on NCCL dump on timeout, desync report).
    JIT-built extensions go to the environment's own directory (device.prepare_extensions_dir).
    Every rank meets the same bad input: only the logging rank raises the UserError (for
    run_command to print), the others return its status quietly, so it is printed once; every
    rank tells launcher.sh not to restart (pretrain/resilience/launch_status.py), the others here.
    """
    from .distributed.device import prepare_cuda_environment, prepare_extensions_dir, prepare_hang_diagnostics
    from .distributed.parallel import discover_launch_env, init_parallel, shutdown_parallel

    launch = discover_launch_env() if launch is None else launch
    launch.export_to(os.environ)
    launch_status.register(launch.rank)
    prepare_cuda_environment(tensor_parallel)  # before init_parallel makes this rank's CUDA context
    prepare_hang_diagnostics()
    prepare_extensions_dir()
    parallel = init_parallel(launch, tensor_parallel, pipeline_parallel, timeout_minutes, rendezvous_timeout_minutes,
                             context_parallel=context_parallel)
    configure_logging(parallel.rank, parallel.world_size, parallel.logging_rank)
    try:
        return work(parallel) or 0
    except UserError as error:
        if parallel.rank == parallel.logging_rank:
            raise
        launch_status.failed(parallel.rank, str(error))  # a restart would meet it again
        return error.exit_status
    finally:
        shutdown_parallel()
