"""Stragglers: every rank's own step time once per log window, the slow rank named.

The pure parts (the detector's streaks and peers, the figures, the lines, the phase timers' own
time and their synchronisation points, the gathering table of the window's collective) in one
process; then one 2-rank job with rank 1 slowed on purpose (its model's forward sleeps, in the
test worker only) at ZeRO 0-3, with logging.timers, and at PP2, whose logging rank must name rank
1 within two log windows, the log line's min/max showing the gap. (The window's collective on the
GPU code path, fakegpu, runs in every 2-rank job of test_precision_matrix.py: logging.stragglers
is on by default.)"""
import json
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pretrain.observability import timers as timers_module
from pretrain.observability.stragglers import (Named, Place, StragglerDetector, WindowFigures, back_line,
                                               warning_line)
from pretrain.observability.timers import PHASES, PhaseTimers, own_ms, wait_ms

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- the detector
def test_a_rank_is_named_at_its_second_slow_window_and_once_per_streak():
    detector = StragglerDetector(share=0.2, windows=2, stages=[0, 0, 0, 0])
    slow = [100, 101, 99, 300]
    assert detector.update(slow) == ([], [])  # one window: not yet
    named, back = detector.update(slow)
    assert back == [] and named == [Named(rank=3, ms=300, median=100.5, peers=4, windows=2)]
    assert detector.update(slow) == ([], [])  # the same streak: named once
    assert detector.update([100, 101, 99, 102]) == ([], [3])  # back within the share
    assert detector.update(slow) == ([], [])  # a new streak starts from one
    assert [n.rank for n in detector.update(slow)[0]] == [3]


def test_only_above_the_share_counts_and_an_interruption_restarts_the_streak():
    detector = StragglerDetector(share=0.2, windows=2, stages=[0, 0, 0])
    assert detector.update([100, 100, 120]) == ([], [])  # exactly 20% above the median: not more
    assert detector.update([100, 100, 121]) == ([], [])  # first window above
    assert detector.update([100, 100, 110]) == ([], [])  # not above: the count starts again
    assert detector.update([100, 100, 121]) == ([], [])
    assert [n.rank for n in detector.update([100, 100, 121])[0]] == [2]
    assert detector.update([0, 0, 0]) == ([], [2])  # no time at all: nobody is slow


def test_pipeline_stages_are_compared_with_their_own_ranks():
    # PP2 x DP2: the last stage's work (the heads) is heavier; its two ranks agree: nobody is slow
    stages = [0, 0, 1, 1]
    detector = StragglerDetector(share=0.2, windows=1, stages=stages)
    assert detector.update([100, 102, 180, 178]) == ([], [])
    assert detector.medians([100, 102, 180, 300]) == [101, 101, 240, 240]
    assert [(n.rank, n.median, n.peers) for n in detector.update([100, 102, 180, 300])[0]] == [(3, 240, 2)]
    # a stage of one rank (no data parallelism) is compared with every rank
    alone = StragglerDetector(share=0.2, windows=1, stages=[0, 1])
    assert [(n.rank, n.median, n.peers) for n in alone.update([100, 300])[0]] == [(1, 200, 2)]
    with pytest.raises(ValueError):
        alone.update([100])


# ----------------------------------------------------------------------------- figures and lines
TABLE = [[410.0, 3.0, 500.0], [980.0, 4.0, 2.0], [415.0, 2.0, 480.0]]


def test_window_figures_line_and_tensorboard_scalars():
    figures = WindowFigures.from_table(TABLE)
    assert figures.spread() == (410.0, 415.0, 980.0, 1)
    assert figures.line() == "step ms min 410 med 415 max 980 (rank 1)"
    scalars = figures.scalars()
    assert scalars["rank_1_ms"] == 980.0 and scalars["rank_2_data_wait_ms"] == 2.0 and scalars["rank_0_wait_ms"] == 500
    assert (scalars["min_ms"], scalars["median_ms"], scalars["max_ms"]) == (410.0, 415.0, 980.0)
    timed = WindowFigures.from_table([row + [1.0] * len(PHASES) for row in TABLE], PHASES)
    assert timed.phases[1]["forward"] == 1.0 and timed.scalars()["rank_2_optimizer_ms"] == 1.0


