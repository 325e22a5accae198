"""The device module's rules that need no second device: GPU ordinals, launcher flags the tools
must accept, and RNG states written on one device type resumed on another."""
import random

import numpy as np
import pytest
import torch

from pretrain.distributed import device
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


def test_cpu_device_and_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a GPU machine's CPU tier
    assert device.select_device(0, {}) == torch.device("cpu")
    assert device.backend_for(torch.device("cpu")) == "gloo"
    assert device.backend_for(torch.device("cuda", 1)) == "nccl"


def test_gpu_math_is_chosen_explicitly():
    """TF32 as configured and SDPA's cuDNN backend off on a GPU (torch 2.13 prefers it on sm90 at
    attention dropout 0, where its masked backward has returned NaN); the CPU's settings untouched."""
    cuda = torch.backends.cuda
    before = (cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, cuda.cudnn_sdp_enabled())
    try:
        cuda.enable_cudnn_sdp(True)
        cuda.matmul.allow_tf32 = True
        device.configure_math(torch.device("cpu"), tf32=False)
        assert cuda.cudnn_sdp_enabled() and cuda.matmul.allow_tf32
        device.configure_math(torch.device("cuda", 0), tf32=False)
        assert not cuda.cudnn_sdp_enabled() and not cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert cuda.mem_efficient_sdp_enabled()  # the kernel that takes the additive padding mask
        device.configure_math(torch.device("cuda", 0), tf32=True)
        assert cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        cuda.enable_cudnn_sdp(before[2])


def test_bf16_is_refused_below_ampere():
    """torch.cuda.is_bf16_supported() (and DeepSpeed's check) accept a V100 or T4, where bf16 is
    emulated and attention loses its fused kernels."""
    gpu = torch.device("cuda", 0)
    problem = device.precision_problem(gpu, "bf16", (7, 0), "Tesla V100-SXM2-32GB")
    assert problem == ("train.precision bf16 needs a GPU of compute capability 8.0 or later (Ampere); cuda:0 is a "
                       "Tesla V100-SXM2-32GB of 7.0, where bf16 is emulated and attention loses its fused kernels: "
                       "use train.precision=fp16 (dynamic loss scaling) or fp32")
    assert device.precision_problem(gpu, "bf16", (7, 5), "Tesla T4") is not None
    assert device.precision_problem(gpu, "bf16", (8, 0), "A100") is None
    assert device.precision_problem(gpu, "bf16", (9, 0), "H100") is None
    assert device.precision_problem(gpu, "fp16", (7, 0), "Tesla V100") is None
    assert device.precision_problem(torch.device("cpu"), "bf16") is None


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
