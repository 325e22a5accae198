"""Two "nodes" on one machine: network namespaces joined by a veth pair on a private subnet.

Each namespace has only loopback and its end of the pair, renamed IFNAME, so ranks must use
GLOO_SOCKET_IFNAME=IFNAME and the addresses below: exactly what a two-host job needs. The
namespaces (and with them the veth pair) are deleted on exit, after killing whatever still
runs inside, whether the body passed or failed.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

IFNAME = "bert0"
SUBNET = "10.77.0"  # lives only inside the namespaces, so it cannot collide with the host's


@dataclass
class Node:
    namespace: str
    address: str

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def cannot_create_reason() -> str | None:
    """Why namespaces cannot be made here (None if they can): the test's skip reason."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    probe = f"bertprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` failed (needs root / CAP_SYS_ADMIN): {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def _delete(namespace: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), 9)
    _ip("netns", "del", namespace)


@contextlib.contextmanager
def two_nodes():
    tag = os.getpid() % 100000
    nodes = [Node(f"bertnode{tag}a", f"{SUBNET}.1"), Node(f"bertnode{tag}b", f"{SUBNET}.2")]
    ends = [f"vb{tag}a", f"vb{tag}b"]
    try:
        for node in nodes:
            _run("netns", "add", node.namespace)
        _run("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for node, end in zip(nodes, ends):
            _run("link", "set", end, "netns", node.namespace)
            ns = ["-n", node.namespace]
            _run(*ns, "link", "set", end, "name", IFNAME)
            _run(*ns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
            _run(*ns, "link", "set", IFNAME, "up")
            _run(*ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for node in nodes:
            _delete(node.namespace)
        _ip("link", "del", ends[0])  # only left over if the move into a namespace failed


def _run(*args: str) -> None:
    result = _ip(*args)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
