"""A process that imports torch, DeepSpeed and megatron-core once and forks the tests' Python
programs from that state (what multiprocessing's forkserver does with preloaded modules): a test
that starts ranks pays those imports (about 5 s of CPU per process) once per session, not per rank.

Run as a script, this file is the server: it imports the libraries, then listens on a Unix socket.
A request is one JSON line {"argv", "env", "cwd"} with one file descriptor (the child's stdout and
stderr) or two (stdout, stderr). From tests/zygote_python.py's wrapper it also has "stdin": true (the
descriptors are stdin, stdout, stderr, then those listed in "fds", which the child gets at those
numbers; otherwise stdin is /dev/null) and "executable" (the child's sys.executable and
multiprocessing's). The server forks; the child takes the environment, directory, arguments and
output of the request and runs the program as `python ARGV...` would (a script as `__main__`, `-m module`, `-c code`),
at the top of its own stack, so the interpreter exits as usual (atexit, non-daemon threads). The
server answers {"pid": ...} at once and {"returncode": ...} when the child ends, as
subprocess.Popen reports it (negative: killed by that signal).

What a fork shares that a fresh interpreter would not, and how the child undoes it:
- the server's state: it only imports, never computes (no thread pool, no CUDA, no process group);
- random states: Python's `random` and NumPy's are reseeded from the OS (the libraries' own
  deterministic seeds, torch's default generator among them, are the same as after a fresh import);
- warnings the imports raised were printed once, by the server (its output goes to the session);
- sys.path is rebuilt as the interpreter builds it: the script's folder (or the directory, with -m),
  then PYTHONPATH, then the installation's paths.
A program that must see a fresh interpreter (one that checks what gets imported, or sets variables
read at import time) is started with subprocess as before; `Zygote.start` is the only entry.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import sys
import threading
import time

PRELOAD = ("torch", "deepspeed", "megatron.core")


# --- the server (this file run as a script) ----------------------------------------------------

def _serve(listener: socket.socket) -> tuple[dict, int] | None:
    """Accept requests and fork children until the listener closes or stdin (the session) ends;
    in a child, return its request and output descriptor (the caller runs it). None in the server
    when it is time to stop."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    children: dict[int, socket.socket] = {}  # pid -> the connection waiting for its return code
    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
                except OSError:
                    pass  # the test went away first
                conn.close()
        if sys.stdin in ready and not sys.stdin.buffer.read1(4096):
            return None  # the session ended
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
        request = json.loads(message.decode())
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for held in (listener, conn, *children.values()):
                held.close()
            os.close(wake_r)
            os.close(wake_w)
            return request, fds
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn


def _become(request: dict, fds: list[int]) -> tuple[str, str]:
    """Turn this forked child into the requested program's process (its stdout the first descriptor,
    its stderr the second, or the first again when only one came); ("script"|"module", target)."""
    import random

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request.get("stdin"):  # zygote_python.py: stdin, stdout, stderr, then descriptors at their numbers
        stdin, out, err, passed = fds[0], fds[1], fds[2], fds[3:]
    else:
        stdin, out, err, passed = os.open(os.devnull, os.O_RDONLY), fds[0], fds[-1], []
    # out of the way of every number they go to first, then each to its own
    above = max([stdin, out, err, *passed, *request.get("fds", [])]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in (stdin, out, err, *passed)]
    for fd in {stdin, out, err, *passed}:
        os.close(fd)
    for fd, number in zip(moved, [0, 1, 2, *request.get("fds", [])]):
        os.dup2(fd, number, inheritable=True)
        os.close(fd)
    if request.get("executable"):  # started through zygote_python.py: its wrapper is this interpreter,
        sys.executable = request["executable"]  # for the programs it starts, multiprocessing's too
        import multiprocessing

        multiprocessing.set_executable(request["executable"])
    unbuffered = os.environ.get("PYTHONUNBUFFERED", "") != ""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=unbuffered)
    random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch's pool is sized on first use: before, in a child
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    kind = {"-m": "module", "-c": "command"}.get(argv[0], "script")
    target = argv[1] if kind != "script" else argv[0]
    # sys.path[0] as the interpreter sets it: the script's folder, the directory for -m, "" for -c
    first = {"module": os.getcwd(), "command": "", "script": os.path.dirname(os.path.abspath(target))}[kind]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *(os.path.abspath(p) for p in extra), *_INSTALLATION_PATH]
    sys.argv = {"module": argv[1:], "command": ["-c", *argv[2:]], "script": list(argv)}[kind]
    return kind, target


def _run_as_main(kind: str, target: str) -> None:
    import runpy
    import types

    if kind == "module":
        sys.argv[0] = target  # runpy replaces it with the module's file, as `python -m` does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "command":
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    # the installation's paths: what a fresh interpreter has after its script folder and PYTHONPATH
    _pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _INSTALLATION_PATH = [p for p in sys.path[1:] if os.path.abspath(p) not in _pythonpath]
    for _name in PRELOAD:
        __import__(_name)
    # the imports' objects (about 400k) leave the collector's generations: a full collection in a
    # child (DeepSpeed forces six per bf16 optimizer it builds) then scans only what the child made,
    # not 0.1-0.3 s of objects that live as long as the process anyway; and no collection writes to
    # (and so copies) the pages the children share with the server
    import gc
    gc.freeze()
    _listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _listener.bind(sys.argv[1])
    _listener.listen(64)
    print("ready", flush=True)
    _child = _serve(_listener)
    if _child is None:
        sys.exit(0)
    del _listener
    _run_as_main(*_become(*_child))
    sys.exit(0)


