"""The tests' zygote (tests/zygote.py) starts a program as `python ARGS...` would, with the heavy
libraries already imported: what a rank sees of its process must not tell the two apart."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from distributed import child_env, forkable, ranks_pythonpath, run_python, session_zygote, shell_env, start_python

pytestmark = pytest.mark.slow  # the session's zygote imports torch once (shared with every multi-process test)

PROGRAM = textwrap.dedent("""
    import gc, json, os, random, sys
    before = "torch" in sys.modules  # preloaded: already there before this program imports it
    import torch
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_PROBE"),
                      "path0": sys.path[0], "preloaded": before, "random": random.random(),
                      "threads": torch.get_num_threads(), "frozen": gc.get_freeze_count()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
""")


def env_with(**extra):
    return child_env(dict(PYTHONPATH=ranks_pythonpath(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), extra)


def test_a_forked_program_sees_its_own_arguments_environment_directory_and_output(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROGRAM)
    results = []
    for code in (0, 3):
        done = run_python([str(script), "probe", str(code)], env_with(ZYGOTE_PROBE=f"run{code}"), cwd=tmp_path)
        assert done.returncode == code, done.stderr
        assert done.stderr == "to stderr\n"  # apart from stdout
        results.append(json.loads(done.stdout))
    first, second = results
    assert first["preloaded"], "the zygote did not serve this program"
    assert first["frozen"] > 100_000  # the imports' objects are out of the collector's scans
    assert (first["name"], first["argv"][2], first["cwd"], first["env"]) == ("__main__", "0", str(tmp_path), "run0")
    assert first["path0"] == str(tmp_path) and first["threads"] == 1
    assert second["env"] == "run3" and first["random"] != second["random"]  # reseeded in every child


def test_the_ranks_of_a_job_differ_in_their_string_hashes(tmp_path):
    """As fresh interpreters do: a set of names iterated in another order on another rank stays
    visible (the two ranks come from the session's two zygotes)."""
    script = tmp_path / "hashes.py"
    script.write_text("print(hash('layers.0.attention'))\n")
    hashes = {rank: run_python([str(script)], env_with(RANK=str(rank))).stdout for rank in (0, 1)}
    assert hashes[0] != hashes[1], hashes


def test_a_module_run_a_kill_and_a_fresh_interpreter_where_the_server_cannot_serve(tmp_path):
    done = run_python(["-m", "json.tool", "--help"], env_with())
    assert done.returncode == 0 and "json.tool" in done.stdout, done.stderr
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    proc = start_python([str(sleeper)], env_with())
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # a stand-in package on the PYTHONPATH must be loaded at start-up: a fresh interpreter runs it
    assert not forkable(env_with(PYTHONPATH=os.pathsep.join([str(tmp_path), ranks_pythonpath()])))
    assert not forkable(env_with(CUDA_VISIBLE_DEVICES="0"))
    assert forkable(env_with()) and session_zygote().server.poll() is None


SHELL_PROBE = textwrap.dedent("""
    import json, subprocess, sys
    before = "torch" in sys.modules
    inner = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules, sys.executable)"],
                           capture_output=True, text=True).stdout.split()
    print(json.dumps({"preloaded": before, "executable": sys.executable, "stdin": sys.stdin.read(),
                      "inner_preloaded": inner[0] == "True", "inner_executable": inner[1], "argv": sys.argv}))
""")


def test_a_shell_command_python_is_forked_and_stands_for_the_program(tmp_path):
    """tests/zygote_python.py, the `python` of a documented block's shell (distributed.shell_env):
    the program and what it starts with sys.executable (torchrun's ranks) are forked from the
    zygote; stdin, the exit code and a death by signal reach the shell as they would; interpreter
    options it cannot serve, and what `forkable` refuses, get a fresh interpreter."""
    script = tmp_path / "probe.py"
    script.write_text(SHELL_PROBE)
    lines = ["echo from-stdin | python -u probe.py a b",
             "python -c 'import sys; sys.exit(3)' || echo exit=$?",
             "python -c 'import os, signal; os.kill(os.getpid(), signal.SIGTERM)' || echo exit=$?",
             "python -O -c 'import sys; print(\"options\", \"torch\" in sys.modules)'",
             "PYTHONHASHSEED=1 python -c 'import sys; print(\"hashseed\", \"torch\" in sys.modules)'"]
    done = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=tmp_path, env=shell_env(), capture_output=True,
                          text=True, timeout=300)
    out = done.stdout.splitlines()
    probe = json.loads(out[0])
    assert probe["preloaded"] and probe["inner_preloaded"], "the zygote did not serve the shell's python"
    assert probe["executable"] == probe["inner_executable"] != sys.executable
    assert os.path.basename(probe["executable"]) == "python"
    assert (probe["stdin"], probe["argv"]) == ("from-stdin\n", ["probe.py", "a", "b"])
    assert out[1:] == ["exit=3", f"exit={128 + signal.SIGTERM}", "options False", "hashseed False"], done.stderr


FORKSERVER_PROBE = textwrap.dedent("""
    import multiprocessing, sys

    def preloaded():
        return "torch" in sys.modules

    if __name__ == "__main__":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([])  # nothing of its own: a fresh forkserver has no torch
        with context.Pool(1) as pool:
            print("forkserver child preloaded:", pool.apply(preloaded))
""")


def test_a_ranks_forkserver_comes_from_the_zygote_with_its_descriptors(tmp_path):
    """run_ranks' programs (children_too): multiprocessing's forkserver (the data loaders') starts
    through zygote_python.py, its listener and parent pipe at the numbers multiprocessing gave them."""
    script = tmp_path / "forkserver_probe.py"
    script.write_text(FORKSERVER_PROBE)
    proc = start_python([str(script)], env_with(), children_too=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "forkserver child preloaded: True" in out, out
