"""The loop's parts on their own, without a DeepSpeed engine: the skip policy, stop requests, the
throughput window, the reporter's line and results file, the loaders' rules. The loop that wires
them is covered end to end by the run-control, resume, signal and precision-matrix tests."""
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pretrain.config import load_config
from pretrain.optim.guard import APPLIED, AT_MIN_SCALE, StepOutcome
from pretrain.optim.skips import NonFiniteTraining, SkipPolicy
from pretrain.resilience.stops import StopRequests
from pretrain.training.loaders import Loaders
from pretrain.training import metrics
from pretrain.training.metrics import ThroughputWindow
from pretrain.training.reporter import EvalResults, Reporter

CPU = torch.device("cpu")
ONE_RANK = SimpleNamespace(rank=0, logging_rank=0, world_size=1, device=CPU, dp_rank=0, dp_size=1, pp_rank=0,
                           tp_rank=0, is_first_stage=True, is_last_stage=True)
NON_FINITE = StepOutcome(True, ("loss",), counts=True)
OVERFLOW = StepOutcome(True, ("gradients",), counts=False)  # an fp16 scaler finding its scale


# ----------------------------------------------------------------------------- skip policy
def test_skip_policy_stops_at_the_limit_of_non_finite_steps_in_a_row():
    policy = SkipPolicy(max_consecutive=3)
    positions = [0, 4, 12, 28, 52, 84]  # batches of 4, 8, 16, 24, 32 samples: a batch warmup
    for step, outcome in enumerate([NON_FINITE, NON_FINITE, APPLIED, NON_FINITE, NON_FINITE], start=1):
        policy.count(step, outcome, positions[step - 1])  # an applied step in between starts the count again
    assert policy.skipped == 4
    with pytest.raises(NonFiniteTraining) as error:
        policy.count(6, StepOutcome(True, ("gradients",), counts=True), positions[5])
    message = str(error.value)
    assert "step 6: non-finite gradients and loss in 3 steps in a row (steps 4-6" in message
    assert "the weights are those after step 3" in message and "near sample 28" in message  # step 4's batch


def test_skip_policy_counts_fp16_overflows_without_ending_the_run():
    policy = SkipPolicy(max_consecutive=2, min_loss_scale=256)
    for step in range(1, 11):
        policy.count(step, OVERFLOW, 8 * (step - 1))
    assert policy.skipped == 10 and policy.bad_run == []
    policy.count(11, StepOutcome(True, (AT_MIN_SCALE,), counts=True), 80)
    with pytest.raises(NonFiniteTraining, match=r"minimum fp16 loss scale \(256, fp16.min_loss_scale\)"):
        policy.count(12, StepOutcome(True, (AT_MIN_SCALE,), counts=True), 88)


def test_a_rollback_during_a_batch_warmup_steps_over_the_batches_those_steps_would_have_had():
    """A rollback steps over spike_skip_batches global batches past the spike's, each of the size
    its step has on the run's clock: during a batch warmup, not train.global_batch_size each."""
    from pretrain.config.token_clock import TokenClock
    from pretrain.training.spike_policy import SpikePolicy

    cfg = tiny_config("train.global_batch_size=16", "train.batch_warmup_tokens=512", "train.batch_warmup_min_size=4",
                      "resilience.spike_skip_batches=2")
    clock = TokenClock.of(cfg)
    assert [clock.batch(k) for k in range(6)] == [4, 4, 8, 16, 16, 16]
    policy = SpikePolicy(cfg, ONE_RANK, guard=None, loss_fn=None)  # the range only: no detector wired
    # the spike at step 2 (its batch began at sample 4, after step 1's 4): steps 2-4's batches go
    assert policy.roll_back_range(0, 4, 2) == (0, 4 + 4 + 8 + 16)
    assert policy.skipped == [(0, 32)]
    # past the ramp every batch is the full one
    assert policy.roll_back_range(64, 96, 6) == (64, 96 + 3 * 16)


# ----------------------------------------------------------------------------- stop requests
@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_stop_requests_agree_only_at_check_steps(one_rank_group):
    stops = StopRequests(check_interval=2, exit_duration_minutes=0, parallel=ONE_RANK)
    with stops.on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)  # handled: no exit
        assert stops.agreed(3) is None  # not a check step: no collective, no stop yet
        assert stops.agreed(4) == "SIGTERM received"
    assert signal.getsignal(signal.SIGTERM) is not stops.request  # the previous handler is back


