"""Signals as a cluster sends them, through launcher.sh at the default data.num_workers (loader
processes running): SIGTERM to every process of the job (scancel, a SLURM time limit, a
preemption, `kill -- -PGID`) under torchrun, the DeepSpeed launcher and the SLURM stand-in, and
SIGTERM to the launcher alone, each saves one complete checkpoint and exits 0. Each case runs
another precision x ZeRO x layout (fp32 ZeRO-0 and ZeRO-3 DP2, bf16 ZeRO-1 PP2 through DeepSpeed's
pipeline engine, bf16 ZeRO-2 DP2), and the checkpoint's record says that configuration took
effect; the fp32 saves hold the weights a straight fp32 run has at that step, and the fp32 ZeRO-0
job, relaunched (once: resuming does not depend on the launcher), finishes with the straight run's
final weights (1e-6). The jobs run side by side (a 2-rank job keeps 2 cores about half busy)."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from distributed import REPO, free_port, with_zygote_python
from _train_worker import TINY
from pretrain.checkpoint.format import read_meta
from pretrain.checkpoint.logical import read_native
from test_launch_env import FAKE_SRUN
from test_layout_invariance import weight_errors

pytestmark = pytest.mark.slow

STEPS = 20
# (launcher, who gets SIGTERM: the job's process group or the launcher alone, configuration); the
# straight run is fp32 ZeRO-0 DP2
CASES = [("torchrun", "group", ()),
         ("deepspeed", "group", ("train.precision=bf16", "parallel.zero_stage=1", "parallel.pipeline_parallel=2")),
         ("slurm", "group", ("train.precision=bf16", "parallel.zero_stage=2")),
         ("torchrun", "launcher", ("parallel.zero_stage=3",))]
RELAUNCHED = CASES[0]
# Ctrl-C in a terminal: SIGINT to the whole process group; no save, one line per rank
CTRL_C = ("torchrun", "group-sigint", ("checkpoint.save_interval=4",))
STRAIGHT_SAVES = 10  # the straight run saves every 10 steps: at the step the signalled jobs stop at


def job(launcher, ckpt, steps, bin_dir, save_interval=100000, config=()):
    args = TINY + ["data.num_workers=2", f"train.train_steps={steps}", "scheduler.warmup_steps=1", "logging.interval=1",
                   f"checkpoint.save_interval={save_interval}", "checkpoint.keep_last=0", f"checkpoint.save_dir={ckpt}",
                   f"checkpoint.load_dir={ckpt}", *config]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return ["bash", "launcher.sh", "--launcher", launcher, "--nproc-per-node", "2", "--master-port",
            str(free_port()), "pretrain", "--config", "configs/bert-tiny.yaml", *args], env


def run(launcher, ckpt, steps, bin_dir, log, save_interval=100000):
    """A launch that runs to its end (the straight run, the relaunch): no signal, so its Python
    processes may come from the session's zygote."""
    command, env = job(launcher, ckpt, steps, bin_dir, save_interval)
    env = with_zygote_python(env)
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    return code, log.read_text()


def signals_as_a_job_has():
    """SIGINT and SIGQUIT at their defaults in the job: a suite started in the background (`cmd &`,
    nohup) hands its children SIGINT ignored, and a shell cannot trap a signal ignored on entry."""
    for number in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)


def stop_and_relaunch(tmp, launcher, whom, config, bin_dir):
    """Start the job of STEPS steps, SIGTERM it (its process group, or the launcher alone) after
    step 6 (it stops at the next stop check, resilience.stop_check_interval: step 10), then relaunch the
    RELAUNCHED case. Returns (first exit status, first log, saved tag, second exit status and log,
    or None)."""
    name = f"{launcher}-{whom}"
    ckpt, first_log = tmp / name, tmp / f"{name}-first.log"
    command, env = job(launcher, ckpt, STEPS, bin_dir, config=config)
    with open(first_log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,  # its own process group, as a batch job has
                                preexec_fn=signals_as_a_job_has)
    try:
        deadline = time.monotonic() + 400
        while "step 6/" not in first_log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, first_log.read_text()[-3000:]
            time.sleep(0.2)
        if whom == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        elif whom == "group-sigint":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        first = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    saved = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    if (launcher, whom, config) != RELAUNCHED:
        return first, first_log.read_text(), saved, None, None
    second, second_log = run(launcher, ckpt, STEPS, bin_dir, tmp / f"{name}-second.log")
    return first, first_log.read_text(), saved, second, second_log


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signals")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
    srun.chmod(0o755)
    with ThreadPoolExecutor(len(CASES) + 2) as pool:
        straight = pool.submit(run, "torchrun", tmp / "straight", STEPS, bin_dir, tmp / "straight.log", STRAIGHT_SAVES)
        stopped = {case: pool.submit(stop_and_relaunch, tmp, *case, bin_dir) for case in CASES + [CTRL_C]}
        code, log = straight.result()
        assert code == 0, log[-3000:]
        return tmp / "straight", {case: f.result() for case, f in stopped.items()}


