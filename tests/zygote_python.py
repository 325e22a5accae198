"""The `python` a test's shell commands find first on PATH (tests/distributed.py `zygote_path`): it
asks the session's zygote (tests/zygote.py) to fork the program with torch, DeepSpeed and
megatron-core already imported, and stands for it until it ends: its stdin, stdout and stderr are
this process's, the signals this process gets are passed on, and it exits as the program did (with
its code, or killed by the same signal), and the descriptors it was given beyond them keep their
numbers. Programs it started with `sys.executable` or multiprocessing (torchrun's ranks, a launcher's
workers, the data loaders' forkserver) come back through it.

What the zygote cannot serve runs as before, in a fresh interpreter (exec): interpreter options
other than -u and -B, the REPL or a program read from stdin, and whatever `distributed.forkable` refuses
(a PYTHONPATH entry the server lacks, another LD_PRELOAD, a fixed PYTHONHASHSEED, a visible GPU,
BERT_TESTS_ZYGOTE=0).

What the program does not get from this process: its network namespace, resource limits, process
group and session, which are the zygote's. A test whose processes live in namespaces of their own
(tests/netns.py), or that signals a process group or looks processes up by pid, keeps fresh
interpreters (it does not use `distributed.shell_env`).

Started by the wrapper script `zygote_path` writes, as `REAL_PYTHON -S -E zygote_python.py
REAL_PYTHON WRAPPER ARGS...`: no site-packages and no environment variables read, so that standing in
costs a few milliseconds and nothing the program's environment holds changes this process.
"""
import json
import os
import signal
import socket
import sys

# passed on to the program: what a job's launcher or a test sends the process it started
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def program(args: list[str], env: dict) -> list[str] | None:
    """The zygote's argv for `python ARGS` (with -u turned into PYTHONUNBUFFERED in `env`; -B, which
    multiprocessing passes on when its parent has it, changes nothing a program sees), or None when
    a fresh interpreter must run it."""
    while args and args[0] in ("-u", "-B"):
        if args[0] == "-u":
            env["PYTHONUNBUFFERED"] = "1"
        args = args[1:]
    if not args or args[0] == "-" or (args[0].startswith("-") and args[0] not in ("-m", "-c")):
        return None
    if args[0] in ("-m", "-c") and len(args) < 2:
        return None
    return args


def forkable(env: dict) -> bool:
    """tests/distributed.py `forkable`, from what the session put in the environment."""
    def entries(value):
        return {os.path.abspath(entry) for entry in (value or "").split(os.pathsep) if entry}

    return (env.get("CUDA_VISIBLE_DEVICES", "") == "" and env.get("BERT_TESTS_ZYGOTE", "1") not in ("", "0")
            and "BERT_TESTS_ZYGOTE_SOCKETS" in env
            and entries(env.get("PYTHONPATH")) <= entries(env.get("BERT_TESTS_ZYGOTE_PYTHONPATH"))
            and env.get("LD_PRELOAD", "") == env.get("BERT_TESTS_ZYGOTE_LD_PRELOAD", "")
            and "PYTHONHASHSEED" not in env)


def is_inherited(fd: int) -> bool:
    """Whether `fd` came from the caller: this interpreter opens its own descriptors close-on-exec."""
    try:
        return os.get_inheritable(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return False


def forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it ended already; its return code is on the way
        pass


def main() -> None:
    real, wrapper, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    env = dict(os.environ)
    argv = program(list(args), env)
    if argv is None or not forkable(env):
        os.execv(real, [real, *args])
    # held until the program's pid is known, then passed on to it
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    sockets = env["BERT_TESTS_ZYGOTE_SOCKETS"].split(os.pathsep)
    rank = env.get("RANK", "0")  # a job's ranks alternate between the servers (their hash secrets)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sockets[int(rank) % len(sockets) if rank.isdigit() else 0])
    except OSError:  # the session that served it has ended: a fresh interpreter, as without it
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        os.execv(real, [real, *args])
    for fd in (0, 1, 2):  # a caller may have closed one: the program gets /dev/null there, as a fresh one would
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    # descriptors the caller passed on beyond 0-2 (multiprocessing's forkserver gets its listener and
    # the pipe that tells it its parent ended), at the same numbers in the program
    passed = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2 and is_inherited(int(fd)))
    request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdin": True, "executable": wrapper, "fds": passed}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2, *passed])
    replies, buffer = [], b""
    pid = None
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            replies.append(json.loads(line))
        if pid is None and replies:
            pid = replies[0]["pid"]
            for sig in FORWARDED:
                signal.signal(sig, lambda signum, frame: forward(pid, signum))
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        if len(replies) == 2:
            break
        data = conn.recv(4096)
        if not data:
            print(f"zygote_python: the zygote went away while it ran {argv}", file=sys.stderr)
            os._exit(1)
        buffer += data
    code = replies[1]["returncode"]
    if code < 0:  # killed by a signal: end the same way, so that the caller sees what it would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