# --- the test side ----------------------------------------------------------------------------

class ZygoteProcess:
    """A child of the zygote, with the parts of subprocess.Popen the tests use (text output; stderr
    apart or with stdout)."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, output_fds: list[int]):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._conn_buffer = conn, b""
        self._open = {fd: [] for fd in output_fds}  # descriptor -> what came, until its end
        self._read = [self._open[fd] for fd in output_fds]

    def _read_code(self, timeout: float | None) -> bool:
        """Wait up to `timeout` (None: forever) for the return code; whether it came."""
        if self.returncode is not None:
            return True
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._conn_buffer:
                data = self._conn.recv(4096)
                if not data:
                    raise RuntimeError(f"the zygote went away while pid {self.pid} ran")
                self._conn_buffer += data
        except (TimeoutError, BlockingIOError):
            return False
        self.returncode = json.loads(self._conn_buffer.split(b"\n", 1)[0])["returncode"]
        self._conn.close()
        return True

    def poll(self) -> int | None:
        self._read_code(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if not self._read_code(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """All of the output until the program and whatever holds its output ends, then its code:
        (stdout, stderr), stderr None when it went with stdout."""
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(self._open), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    self._open[fd].append(data)
                else:
                    os.close(fd)
                    del self._open[fd]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._read_code(left):
            raise subprocess.TimeoutExpired(self.args, timeout)
        texts = [b"".join(chunks).decode(errors="replace") for chunks in self._read] or [None]  # into a file
        return texts[0], (texts[1] if len(texts) > 1 else None)


class Zygote:
    """The test session's server: started by the constructor, which does not wait for its imports
    (the session starts its servers while the first tests run); `wait_ready` waits for them."""

    def __init__(self, repo: str, env: dict, socket_path: str):
        import subprocess

        self.socket_path = socket_path
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__), socket_path], cwd=repo, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.import_output: str | None = None  # what the imports printed (their warnings), once ready
        self._ready_lock = threading.Lock()

    def wait_ready(self) -> bool:
        """Wait until the server has imported everything and listens; True on the call that saw it
        become ready (the caller reports the imports' warnings once), False on every later call."""
        with self._ready_lock:
            if self.import_output is not None:
                return False
            lines = []  # what the imports printed, then "ready"
            while not lines or lines[-1].strip() != b"ready":
                line = self.server.stdout.readline()
                if not line:
                    raise RuntimeError(f"the zygote did not start: {b''.join(lines).decode(errors='replace')[-3000:]}")
                lines.append(line)
            # anything the server prints later (its own failure) is kept, never left to fill the pipe
            self.later_output: list[bytes] = []
            threading.Thread(target=lambda: self.later_output.extend(iter(self.server.stdout.readline, b"")),
                             daemon=True).start()
            self.import_output = b"".join(lines[:-1]).decode(errors="replace")
            return True

    def start(self, argv: list[str], env: dict, cwd: str, separate_stderr: bool = False,
              executable: str | None = None, output=None) -> ZygoteProcess:
        """`python ARGV...` in `cwd` with exactly `env`; its stdout and stderr together, or apart,
        or both into the open file `output`; `executable`: its sys.executable and multiprocessing's
        (tests/zygote_python.py's wrapper)."""
        pipes = [] if output is not None else [os.pipe() for _ in range(2 if separate_stderr else 1)]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket_path)
            request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "executable": executable}
            outputs = [output.fileno()] if output is not None else [write for _, write in pipes]
            socket.send_fds(conn, [json.dumps(request).encode()], outputs)
        finally:
            for _, write in pipes:
                os.close(write)
        reply = b""
        while b"\n" not in reply:
            data = conn.recv(4096)
            if not data:
                for read, _ in pipes:
                    os.close(read)
                raise RuntimeError(f"the zygote refused {argv}")
            reply += data
        line, rest = reply.split(b"\n", 1)
        proc = ZygoteProcess(list(argv), json.loads(line)["pid"], conn, [read for read, _ in pipes])
        proc._conn_buffer = rest
        return proc

    def close(self) -> None:
        if self.server.poll() is None and self.import_output is None:  # still importing: nothing to end
            self.server.kill()
            self.server.wait()
        if self.server.poll() is None:
            self.server.stdin.close()  # the server's signal to stop
            try:
                self.server.wait(timeout=10)
            except Exception:
                self.server.kill()
        try:
            os.unlink(self.socket_path)
            os.rmdir(os.path.dirname(self.socket_path))  # the session's own folder (distributed.session_zygote)
        except OSError:
            pass
