"""A hang becomes a diagnosis: every rank watches its own progress and, when nothing finished for
the time the current phase allows, writes what it was doing, which rank is stuck and every thread's
stack to its log, then ends the process (exit status 124, as `timeout` uses) so that the launcher
ends the job and may restart it.

- Progress: the trainer calls `progress()` when a training step, an evaluation step or a save
  finishes, and `doing()` when it enters a phase (data, step, evaluation, save, ...).
- Limits: one per kind of phase, because a save on a busy parallel file system, or a start-up that
  loads a checkpoint and builds every communicator, may rightly take longer than any step:
  "start-up" (until the first step finished: resilience.startup_timeout_minutes), "step" (steps and
  evaluations: resilience.hang_timeout_minutes) and "save" (resilience.save_timeout_minutes). The
  trainer says which applies (`limit()`, `limited()`); 0 = no limit in that kind of phase.
- Heartbeats: a thread of every rank publishes a small record (a counter, step, phase, pid, host,
  and its collectives as torch's flight recorder counts them: enqueued and completed per process
  group) to the job's key-value store (the rendezvous TCPStore) every few seconds. A rank whose
  counter stops moving is frozen or gone; a rank that entered fewer collectives of a group than
  the group's other members is the one they wait for. Either way the others can name it.
- The dump: faulthandler's traceback of every thread (the stuck rank's own shows the wait it is
  in), the loader processes' states, the flight recorder's last collective.

Nothing here touches the devices or the process groups: a hang may hold either.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, TextIO

HUNG_EXIT_STATUS = 124
KEY_PREFIX = "bert-watchdog/"


# ----------------------------------------------------------------------------- collectives
def flight_recorder_status(with_last: bool = True) -> tuple[dict[str, list[int]], str]:
    """({process group: [last enqueued, last completed] collective}, the last collective recorded)
    from torch's flight recorder (TORCH_FR_BUFFER_SIZE > 0, set by pretrain/cli.py); ({}, "") when
    it records nothing. Without `with_last` only the counters are read (and "" given for the last):
    the recorder's entries are ~1 MB of JSON at 2,000 of them, 35-140 ms of this process's GIL to
    dump and parse (measured on the CPU), which a heartbeat every few seconds must not spend."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = json.loads(_dump_fr_trace_json(includeCollectives=with_last))
    except Exception:  # an older torch, or no recorder: the heartbeat goes without
        return {}, ""
    groups = {pg: [int(s.get("last_enqueued_collective", -1)), int(s.get("last_completed_collective", -1))]
              for pg, s in (trace.get("pg_status") or {}).items()}
    entries = trace.get("entries") or []
    last = ""
    if entries:
        e = entries[-1]
        kind = f"p2p #{e.get('p2p_seq_id')}" if e.get("is_p2p") else f"collective #{e.get('collective_seq_id')}"
        name = (e.get("process_group") or ["?"])[0]
        sizes = e.get("input_sizes") or []
        state = "completed" if groups.get(name, [0, -1])[1] >= int(e.get("collective_seq_id", 0)) and not e.get("is_p2p") \
            else e.get("state", "?")
        last = f"{e.get('profiling_name', '?')} ({kind} of process group {name}, sizes {sizes}, {state})"
    return groups, last


# ----------------------------------------------------------------------------- heartbeats
class Heartbeats:
    """Every rank's latest heartbeat, kept in the job's TCPStore under bert-watchdog/<rank>.

    Its own client connection with a short timeout: a store that does not answer (its host, rank
    0, is frozen) must not hang the watchdog too.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_seconds: float = 20.0):
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.address = f"{host}:{port}"
        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_seconds),
                                    wait_for_workers=False)

    def publish(self, record: dict) -> None:
        self._store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(record))

    def read(self) -> dict[int, dict]:
        """Every rank's last record (ranks that never published are left out)."""
        keys = [f"{KEY_PREFIX}{r}" for r in range(self.world_size)]
        present = [r for r, key in enumerate(keys) if self._store.check([key])]
        return {r: json.loads(v) for r, v in zip(present, self._store.multi_get([keys[r] for r in present]))}


