"""The device module's rules that need no second device: GPU ordinals, launcher flags the tools
must accept, and RNG states written on one device type resumed on another."""
import random

import numpy as np
import pytest
import torch

from pretrain import device
from pretrain.checkpoint.exact import restore_rng_state, rng_state
from pretrain.model.rng import MODEL_PARALLEL_STREAM, RngTracker, seed_streams


def test_local_rank_beyond_the_visible_gpus_is_refused(monkeypatch):
    """DeepSpeed takes LOCAL_RANK itself as the device ordinal; a rank with no GPU of its own
    (per-task binding, or more ranks than GPUs) is named instead of wrapped onto another GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(device.DeviceError, match=r"LOCAL_RANK 1 has no cuda device: this process sees 1 "
                                                 r"\(CUDA_VISIBLE_DEVICES='3'\)"):
        device.select_device(1, {"CUDA_VISIBLE_DEVICES": "3"})


def test_cpu_device_and_backend():
    assert device.select_device(0, {}) == torch.device("cpu")
    assert device.backend_for(torch.device("cpu")) == "gloo"
    assert device.backend_for(torch.device("cuda", 1)) == "nccl"


@pytest.mark.parametrize("module,argv", [
    ("tools.fill_mask", ["--checkpoint", "ckpt", "a [MASK] b"]),
    ("tools.extract_features", ["--checkpoint", "c", "--input-file", "i", "--output-file", "o"]),
    ("tools.convert_checkpoint", ["native-to-hf", "--input", "i", "--output", "o"]),
    ("pretrain.main", ["--config", "c.yaml"]),
    ("finetune.main", ["mrpc"]),
])
def test_programs_accept_the_deepspeed_launchers_local_rank(module, argv):
    """`deepspeed` appends --local_rank=N to every program it starts."""
    import importlib

    parse_args = importlib.import_module(module).parse_args
    for flag in (["--local_rank=1"], ["--local-rank", "1"]):
        parse_args(argv + flag)  # would exit 2 with "unrecognized arguments"


def gpu_written_state():
    """The RNG file of a rank that trained on a GPU: CUDA (Philox) states for the dropout streams."""
    philox = torch.arange(16, dtype=torch.uint8)
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "streams": {MODEL_PARALLEL_STREAM: philox.clone()}, "cuda": philox.clone()}


@pytest.mark.parametrize("recorded", [True, False], ids=["device-recorded", "older-file"])
def test_gpu_written_rng_state_is_not_replayed_on_cpu(recorded):
    tracker = RngTracker(torch.device("cpu"))
    seed_streams(tracker, 1, 0, 0, 0)
    state = gpu_written_state()
    if recorded:
        state["device_type"] = "cuda"
    assert restore_rng_state(state, tracker) is False  # the caller reseeds the streams
    with tracker.fork():
        torch.rand(3)  # "RNG state is wrong size" had the CUDA state been loaded


def test_rng_state_round_trip_on_the_same_device():
    tracker = RngTracker(torch.device("cpu"))
    seed_streams(tracker, 1, 0, 0, 0)
    state = rng_state(tracker)
    assert state["device_type"] == "cpu"
    with tracker.fork():
        expected = torch.rand(3)
    tracker.load_state_dict(state["streams"])
    other = RngTracker(torch.device("cpu"))
    assert restore_rng_state(state, other) is True
    with other.fork():
        assert torch.equal(torch.rand(3), expected)