def test_the_warning_names_rank_host_device_and_its_figure_against_the_median():
    figures = WindowFigures.from_table(TABLE)
    named = Named(rank=1, ms=980.0, median=415.0, peers=3, windows=2)
    line = warning_line(named, Place("node-b", "cuda:1", 0), figures, step=40, share=0.2)
    assert line == ("straggler: rank 1 (host node-b, device cuda:1) worked 980 ms/step against a median of 415 "
                    "over all 3 ranks (+136%, more than logging.straggler_share=0.2) in 2 log windows in a row, "
                    "to step 40: the other ranks wait for it. Its data wait 4 ms/step (median 3)")
    phases = {"forward": 700.0, "backward": 200.0, "grad_reduce": 1.0, "optimizer": 79.0}
    timed = WindowFigures.from_table(TABLE, ())
    timed.phases = [{"forward": 300.0, "backward": 100.0, "grad_reduce": 400.0, "optimizer": 10.0}, phases,
                    {"forward": 310.0, "backward": 95.0, "grad_reduce": 390.0, "optimizer": 10.0}]
    stage = Named(rank=1, ms=980.0, median=415.0, peers=2, windows=2)
    assert warning_line(stage, Place("node-b", "cuda:1", 0), timed, 40, 0.2).endswith(
        "over its pipeline stage's 2 ranks (+136%, more than logging.straggler_share=0.2) in 2 log windows in a "
        "row, to step 40: the other ranks wait for it. Its data wait 4 ms/step (median 3); its phases (median): "
        "fwd 700 (310) bwd 200 (100) reduce 1 (390) opt 79 (10)")
    assert back_line(1, figures, 415.0, 60, 0.2) == (
        "straggler: rank 1 is back within logging.straggler_share=0.2 of the median (980 against 415 ms/step) "
        "at step 60")


def test_reporter_puts_the_spread_on_the_line_and_every_rank_in_tensorboard(library_log):
    from test_training_parts import ONE_RANK, tiny_config

    from pretrain.training.reporter import Reporter

    reporter = Reporter(tiny_config(), ONE_RANK)
    written = {}
    reporter.writer = SimpleNamespace(add_scalar=lambda name, value, step: written.__setitem__(name, (value, step)))
    metrics = {"loss": 7.5, "lm_loss": 6.9, "nsp_loss": 0.6, "mlm_accuracy": 0.01, "nsp_accuracy": 0.5,
               "learning_rate": 1e-4, "grad_norm": 2.5, "skipped_steps": 0, "global_batch_size": 8, "tokens_seen": 256}
    perf = {"iteration_time": 0.5, "data_wait_time": 0.01, "real_tokens_per_second": 384.0,
            "tokens_per_second": 512.0, "samples_per_second": 16.0, "real_token_share": 0.75}
    figures = WindowFigures.from_table(TABLE)
    figures.warnings, figures.back = ["straggler: rank 1 (...)"], ["straggler: rank 2 is back (...)"]
    reporter.training(4, 32, metrics, perf, {}, {"params_norm": 3.0}, figures)
    line = next(line for line in library_log if line.startswith("step 4/10"))
    assert "| data wait 10 ms/step | step ms min 410 med 415 max 980 (rank 1) | " in line
    assert library_log[-2:] == ["straggler: rank 1 (...)", "straggler: rank 2 is back (...)"]
    assert written["stragglers/rank_1_ms"] == (980.0, 4) and written["stragglers/max_ms"] == (980.0, 4)
    assert not any(name.startswith("stragglers-vs-samples") for name in written)


# ----------------------------------------------------------------------------- own time, measured
@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: now[0])
    return now


class FakeEngine:
    def __init__(self, now, wait):
        self.now, self.wait = now, wait

    def allreduce_gradients(self):
        self.now[0] += self.wait