def stuck_ranks(before: dict[int, dict], after: dict[int, dict], world_size: int) -> tuple[list[int], list[str]]:
    """From two reads of the heartbeats some seconds apart: (the ranks the job waits for, one line
    per finding). Silent ranks (no heartbeat, or a counter that did not move) come first; else the
    ranks that entered fewer collectives of a process group than its other members did."""
    lines, stuck = [], []
    for r in range(world_size):
        if r not in after:
            stuck.append(r)
            lines.append(f"rank {r}: never published a heartbeat (did not start, or died before training)")
        elif r in before and before[r]["beat"] == after[r]["beat"]:
            h = after[r]
            stuck.append(r)
            lines.append(f"rank {r} (host {h['host']}, pid {h['pid']}): heartbeat stopped at step {h['step']}, "
                         f"{h['phase']} - the process is frozen (stopped, in a debugger, swapping) or gone")
    if stuck:
        return stuck, lines
    live = {r: h for r, h in after.items()}
    groups: dict[str, dict[int, int]] = {}
    for r, h in live.items():
        for pg, (enqueued, _) in (h.get("collectives") or {}).items():
            groups.setdefault(pg, {})[r] = enqueued
    behind: dict[int, list[str]] = {}
    for pg, entered in groups.items():
        most = max(entered.values())
        for r, n in entered.items():
            if n < most:
                behind.setdefault(r, []).append(f"group {pg}: entered collective #{n}, others #{most}")
    for r in sorted(behind):
        h = live[r]
        stuck.append(r)
        lines.append(f"rank {r} (host {h['host']}, pid {h['pid']}): behind the others ({'; '.join(behind[r])}) "
                     f"at step {h['step']}, {h['phase']}")
    if not stuck:
        lines.append("no rank is behind: every rank waits at the same place")
    return stuck, lines


# ----------------------------------------------------------------------------- the watchdog
@dataclass
class _Activity:
    step: int = 0
    phase: str = "start-up"
    kind: str = "start-up"  # whose limit applies (KINDS)
    last_progress: float = field(default_factory=time.monotonic)
    what_finished: str = "nothing yet"


