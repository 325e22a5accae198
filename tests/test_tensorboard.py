"""The trainer writes every promised scalar, readable by TensorBoard's own event reader."""
import json

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from distributed import run_ranks

pytestmark = pytest.mark.slow  # multi-process or end to end: not in the fast tier

PROMISED = {
    "train": ["loss", "lm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "learning_rate", "grad_norm",
              "params_norm", "skipped_steps"],
    "perf": ["real_tokens_per_second", "tokens_per_second", "real_token_share", "samples_per_second", "model_tflops_per_rank", "iteration_time", "data_wait_time",
             "peak_memory_gb"],
    "eval": ["loss", "lm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "perplexity"],
}


def test_scalars_written(tmp_path):
    logdir = tmp_path / "tb"
    run = json.dumps({"name": "tb", "overrides": [f"logging.tensorboard_dir={logdir}", "eval.interval=2",
                                                  "eval.steps=1", "logging.interval=2",
                                                  "train.train_steps=4"]})
    run_ranks(["tests/_train_worker.py", str(tmp_path / "out.json"), "1", "2", run], 2, timeout=600)
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for section, names in PROMISED.items():
        for name in names:
            assert f"{section}/{name}" in tags, f"{section}/{name} missing from {sorted(tags)}"
            assert f"{section}-vs-samples/{name}" in tags
    steps = [e.step for e in events.Scalars("train/lm_loss")]
    assert steps == [2, 4]
    samples = [e.step for e in events.Scalars("train-vs-samples/lm_loss")]
    assert samples == [16, 32]  # global batch 8
    # speed in real tokens: the samples' non-padding tokens, counted here from the data, per sample;
    # the model computes those only (no context parallelism), so computed = real
    from pretrain.data.samples.synthetic import SyntheticDataset

    data = SyntheticDataset(200, 32, 5, 100000, seed=1234)  # _train_worker's TINY data
    shares = [sum(int(data[i]["padding_mask"].sum()) for i in range(start, start + 16)) / (16 * 32)
              for start in (0, 16)]
    assert max(shares) < 0.9
    per_sample = [r.value / s.value for r, s in zip(events.Scalars("perf/real_tokens_per_second"),
                                                   events.Scalars("perf/samples_per_second"))]
    assert per_sample == pytest.approx([share * 32 for share in shares], rel=1e-6)
    assert [e.value for e in events.Scalars("perf/real_token_share")] == [1.0, 1.0]
    for real, computed in zip(events.Scalars("perf/real_tokens_per_second"), events.Scalars("perf/tokens_per_second")):
        assert real.value == computed.value