def test_own_time_is_the_work_without_the_waits(clock):
    syncs = []
    t = PhaseTimers(synchronize=lambda: syncs.append(clock[0]), every_boundary=False)
    engine = FakeEngine(clock, wait=0.200)
    t.time_method(engine, "allreduce_gradients", "grad_reduce")
    table = {"send": lambda owner, buffer_id: clock.__setitem__(0, clock[0] + 0.050)}
    t.time_function(table, "send", "pipe_comm")
    with t.phase("data"):
        clock[0] += 0.004
    clock[0] += 0.100  # outside the step's phases (another collective, the loss all-reduce): not counted
    with t.phase("forward"):
        clock[0] += 0.030
        table["send"](engine, buffer_id=0)
    with t.phase("backward"):
        clock[0] += 0.040
        engine.allreduce_gradients()
    with t.phase("optimizer"):
        clock[0] += 0.010
    engine.allreduce_gradients()  # outside a step (an evaluation's, a save's): not the step's
    phases = t.read(steps=1)
    assert phases == pytest.approx({"data": 4.0, "forward": 30.0, "backward": 40.0, "pipe_comm": 50.0,
                                    "grad_reduce": 200.0, "optimizer": 10.0})
    assert own_ms(phases) == pytest.approx(80.0) and wait_ms(phases) == pytest.approx(250.0)
    # synchronised only where the time changes kind: the top-level work phases' starts and ends,
    # the waits' (twice each); never around data
    assert len(syncs) == 2 * 3 + 2 * 2


def test_unsynchronised_waits_and_every_boundary(clock):
    syncs = []
    t = PhaseTimers(synchronize=lambda: syncs.append(clock[0]), every_boundary=False)
    coordinator = FakeEngine(clock, wait=0.005)
    t.time_method(coordinator, "allreduce_gradients", "param_gather", synced=False)  # ZeRO-3's gathers
    with t.phase("forward"):
        coordinator.allreduce_gradients()
        with t.phase("backward"):  # nested work: no synchronisation of its own
            clock[0] += 0.001
    assert len(syncs) == 2 and t.read(1) == pytest.approx({"forward": 0.0, "param_gather": 5.0, "backward": 1.0})
    every = PhaseTimers(synchronize=lambda: syncs.append(clock[0]))  # logging.timers
    with every.phase("data"):
        with every.phase("forward"):
            pass
    assert len(syncs) == 2 + 4


# ----------------------------------------------------------------------------- the window's collective
@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_each_rank_writes_its_own_row_in_the_one_reduction(one_rank_group, monkeypatch):
    from pretrain.distributed import device
    from pretrain.model.bert import PretrainingLoss
    from pretrain.training.metrics import TOKEN_COUNTS, reduce_metrics, reduce_window

    calls = []
    all_reduce = device.all_reduce
    monkeypatch.setattr(device, "all_reduce", lambda tensor, *a, **k: calls.append(tensor.numel()) or
                        all_reduce(tensor, *a, **k))
    width = len(PretrainingLoss.METRICS) + len(TOKEN_COUNTS)
    sums = [torch.arange(width, dtype=torch.float64) + i for i in range(2)]
    norms = [torch.tensor(2.5), 1.5]
    # rank 1 of 3 (the others' rows are theirs to fill: in one process they stay zero)
    parallel = SimpleNamespace(rank=1, world_size=3, is_last_stage=True, tp_rank=0, cp_rank=0, device=CPU)
    plain = reduce_metrics(parallel, sums, norms)
    metrics, rows = reduce_window(parallel, sums, norms, [412.0, 3.0, 57.0])
    assert calls == [2 * width, 2 * width + 3 * 3]  # one collective each: the metrics, then with the table
    assert rows == [[0.0, 0.0, 0.0], [412.0, 3.0, 57.0], [0.0, 0.0, 0.0]]
    assert metrics == plain and [m["grad_norm"] for m in metrics] == [2.5, 1.5]
    assert reduce_window(parallel, sums, norms)[1] is None