def assert_same_weights(ours: dict, straight: dict) -> None:
    assert ours.keys() == straight.keys()
    for name, tensor in straight.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("launcher,whom,config", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sigterm_saves_exits_0_and_the_relaunch_equals_a_straight_run(runs, launcher, whom, config):
    straight_dir, stopped = runs
    first, first_log, saved, second, second_log = stopped[(launcher, whom, config)]
    assert first == 0, first_log[-4000:]
    assert saved is not None and "SIGTERM received: saving at step" in first_log, first_log[-4000:]
    assert int(saved.split("_")[-1]) < STEPS
    assert first_log.count("saved checkpoint") == 1, first_log[-4000:]  # one complete checkpoint
    assert "DataLoader worker" not in first_log  # the loader processes left the signal to their rank
    step = int(saved.split("_")[-1])
    assert step % STRAIGHT_SAVES == 0, saved  # stopped at a stop check
    ckpt = REPO / first_log.split("saved checkpoint ")[-1].split("\n")[0].strip()
    # the launcher's documented line, also when the tool between ended well (SIGTERM to the launcher alone)
    assert (f"launcher.sh: the job stopped (SIGTERM received: saved step {step} in {ckpt.parent}); launch it again "
            "to resume") in first_log.splitlines(), first_log[-4000:]
    layout = read_meta(str(ckpt))["layout"]
    settings = dict(item.split("=") for item in config)
    assert (layout["precision"], layout["zero_stage"], layout["pipeline_parallel"]) == \
        (settings.get("train.precision", "fp32"), int(settings.get("parallel.zero_stage", 0)),
         int(settings.get("parallel.pipeline_parallel", 1))), layout
    saved_weights = read_native(str(ckpt)).weights  # every shard of every rank is there
    if layout["zero_stage"] == 0:
        assert_same_weights(saved_weights, read_native(str(straight_dir / saved)).weights)
    elif layout["precision"] == "fp32":  # ZeRO-3 sums in another order: the layout tests' measure
        errors = weight_errors(saved_weights, read_native(str(straight_dir / saved)).weights)
        assert max(errors.values()) <= 1e-5, errors
    else:
        assert all(torch.isfinite(tensor).all() for tensor in saved_weights.values())
    if (launcher, whom, config) != RELAUNCHED:
        return
    assert second == 0 and f"resumed from" in second_log and f"at step {step} " in second_log, second_log[-3000:]
    assert f"step {step}/" not in second_log  # nothing before the checkpoint was trained again
    final = REPO / second_log.split("saved checkpoint ")[-1].split("\n")[0].strip()
    assert_same_weights(read_native(str(final)).weights, read_native(str(straight_dir)).weights)


def test_ctrl_c_ends_every_rank_with_one_line_naming_the_last_checkpoint(runs):
    """Ctrl-C (SIGINT to the job's process group): each rank stops at once with one line naming
    what a relaunch resumes from, no KeyboardInterrupt traceback of a rank or loader process, nor
    torchrun's SignalException traceback (one line instead); the launcher says so and exits 130."""
    _, stopped = runs
    code, log, saved, _, _ = stopped[CTRL_C]
    assert code == 130, log[-4000:]
    lines = [line for line in log.splitlines() if ": interrupted at step " in line]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1"], log[-4000:]
    assert saved is not None and all(f"the last complete checkpoint is " in line and line.endswith(saved)
                                     for line in lines), (saved, lines)
    assert "KeyboardInterrupt" not in log and "DataLoader worker" not in log, log[-4000:]
    assert "Traceback" not in log and "torchrun: ended by SIGINT" in log, log[-4000:]
    assert "launcher.sh: interrupted (SIGINT)" in log, log[-4000:]
