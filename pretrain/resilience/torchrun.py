"""torchrun as launcher.sh runs it: `python -m pretrain.resilience.torchrun ARGS` is
`python -m torch.distributed.run ARGS` (same options, same agent, same exit status 0 or 1), except
that a failed job ends with one line per failed rank instead of the agent's ChildFailedError
traceback and report box, and a signal to the agent with one line instead of its SignalException
traceback. The ranks have printed their own errors already; launcher.sh repeats the failing rank's
one-line error last."""
from __future__ import annotations

import signal
import socket
import sys


def describe(rank: int, failure) -> str:
    """One line for one of torch's ProcessFailure records."""
    where = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}, {socket.gethostname()})"
    if failure.exitcode < 0:
        return f"{where} was killed by {failure.signal_name()}"
    return f"{where} exited with status {failure.exitcode}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as failed:
        for rank, failure in sorted(failed.failures.items()):
            print(f"torchrun: {describe(rank, failure)}", file=sys.stderr)
        return 1
    except SignalException as received:
        print(f"torchrun: ended by {signal.Signals(received.sigval).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
