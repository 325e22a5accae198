"""What a cluster job needs from the trainer: a non-finite loss or gradient skips the step (on
every rank, weights and LR schedule untouched) and too many in a row stop the job; a wall-time
limit saves and exits 0 so that the relaunch resumes."""
import json
import math
import os
import re

import pytest

from distributed import free_port, REPO, run_python, run_ranks
from _train_worker import TINY

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

# warmup 4 of 6 steps: every step before the decay has its own learning rate
GUARDED = ["train.train_steps=6", "scheduler.warmup_steps=4"]


def guard_runs(tmp_path, world, *runs):
    out = tmp_path / "guard.json"
    run_ranks(["tests/_guard_worker.py", str(out), *[json.dumps(r) for r in runs]], world, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return guard_runs(tmp_path_factory.mktemp("guard1"), 1,
                      {"name": "loss", "overrides": GUARDED, "poison": "loss", "steps": [3, 4], "rank": 0},
                      {"name": "diverged", "overrides": GUARDED + ["resilience.max_consecutive_skips=2"],
                       "poison": "loss", "steps": [3, 4, 5], "rank": 0},
                      {"name": "unguarded", "overrides": GUARDED + ["resilience.skip_nonfinite_steps=false"],
                       "poison": "loss", "steps": [3], "rank": 0})


def test_a_nan_loss_skips_the_step_and_training_goes_on(single):
    run = single["loss"]
    history, norms = run["history"], run["norms"]
    assert len(history) == 6 and "error" not in run
    assert [math.isnan(h["loss"]) for h in history] == [False, False, True, True, False, False]
    # steps 3 and 4 left the weights as step 2 left them; steps 5 and 6 moved them again
    assert norms[2] == norms[1] and norms[3] == norms[1]
    assert norms[4] != norms[3] and norms[5] != norms[4]
    # the schedule did not advance on them: steps 3, 4 and 5 all use the rate after two updates
    rates = [h["learning_rate"] for h in history]
    assert rates[:3] == pytest.approx([0.0025, 0.005, 0.0075]) and rates[3] == rates[4] == rates[2]
    assert rates[5] == pytest.approx(0.01)
    assert [h["skipped_steps"] for h in history] == [0, 0, 1, 2, 2, 2] and run["skipped_steps"] == 2


def test_consecutive_bad_steps_stop_the_job_naming_step_and_cause(single):
    kind, message = single["diverged"]["error"]
    assert kind == "NonFiniteTraining"
    assert message.startswith("step 4: non-finite gradients and loss in 2 steps in a row (steps 3-4, "
                              "resilience.max_consecutive_skips=2)"), message
    assert "the weights are those after step 2" in message


def test_without_the_guard_a_nan_step_poisons_the_weights(single):
    """The negative control: the same NaN, unguarded, reaches every weight."""
    norms = single["unguarded"]["norms"]
    assert not math.isnan(norms[1]) and all(math.isnan(n) for n in norms[2:])


def pretrain(tmp_path, overrides):
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return run_python(["-m", "pretrain", "--config", "configs/bert-tiny.yaml", *TINY, *overrides], env, timeout=300)


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory):
    """One run stopped by resilience.exit_duration_minutes at its first check (step 3), with the phase
    timers on (a log line every 2 steps) and a profile of steps 2-3: (its directory, its output)."""
    tmp = tmp_path_factory.mktemp("cut-short")
    ckpt = tmp / "ckpt"
    done = pretrain(tmp, resumable(ckpt) + ["resilience.exit_duration_minutes=0.0001", "logging.interval=2",
                                            "logging.timers=true", f"logging.tensorboard_dir={tmp / 'tb'}",
                                            "logging.profile_steps=[2,3]", f"logging.profile_dir={tmp / 'trace'}"])
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp, done.stdout


def resumable(ckpt):
    return ["train.train_steps=100000", f"checkpoint.save_dir={ckpt}", f"checkpoint.load_dir={ckpt}",
            "resilience.stop_check_interval=3"]


def test_wall_time_limit_saves_exits_zero_and_the_relaunch_resumes(cut_short):
    tmp, first = cut_short
    ckpt = tmp / "ckpt"
    assert "resilience.exit_duration_minutes (0.0001) reached after" in first
    assert "saving at step 3 and stopping; launch again to resume" in first
    assert (ckpt / "latest").read_text() == "iter_0000003"
    again = pretrain(tmp, resumable(ckpt) + ["resilience.exit_after_steps=2"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {ckpt} at step 3 " in again.stdout and "step 5/100000" in again.stdout
    assert "step 1/" not in again.stdout


def test_phase_timers_and_a_profiler_trace(cut_short):
    """logging.timers: ms per step of each phase on the log line and in TensorBoard, adding up to no
    more than the step; logging.profile_steps: a trace of exactly those steps, as TensorBoard's
    profiler plugin and Perfetto read it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, out = cut_short
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(re.search(r"\| ms/step: data \d+ fwd \d+ bwd \d+ opt \d+$", l) for l in lines), lines
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    phases = ("data", "forward", "backward", "optimizer")
    for phase in phases:
        assert [e.step for e in events.Scalars(f"time/{phase}_ms")] == [2, 3], phase
    for at in range(2):
        step_ms = 1e3 * events.Scalars("perf/iteration_time")[at].value
        spent = sum(events.Scalars(f"time/{phase}_ms")[at].value for phase in phases)
        assert 0 < spent <= 1.02 * step_ms, (spent, step_ms)  # exclusive phases: never counted twice

    traces = list((tmp / "trace").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, list((tmp / "trace").iterdir())
    names = [event.get("name", "") for event in json.loads(traces[0].read_text())["traceEvents"]]
    assert sorted({n for n in names if n.startswith("ProfilerStep#")}) == ["ProfilerStep#0", "ProfilerStep#1"]
    assert any(n.startswith("aten::") for n in names)


def test_memory_breakdown_of_each_rank_and_what_recomputation_saves(tmp_path):
    """The first step's memory of every rank, logged once: gradients as large as the parameters
    and LAMB's two moments twice as large (fp32, ZeRO-0, DP2 replicas), and an activation peak
    that selective recomputation lowers and full recomputation lowers further."""
    out = tmp_path / "memory.json"
    runs = [json.dumps({"name": mode, "overrides": ["train.train_steps=3", f"model.recompute={mode}",
                                                    "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                                                    "data.seq_length=64", "data.max_predictions_per_seq=10",
                                                    "train.micro_batch_size=4"]})
            for mode in ("none", "selective", "full")]
    run_ranks(["tests/_train_worker.py", str(out), "1", "1", *runs], 2, timeout=600)
    results = json.loads(out.read_text())
    planned = r" MB \(planned [\d.,]+\)"
    line = re.compile(rf"memory of rank (\d) in step 2: parameters ([\d.,]+){planned} \| gradients ([\d.,]+){planned} \| "
                      rf"optimizer state ([\d.,]+){planned} \| activations peak ([\d.,]+){planned}")
    peaks = {}
    for mode, result in results.items():
        found = [line.fullmatch(text) for text in result["log"] if text.startswith("memory of rank")]
        assert [int(m.group(1)) for m in found] == [0, 1], result["log"]
        params, grads, state, activations = (float(m.replace(",", "")) for m in found[0].groups()[1:])
        assert params > 0.1 and grads == pytest.approx(params, rel=0.01)
        assert state == pytest.approx(2 * params, rel=0.01)
        peaks[mode] = activations
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0, peaks
