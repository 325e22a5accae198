"""A rendezvous port for a job started on this machine (a lone tool, a sweep's slot, a test).

Asking the kernel for port 0 returns a port from its ephemeral range, and that port is free only
for the moment: once our probe socket closes, any outgoing connection on the machine (another job's
ranks reaching their store, a download) may be given the same port as its local end, and the job's
store then fails with EADDRINUSE. So the port is drawn from below the ephemeral range, where the
kernel never hands ports out by itself, and probed before it is returned. `span` asks for that many
consecutive free ports: launcher.sh rendezvouses at --master-port + k on its k-th restart.

A port is free until its job binds it, which may be seconds after the draw: a caller that starts
several jobs before the first binds (a sweep's slots, a test starting jobs side by side) draws
through one PortPicker, which never hands out the same port twice. Independent draws collide about
once in 20,000 pairs, and the second job then fails with EADDRINUSE.
"""
from __future__ import annotations

import secrets
import socket
import threading

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below: well-known and registered services' ports
ATTEMPTS = 200


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's (low, high) range for ports it picks itself, or None where it does not say."""
    try:
        with open(path) as f:
            low, high = (int(word) for word in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))  # every address, as the store binds
        except OSError:
            return False
    return True


def free_port(span: int = 1, range_file: str = EPHEMERAL_RANGE_FILE) -> int:
    """A port p with p .. p + span - 1 free now and outside the kernel's ephemeral range."""
    kernel_range = ephemeral_range(range_file)
    if kernel_range is not None:
        low, high = kernel_range
        # the wider of the two gaps the ephemeral range leaves above LOWEST_PORT
        gaps = [(LOWEST_PORT, low - span), (high + 1, 65536 - span)]
        start, stop = max(gaps, key=lambda gap: gap[1] - gap[0])
        if stop - start >= 100:
            for _ in range(ATTEMPTS):
                port = start + secrets.randbelow(stop - start)  # not `random`: a seeded run would repeat it
                if all(_bindable(port + k) for k in range(span)):
                    return port
    # no usable gap (or every probe taken): the kernel's own pick, the best there is
    for _ in range(ATTEMPTS):
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if all(_bindable(port + k) for k in range(span)):
            return port
    raise OSError(f"no {span} consecutive free TCP port(s) found on this machine")


class PortPicker:
    """free_port for a caller that starts several jobs at once: no port (nor any port of a
    span) is handed out twice by the same picker, whatever the threads calling it."""

    def __init__(self):
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, span: int = 1, range_file: str = EPHEMERAL_RANGE_FILE) -> int:
        with self._lock:
            for _ in range(ATTEMPTS):
                port = free_port(span, range_file)
                block = set(range(port, port + span))
                if not block & self._given:
                    self._given |= block
                    return port
        raise OSError(f"no {span} consecutive free TCP port(s) left that this picker has not handed out")
