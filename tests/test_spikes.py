"""Loss spikes (resilience.spike_policy, pretrain/training/spike_policy.py), in fp32 at ZeRO-1 DP2
and at PP2, one 2-rank job each (tests/_spike_worker.py) running every case in turn:

- rollback: a finite spike (the loss x 50) at step 6 makes every rank reload the step-4 checkpoint
  and step over the samples from it to one global batch past the spike's; the run's weights then
  equal a straight run's that was told to step over the same samples (data.skip_samples), 1e-6;
- resume: the rolled-back run's step-6 checkpoint (written after the rollback) resumed to step 8
  equals the rolled-back run;
- skip: the spike step is applied by no rank (weights and learning rate held) and training goes on;
- log: the spike is applied and training goes on.
Also, in one process: the detector's judgement and the sample ranges a run steps over."""
import json
import math

import pytest

from distributed import run_ranks
from pretrain.data.samples.skipped import advance, merged, skip_ahead
from pretrain.optim.spikes import SpikeDetector

GBS = 8  # tests/_train_worker.py TINY's train.global_batch_size
BASE = ["train.train_steps=8", "scheduler.warmup_steps=2", "optimizer.lr=0.002", "logging.interval=1",
        "parallel.zero_stage=1", "resilience.spike_window=2", "resilience.spike_factor=3"]
SPIKE_AT = 5 * GBS  # the batch of step 6
SPIKE = {"poison": "spike", "rank": "all", "positions": [SPIKE_AT]}
ROLLED_OVER = [4 * GBS, 3 * GBS]  # from the step-4 checkpoint to one batch past the spike's: 3 batches


def runs(ckpt: str, layout: list[int]) -> list[dict]:
    save = [f"checkpoint.save_dir={ckpt}", "checkpoint.save_interval=2", "checkpoint.keep_last=0"]
    return [
        {"name": "straight", "layout": layout, "overrides": BASE + [f"data.skip_samples=[{ROLLED_OVER}]"]},
        {"name": "rollback", "layout": layout, "poisons": [SPIKE],
         "overrides": BASE + save + ["resilience.spike_policy=rollback", "resilience.spike_skip_batches=1"]},
        {"name": "resumed", "layout": layout, "latest": "iter_0000006",
         "overrides": BASE + save + [f"checkpoint.load_dir={ckpt}", "resilience.spike_policy=rollback",
                                     "resilience.spike_skip_batches=1"]},
        {"name": "skip", "layout": layout, "poisons": [SPIKE], "overrides": BASE + ["resilience.spike_policy=skip"]},
        {"name": "log", "layout": layout, "poisons": [SPIKE], "overrides": BASE + ["resilience.spike_policy=log"]},
    ]


@pytest.fixture(scope="module")
def spikes(tmp_path_factory):
    results = {}
    for name, layout in {"dp2": [1, 1], "pp2": [1, 2]}.items():
        tmp = tmp_path_factory.mktemp(name)
        out = tmp / "spikes.json"
        done = run_ranks(["tests/_spike_worker.py", str(out), *[json.dumps(r) for r in runs(str(tmp / "ck"), layout)]],
                         2, timeout=900)
        results[name] = (json.loads(out.read_text()), "\n".join(d.stdout for d in done))
    return results


def close(a, b, rel=1e-6):
    return a == pytest.approx(b, rel=rel, abs=1e-9)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(close(x, y) for k in a for x, y in zip(a[k], b[k]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_rolled_back_run_equals_a_run_that_never_saw_those_samples(spikes, layout):
    result, log = spikes[layout]
    straight, rolled = result["straight"], result["rollback"]
    assert "error" not in rolled and rolled["steps"] == 8, rolled.get("error")
    assert "step 6: loss spike: loss" in log and "rolling back to the latest checkpoint" in log, log[-3000:]
    assert "step 6: rolled back to" in log and "iter_0000004 (step 4)" in log, log[-3000:]
    assert f"steps over samples {ROLLED_OVER[0]}-{sum(ROLLED_OVER) - 1} (3 global batches" in log, log[-3000:]
    assert rolled["skipped_samples"] == straight["skipped_samples"] == [ROLLED_OVER]
    # steps 1-5, the vetoed spike step 6, then steps 5-8 again from the checkpoint of step 4
    assert len(rolled["history"]) == 6 + 4 and rolled["history"][5]["loss"] > 20 * rolled["history"][4]["loss"]
    assert same_weights(rolled["weights"], straight["weights"])
    assert close(rolled["norms"][-1], straight["norms"][-1])
    assert not same_weights(result["log"]["weights"], straight["weights"])  # the comparison can fail


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_resuming_after_a_rollback_is_exact(spikes, layout):
    result, _ = spikes[layout]
    resumed, rolled = result["resumed"], result["rollback"]
    assert "error" not in resumed and resumed["steps"] == 8, resumed.get("error")
    assert resumed["skipped_samples"] == [ROLLED_OVER]  # the checkpoint's trainer state
    assert same_weights(resumed["weights"], rolled["weights"])
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in rolled["history"][-2:]],
                                                                    rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_skip_applies_the_spike_nowhere_and_log_applies_it(spikes, layout):
    result, log = spikes[layout]
    skip, logged = result["skip"], result["log"]
    assert "step 6: loss spike" in log and "the step was skipped on every rank" in log
    assert skip["norms"][5] == skip["norms"][4] and skip["norms"][6] != skip["norms"][5]
    rates = [h["learning_rate"] for h in skip["history"]]
    assert rates[6] == rates[5] and skip["history"][5]["skipped_steps"] == 1 and skip["skipped_steps"] == 1
    assert logged["skipped_steps"] == 0 and logged["norms"][5] != logged["norms"][4]
    assert "logged only (resilience.spike_policy=log): the step was applied" in log


def test_the_detector_judges_against_the_running_median():
    detector = SpikeDetector(factor=3.0, window=3, grad_norm_limit=10.0)
    assert detector.loss_spike(100.0) is None  # fewer than `window` steps seen: not judged
    for loss in (4.0, 5.0, 6.0):
        detector.accept(loss)
    assert detector.loss_spike(14.9) is None
    assert "above 3 x the median 5 of the last 3 steps" in detector.loss_spike(15.1)
    assert detector.loss_spike(math.inf) is None  # not finite: the non-finite guard's
    assert detector.grad_norm_spike(10.5) and detector.grad_norm_spike(9.5) is None
    detector.accept(100.0)  # the window moves: 5, 6, 100
    assert detector.state() == [5.0, 6.0, 100.0] and detector.loss_spike(17.9) is None
    restored = SpikeDetector(3.0, 3)
    restored.load(detector.state())
    assert restored.loss_spike(18.1) == detector.loss_spike(18.1)


def test_the_sample_sequence_steps_over_its_ranges():
    ranges = merged([[32, 32], [96, 16], [64, 16]])
    assert ranges == [(32, 80), (96, 112)]
    assert [advance(0, n, ranges) for n in (16, 31, 32, 48, 64)] == [16, 31, 80, 112, 128]
    assert skip_ahead(40, ranges) == 80 and skip_ahead(80, ranges) == 80 and advance(80, 16, ranges) == 112