def process_state(pid: int) -> str:
    """A process's state as Linux reports it ("S (sleeping)", "T (stopped)", ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


# kind of phase -> (minutes without progress it allows, 0 = no limit; the setting that says so)
Limits = dict[str, tuple[float, str]]
KINDS = ("start-up", "step", "save")


class Watchdog:
    """One per rank; `start()` runs its thread, `stop()` ends it. With every limit 0 it is off:
    `doing()` and `progress()` are then plain attribute writes and no thread starts.

    limits: per kind of phase (KINDS); one number is the same limit for every kind, named
    `resilience.hang_timeout_minutes` (or `key`).
    local_report: extra lines about this rank at the dump (its loader processes).
    """

    def __init__(self, limits: Limits | float, rank: int, world_size: int, heartbeats: Heartbeats | None,
                 local_report: Callable[[], list[str]] = lambda: [], stream: TextIO | None = None,
                 end: Callable[[int], None] = os._exit, interval: float | None = None,
                 key: str = "resilience.hang_timeout_minutes"):
        if not isinstance(limits, dict):
            limits = {kind: (float(limits), key) for kind in KINDS}
        unknown = set(limits) - set(KINDS)
        if unknown:
            raise ValueError(f"watchdog limits for unknown kinds of phase {sorted(unknown)} (known: {KINDS})")
        self.limits = {kind: (minutes * 60, name) for kind, (minutes, name) in limits.items()}
        self.timeout = max((seconds for seconds, _ in self.limits.values()), default=0.0)  # 0: no thread
        self.rank, self.world_size = rank, world_size
        self.heartbeats = heartbeats
        self.local_report = local_report
        self.stream = stream or sys.stderr
        self.end = end
        # heartbeats: a few per (shortest) limit, at most 5 s apart (a set on the store each: cheap)
        shortest = min((seconds for seconds, _ in self.limits.values() if seconds), default=0.0)
        self.interval = interval or min(5.0, max(0.5, shortest / 20))
        self._activity = _Activity()
        self._beat = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, limits: Limits | float, parallel, local_report: Callable[[], list[str]] = lambda: [],
                key: str = "resilience.hang_timeout_minutes") -> "Watchdog":
        """The watchdog of this rank of a job started by init_parallel: heartbeats on the job's
        store (when it has one) so that the ranks can name the stuck one."""
        dog = cls(limits, parallel.rank, parallel.world_size, None, local_report, key=key)
        if dog.timeout and parallel.store_address:
            dog.heartbeats = Heartbeats(*parallel.store_address, parallel.rank, parallel.world_size)
        return dog

    # called by the trainer (main thread); plain attribute writes, read by the watchdog thread
    def limit(self, kind: str) -> None:
        """From now on the limit of this kind of phase applies (KINDS)."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind of phase {kind!r} (known: {KINDS})")
        self._activity.kind = kind

    @contextlib.contextmanager
    def limited(self, kind: str):
        """The limit of `kind` while the block runs, then the one before it again."""
        before = self._activity.kind
        self.limit(kind)
        try:
            yield
        finally:
            self._activity.kind = before

    def doing(self, phase: str, step: int | None = None) -> None:
        self._activity.phase = phase
        if step is not None:
            self._activity.step = step

    def progress(self, what: str, step: int | None = None) -> None:
        self._activity.what_finished = what
        if step is not None:
            self._activity.step = step
        self._activity.last_progress = time.monotonic()

    def start(self) -> "Watchdog":
        self._activity.last_progress = time.monotonic()
        if not self.timeout:
            return self
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="bert-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # the thread
    def _record(self, with_last: bool = False) -> dict:
        """This rank's heartbeat: the peers read its collective counters; the last collective is
        read only for this rank's own account (_fire)."""
        a = self._activity
        collectives, last = flight_recorder_status(with_last)
        self._beat += 1
        return {"beat": self._beat, "step": a.step, "phase": a.phase, "pid": os.getpid(), "host": socket.gethostname(),
                "idle_seconds": round(time.monotonic() - a.last_progress, 1), "collectives": collectives,
                "last_collective": last}

    def _publish(self, with_last: bool = False) -> dict:
        record = self._record(with_last)
        if self.heartbeats is not None:
            try:
                self.heartbeats.publish(record)
            except Exception:  # the store's host may be the frozen rank; the local dump still comes
                pass
        return record

    def _current_limit(self) -> tuple[float, str]:
        """(seconds, 0 = none; the setting) of the kind of phase the rank is in."""
        return self.limits.get(self._activity.kind, (0.0, ""))

    def _run(self) -> None:
        self._publish()  # at once: a rank frozen before its first interval is still known to have started
        while not self._stopped.wait(self.interval):
            self._publish()
            seconds, _ = self._current_limit()
            if seconds and time.monotonic() - self._activity.last_progress > seconds:
                self._fire()
                return

    def _fire(self) -> None:
        """This rank's own account and stacks first (a peer ending meanwhile may end this process
        through a failed collective), then who the job waits for; then stay a few heartbeats so
        that the others can still read this rank's heartbeat (and store) for their own accounts."""
        a = self._activity
        record = self._publish(with_last=True)
        idle = time.monotonic() - a.last_progress
        seconds, key = self._current_limit()
        lines = [f"watchdog: rank {self.rank} (host {record['host']}, pid {record['pid']}) made no progress for "
                 f"{idle / 60:.1f} min ({a.kind}: {key}={seconds / 60:g}): at step {a.step}, "
                 f"{a.phase}; last finished: {a.what_finished}",
                 f"watchdog: rank {self.rank}: last collective {record['last_collective'] or 'unknown'}"]
        lines += [f"watchdog: rank {self.rank}: {line}" for line in self.local_report()]
        self._write(lines, stacks=True)
        self._write([f"watchdog: rank {self.rank}: {line}" for line in self._peers()])
        for _ in range(3):
            time.sleep(self.interval)
            self._publish()
        self._write([f"watchdog: rank {self.rank}: ending the process (exit {HUNG_EXIT_STATUS})"])
        self.end(HUNG_EXIT_STATUS)

    def _peers(self) -> list[str]:
        """Who the job waits for, from two reads of the heartbeats a few intervals apart (one read
        tells who is behind in the collectives; two tell whose heartbeat stopped)."""
        if self.heartbeats is None:
            return []
        unanswered = (f"the job's store at {self.heartbeats.address} (served by rank 0, or under torchrun by node "
                      f"0's agent) stopped answering")
        try:
            before = self.heartbeats.read()
        except Exception as error:
            return [f"{unanswered} ({type(error).__name__}): rank 0 is frozen or gone"]
        try:
            for _ in range(2):  # keep publishing while the others' counters move (or do not)
                time.sleep(self.interval)
                self._publish()
            after, note = self.heartbeats.read(), []
        except Exception as error:  # rank 0 may have ended on its own watchdog meanwhile: judge by one read
            before, after = {}, before
            note = [f"{unanswered} during the second read ({type(error).__name__}); judged from the first"]
        stuck, lines = stuck_ranks(before, after, self.world_size)
        names = ", ".join(str(r) for r in stuck) or "none found"
        return note + [f"stuck rank(s): {names}"] + lines

    def _write(self, lines: list[str], stacks: bool = False) -> None:
        stream = self.stream
        try:
            stream.write("\n".join(lines) + "\n")
            if stacks:
                stream.write(f"watchdog: rank {self.rank}: stacks of every thread follow\n")
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError):  # a closed or redirected stream: still end the process
            pass