# ----------------------------------------------------------------------------- two ranks, one slowed
SLEEP = 0.2  # seconds per micro-batch of rank 1's forward
# DeepSpeed JSONs that put the wait where each ZeRO stage's own calls are: small reduction buckets
# (the reductions run in the gradient hooks inside backward, not all at its end), ZeRO-3 with every
# parameter partitioned and no prefetch (each module's forward waits in its own gather)
ZERO_JSONS = {
    "zero2-buckets": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 20000}},
    "zero3-buckets": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                            "reduce_bucket_size": 20000}},
    "zero3-gathers": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                            "stage3_prefetch_bucket_size": 0}},
}
EVALUATE = ["eval.interval=2", "eval.steps=1"]  # the waiting calls outside a step are not the step's
RUNS = {  # name: (overrides, pipeline stages); {json} is the path of ZERO_JSONS[name]
    "zero0": (["logging.tensorboard_dir={tmp}/tb"], 1),
    "zero1": (["parallel.zero_stage=1"], 1),
    "zero2-buckets": (["parallel.zero_stage=2", "train.deepspeed_config={json}"], 1),
    "zero3-buckets": (["parallel.zero_stage=3", "train.deepspeed_config={json}", *EVALUATE], 1),
    "zero3-gathers": (["parallel.zero_stage=3", "train.deepspeed_config={json}"], 1),
    "timers": (["logging.timers=true"], 1),
    "pp2": (EVALUATE, 2),
}


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    from distributed import run_ranks

    tmp = tmp_path_factory.mktemp("stragglers")
    runs = []
    for name, (overrides, pp) in RUNS.items():
        path = tmp / f"{name}.json"
        if name in ZERO_JSONS:
            path.write_text(json.dumps(ZERO_JSONS[name]))
        runs.append({"name": name, "pp": pp, "slow_rank": 1, "sleep": SLEEP,
                     "overrides": ["train.train_steps=4", "logging.interval=2",
                                   *(o.format(json=path, tmp=tmp) for o in overrides)]})
    run_ranks(["tests/_straggler_worker.py", str(tmp / "runs.json"), *[json.dumps(r) for r in runs]], 2, timeout=600)
    return json.loads((tmp / "runs.json").read_text()), tmp


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_the_slowed_rank_is_named_within_two_log_windows(slowed, name):
    run = slowed[0][name]
    log, slept = run["log"], 1e3 * SLEEP * run["micro_batches"]  # ms per step rank 1 slept
    windows = [line for line in log if line.startswith(("step 2/4", "step 4/4"))]
    assert len(windows) == 2, log
    assert all(_spread(line)[3] == 1 for line in windows), windows  # the slowest rank on both lines
    low, median, high, _ = _spread(windows[-1])  # the first window holds the start-up's first step
    assert high - low >= 0.75 * slept, windows[-1]  # the gap: most of the sleep
    # rank 0's figure is its own work, not its wait for rank 1 (in the gradient reduction, ZeRO-2/3's
    # bucket reductions in the hooks, ZeRO-3's parameter gathers, the pipeline's transfers)
    assert low < 0.5 * slept, windows[-1]
    warnings = [line for line in log if line.startswith("straggler:")]
    assert len(warnings) == 1, log  # at the second window, once
    assert warnings[0].startswith(f"straggler: rank 1 (host {socket.gethostname()}, device cpu) worked "), warnings
    assert "in 2 log windows in a row, to step 4" in warnings[0]
    if name == "timers":  # the phases say where: rank 1's forward, the others' gradient reduction
        assert "; its phases (median): " in warnings[0] and "| ms/step: data" in windows[-1]
    else:
        assert "its phases" not in warnings[0] and "ms/step:" not in windows[-1]
    assert not any("straggler" in line for line in run["other_ranks_lines"])  # one rank says it


def _spread(line: str) -> tuple[float, float, float, int]:
    """(min, median, max, slowest rank) of a log line's `step ms min 410 med 415 max 980 (rank 1)`."""
    import re

    m = re.search(r"\| step ms min (\d+) med (\d+) max (\d+) \(rank (\d+)\) \|", line)
    assert m, line
    return float(m[1]), float(m[2]), float(m[3]), int(m[4])


@pytest.mark.slow
def test_tensorboard_has_every_rank_figure(slowed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(slowed[1] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"stragglers/rank_0_ms", "stragglers/rank_1_ms", "stragglers/rank_1_data_wait_ms",
            "stragglers/min_ms", "stragglers/median_ms", "stragglers/max_ms"} <= tags
    assert [e.step for e in events.Scalars("stragglers/rank_1_ms")] == [2, 4]
    slow, fast = events.Scalars("stragglers/rank_1_ms")[-1].value, events.Scalars("stragglers/rank_0_ms")[-1].value
    assert slow - fast >= 0.75 * 1e3 * SLEEP * slowed[0]["zero0"]["micro_batches"]
    assert events.Scalars("stragglers/max_ms")[-1].value == slow