def test_stop_requests_wall_time(one_rank_group):
    stops = StopRequests(check_interval=1, exit_duration_minutes=1, parallel=ONE_RANK, started=time.monotonic() - 61)
    assert stops.agreed(1).startswith("resilience.exit_duration_minutes (1) reached after 1.0 min")
    assert StopRequests(1, 1, ONE_RANK).agreed(1) is None


# ----------------------------------------------------------------------------- throughput window
def test_throughput_window_counts_real_tokens_not_padding(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    window = ThroughputWindow(CPU, unit="examples")
    window.add(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]))
    window.add(torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert window.counts().tolist() == [10, 16, 4]
    clock[0] += 2.0  # two seconds of work
    rates = window.rates(*window.counts().tolist())
    assert (rates["real_tokens_per_second"], rates["tokens_per_second"], rates["examples_per_second"]) == (5, 8, 2)
    assert rates["real_token_share"] == 10 / 16
    assert window.counts().tolist() == [0, 0, 0]  # restarted


# ----------------------------------------------------------------------------- reporter
def tiny_config(*overrides):
    return load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
                              "model.ffn_hidden_size=128", "model.vocab_size=1000", "data.seq_length=32",
                              "train.micro_batch_size=4", "train.global_batch_size=8", "train.train_steps=10",
                              *overrides])


def test_reporter_line_names_real_and_computed_speed(library_log):
    lines = library_log
    reporter = Reporter(tiny_config(), ONE_RANK)
    metrics = {"loss": 7.5, "lm_loss": 6.9, "nsp_loss": 0.6, "mlm_accuracy": 0.01, "nsp_accuracy": 0.5,
               "learning_rate": 1e-4, "grad_norm": 2.5, "skipped_steps": 1, "global_batch_size": 8,
               "tokens_seen": 1_234_567}
    perf = {"iteration_time": 0.5, "data_wait_time": 0.01, "real_tokens_per_second": 384.0,
            "tokens_per_second": 512.0, "samples_per_second": 16.0, "real_token_share": 0.75}
    reporter.training(4, 32, metrics, perf, {"forward": 100.0, "backward": 200.0}, {"params_norm": 3.0})
    line = lines[-1]
    assert line.startswith("step 4/10 | loss 7.5000 | lm 6.9000 | nsp 0.6000 | mlm acc 0.010 | lr 1.000e-04")
    assert "| grad norm 2.500 | tokens 1.23M | 384 real tok/s (512 computed, 75% real) | data wait 10 ms/step" in line
    # with a batch warmup the step's global batch is on the line too
    Reporter(tiny_config("train.batch_warmup_tokens=1000", "train.batch_warmup_min_size=4"), ONE_RANK).training(
        5, 40, dict(metrics, global_batch_size=4), perf, {}, {"params_norm": 3.0})
    assert "| grad norm 2.500 | batch 4 | tokens 1.23M |" in lines[-1]
    assert "| ETA 0:00:03 |" in line  # 6 steps left at 0.5 s each
    assert line.endswith("| skipped 1 | ms/step: fwd 100 bwd 200")


def test_eval_results_keep_earlier_entries_and_replace_a_repeated_step(tmp_path):
    path = tmp_path / "eval.json"
    results = EvalResults(str(path))
    for step in (2, 4, 6):
        results.add("valid", step, step * 8, {"lm_loss": float(step)})
    again = EvalResults(str(path))  # a resumed run after a crash past step 4's save
    again.add("valid", 6, 48, {"lm_loss": 0.5})
    saved = json.loads(path.read_text())
    assert [(e["step"], e["metrics"]["lm_loss"]) for e in saved["valid"]] == [(2, 2.0), (4, 4.0), (6, 0.5)]
    assert saved["test"] == []


# ----------------------------------------------------------------------------- loaders
def test_loaders_pack_a_step_and_leave_middle_stages_without_workers():
    packed = Loaders(tiny_config("data.packing=true", "data.num_workers=2"), ONE_RANK, grad_accum=2)
    assert (packed.pack_group, packed.workers) == (2, 2)
    middle = SimpleNamespace(**{**vars(ONE_RANK), "is_first_stage": False, "is_last_stage": False})
    unpacked = Loaders(tiny_config("data.num_workers=2"), middle, grad_accum=2)
    assert (unpacked.pack_group, unpacked.workers) == (0, 0)
    assert unpacked.report() == []
