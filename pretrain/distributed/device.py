"""Device placement and our collectives: the whole device and communication surface of the
project in one module (the DeepSpeed internals it relies on are in internals.py).

The rules this module keeps, so that the code that runs on CPU/gloo runs unchanged on CUDA/NCCL:
- An NCCL process group has no CPU backend: every tensor handed to a collective lives on the
  model's device (`Parallel.device`). `all_reduce` and friends refuse a CPU tensor on such a
  group with an error naming the call, instead of NCCL's "No backend type associated with
  device type cpu" from deep inside.
- A tensor made without `device=` lands on the CPU: code that feeds a collective or the model
  says `device=` explicitly.
- Host syncs (`.item()`, `.tolist()`) are taken once per reduction, never per tensor.

The CPU test mode (env BERT_FAKE_GPU=1) puts the model on `fakegpu`, a second device type whose
only communication backend is bound to that device: there a CPU tensor in a collective or a
mixed-device op fails as it would on a GPU. The device is the test suite's own package (`fakegpu`,
in the repository's tests/bert-fakegpu/, installed by the test set-up), not part of the product:
this module knows its names, loads it only when asked, and says how to install it where it is missing.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ..common.errors import UserError

FAKE_GPU_ENV = "BERT_FAKE_GPU"
# The CPU test device's type and backend (fakegpu.DEVICE_TYPE, fakegpu.BACKEND), named here so that
# nothing but select_device imports the package
FAKE_DEVICE_TYPE = "fakegpu"
FAKE_BACKEND = "fakeccl"
FAKE_GPU_MISSING = (f"{FAKE_GPU_ENV}=1 asks for the CPU test device (the fakegpu package), which is not installed: "
                    "tools/install.sh installs it with the test set-up, or run pip install -e tests/bert-fakegpu "
                    "from the repository's root")
# Backends that have no CPU implementation: a CPU tensor in their collectives is a device bug.
DEVICE_ONLY_BACKENDS = ("nccl", FAKE_BACKEND)


class DeviceError(UserError, RuntimeError):
    """A rank without a usable device (more ranks on a node than it has GPUs, or the CPU test device
    asked for and not installed): a launch to fix."""


class DevicePlacementError(RuntimeError):
    """A tensor on the wrong device for its collective: a bug in our code, not in the user's
    input, so it is no UserError and keeps its traceback."""


# ----------------------------------------------------------------------------- placement
def fake_gpu_requested(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(FAKE_GPU_ENV, "0") not in ("", "0")


def select_device(local_rank: int, environ=None) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK (DeepSpeed uses the raw LOCAL_RANK as the ordinal
    too, so the two must agree), fakegpu:LOCAL_RANK in the CPU test mode, else the CPU."""
    env = os.environ if environ is None else environ
    if fake_gpu_requested(env):
        fakegpu = load_test_device()
        device = _checked_ordinal(FAKE_DEVICE_TYPE, local_rank, fakegpu.device_count(), env)
        fakegpu.set_device(device.index)  # as for CUDA: deepspeed.zero.Init places on the current device
        return device
    if torch.cuda.is_available():
        device = _checked_ordinal("cuda", local_rank, torch.cuda.device_count(), env)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def load_test_device():
    """The CPU test device's package, enabled; a DeviceError (one line) where it is not installed."""
    try:
        import fakegpu
    except ModuleNotFoundError as error:
        if error.name != "fakegpu":  # the package is there but something it imports is not: a bug, traced
            raise
        fakegpu = None
    # a folder named fakegpu without the package's files on sys.path imports as an empty namespace
    # package: not installed either
    if getattr(fakegpu, "enable", None) is None:
        raise DeviceError(FAKE_GPU_MISSING)
    fakegpu.enable()
    return fakegpu


def _checked_ordinal(device_type: str, local_rank: int, count: int, env) -> torch.device:
    if not 0 <= local_rank < count:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError(
            f"LOCAL_RANK {local_rank} has no {device_type} device: this process sees {count} "
            f"(CUDA_VISIBLE_DEVICES={visible!r}). Start at most one rank per visible GPU; under SLURM "
            "bind GPUs per node (--gpus-per-node), not per task (--gpus-per-task), since DeepSpeed "
            "uses LOCAL_RANK itself as the device ordinal.")
    return torch.device(device_type, local_rank)


def configure_math(device: torch.device, tf32: bool) -> None:
    """The GPU math settings of this process, chosen explicitly:

    - TF32 for fp32 matrix products and convolutions (torch's default is off for matmuls: NVIDIA's
      BERT and most GPU users turn it on; train.tf32=false gives exact fp32);
    - no cuDNN attention: torch 2.13 puts SDPA's cuDNN backend first on sm90/sm100 with cuDNN
      > 9.15 wherever it applies, which for BERT is attention dropout 0 (evaluation, fine-tuning
      with dropout off; it cannot take 0.1), and there its backward returns NaN query gradients
      with an explicit mask for some sequence lengths (pytorch/pytorch#196678, fixed with cuDNN
      9.26). The memory-efficient kernel takes our additive float mask at every dropout, on every
      GPU from sm50 (flash attention takes no mask at all).
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.enable_cudnn_sdp(False)


# the compute capability bf16 needs: below it (V100 sm70, T4 sm75) bf16 is emulated, and SDPA's fused
# kernels take no bf16 (flash and cuDNN need sm80, memory-efficient attention has bf16 from sm80), so
# attention falls back to the math kernel and its [seq, seq] matrices
BF16_MIN_CAPABILITY = (8, 0)


def precision_problem(device: torch.device, precision: str, capability=None, name: str | None = None) -> str | None:
    """Why this device cannot train in `precision`, or None. torch.cuda.is_bf16_supported() (and
    DeepSpeed's check, which asks it) says yes on sm70/sm75, where bf16 is only emulated.
    `capability` (major, minor) and `name`: the device's, read from it when not given."""
    if device.type != "cuda" or precision != "bf16":
        return None
    capability = tuple(capability or torch.cuda.get_device_capability(device))
    if capability >= BF16_MIN_CAPABILITY:
        return None
    name = name or torch.cuda.get_device_name(device)
    return (f"train.precision bf16 needs a GPU of compute capability {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]} "
            f"or later (Ampere); {device} is a {name} of {capability[0]}.{capability[1]}, where bf16 is emulated "
            "and attention loses its fused kernels: use train.precision=fp16 (dynamic loss scaling) or fp32")


# megatron-core's column-parallel linear overlaps the input-gradient all-reduce of tensor parallelism
# with the weight-gradient GEMM; the overlap keeps its order only with one CUDA work queue
# (it warns otherwise: megatron/core/tensor_parallel/layers.py). Read when the CUDA context is made.
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def prepare_cuda_environment(tensor_parallel: int, environ=None) -> str | None:
    """Before any CUDA context exists in this process: CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor
    parallelism (Megatron-LM's requirement), unless the user set it. Returns a line saying what was
    set (None when nothing was). Harmless on the CPU."""
    env = os.environ if environ is None else environ
    if tensor_parallel > 1 and MAX_CONNECTIONS_ENV not in env:
        env[MAX_CONNECTIONS_ENV] = "1"
        return f"{MAX_CONNECTIONS_ENV}=1 (tensor parallelism: megatron-core's gradient all-reduce overlap keeps its order)"
    return None


def prepare_extensions_dir(environ=None) -> None:
    """JIT-built extensions (DeepSpeed's CPU communication op, its CPU Adam; the tests' device) go to
    this Python environment's own directory unless the user set TORCH_EXTENSIONS_DIR. torch's
    default, ~/.cache/torch_extensions, is shared by all of a user's checkouts, and the build hash
    covers the sources' paths: two checkouts rebuild the op over each other, 20-30 s per launch."""
    env = os.environ if environ is None else environ
    directory = os.path.join(sys.prefix, "torch_extensions")
    if "TORCH_EXTENSIONS_DIR" not in env and (os.path.isdir(directory) or os.access(sys.prefix, os.W_OK)):
        env["TORCH_EXTENSIONS_DIR"] = directory


# What torch offers for hangs, on unless the user chose otherwise: the flight recorder (the last
# collectives of every process group, for the watchdog's heartbeat: pretrain/resilience/watchdog.py, gloo and
# NCCL), and on NCCL its dump to a file per rank when a collective times out, the desync report
# naming the rank that did not join, and the monitor that ends a rank whose NCCL watchdog is stuck.
HANG_DIAGNOSTICS_ENV = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DESYNC_DEBUG": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}


def prepare_hang_diagnostics(environ=None) -> None:
    """Before the process groups start (torch reads these once, at their creation)."""
    env = os.environ if environ is None else environ
    for name, value in HANG_DIAGNOSTICS_ENV.items():
        env.setdefault(name, value)


def describe(parallel) -> str:
    """One log line: where this job runs."""
    return (f"{parallel.world_size} rank(s) on {parallel.device.type} (this rank: {parallel.device}, backend "
            f"{parallel.backend}): TP{parallel.tp_size} x PP{parallel.pp_size} x DP{parallel.dp_size}")


def backend_for(device: torch.device) -> str:
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    if device.type == FAKE_DEVICE_TYPE:
        return FAKE_BACKEND
    raise DeviceError(f"no communication backend for device type {device.type!r}")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (for files and numpy); one device-to-host transfer."""
    return tensor.detach().to("cpu")


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the work queued there: on CUDA a copy from
    pageable memory would wait for the stream (the backward pass, inside an optimizer step), so it is
    pinned and copied non-blocking (torch's pinned allocator keeps the block until the copy is done)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


# ----------------------------------------------------------------------------- collectives
def _check(tensor: torch.Tensor, group, call: str) -> None:
    if tensor.device.type == "cpu" and dist.get_backend(group) in DEVICE_ONLY_BACKENDS:
        raise DevicePlacementError(f"{call}: a CPU tensor on a {dist.get_backend(group)} process group, which has no "
                          "CPU backend; create the tensor on the model's device")


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over `group` (None: the world); returns the tensor."""
    _check(tensor, group, "all_reduce")
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's copy of `tensor` (same shape on every rank), on the tensor's device."""
    _check(tensor, group, "all_gather")
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: every rank's `tensor` concatenated along dim 0. Backward: the gradient of this
    rank's piece summed over the ranks (each rank's loss reads every rank's piece), so that with
    the data-parallel gradient averaging after it the step is that of the mean loss over the group."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rows = group, tensor.shape[0]
        return torch.cat(all_gather(tensor, group), dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = all_reduce(grad.contiguous().clone(), ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows:(rank + 1) * ctx.rows], None


def all_gather_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's `tensor` (same shape on every rank) concatenated along dim 0, rank order, with
    gradients flowing back to each rank's own piece (contrastive losses' negatives from every rank)."""
    if group is not None and dist.get_world_size(group) == 1:
        return tensor
    return _AllGatherWithGrad.apply(tensor, group)


def exchange(sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor], group) -> None:
    """Point-to-point within `group`: each tensor of `sends` to its group rank, each buffer of
    `receives` filled from its group rank, in one batch (the peers post the matching calls)."""
    start_exchange(sends, receives, group).wait()


class Exchange:
    """Point-to-point transfers in flight (start_exchange); `wait` completes them."""

    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def start_exchange(sends: list | dict, receives: list | dict, group) -> Exchange:
    """`exchange` without waiting, so that computation overlaps the transfers. `sends` and
    `receives` are {group rank: tensor} or lists of (group rank, tensor): every peer posts its
    transfers to another in the same order (NCCL matches them by order)."""
    ops = []
    for peer, tensor in (sends.items() if isinstance(sends, dict) else sends):
        _check(tensor, group, "exchange")
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group=group, group_peer=peer))
    for peer, buffer in (receives.items() if isinstance(receives, dict) else receives):
        _check(buffer, group, "exchange")
        ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer))
    return Exchange(dist.batch_isend_irecv(ops) if ops else [])


class _AllReduceWithGrad(torch.autograd.Function):
    """Forward: the sum over the group. Backward: the gradient summed over the group (every rank's
    loss reads the sum)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return all_reduce(tensor.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


def all_reduce_with_grad(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of every rank's `tensor` over `group`, with gradients (the sum of every rank's) back to each."""
    if group is not None and dist.get_world_size(group) == 1:
        return tensor
    return _AllReduceWithGrad.apply(tensor, group)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj` (torch serialises through the group's own device)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def reduce_floats(values, device: torch.device, group=None, op: str = "sum") -> list[float]:
    """Reduce a few host numbers over `group` in one collective (float64, on `device`); one host sync."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return all_reduce(tensor, group, op).tolist()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU, where work is not queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_module(device: torch.device):
    """torch.cuda, or torch.fakegpu in the CPU test mode: the devices whose allocations are counted."""
    return getattr(torch, device.type) if device.type in ("cuda", FAKE_DEVICE_TYPE) else None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of the device's allocated memory (nothing on the CPU)."""
    module = _memory_module(device)
    if module is not None:
        module.reset_peak_memory_stats(device)


def device_memory_allocated(device: torch.device) -> int | None:
    """The device's allocated bytes now; None on the CPU."""
    module = _memory_module(device)
    return module.memory_allocated(device) if module is not None else None


def peak_memory_allocated(device: torch.device) -> int | None:
    """The device's allocated peak in bytes since the last reset; None on the CPU (no allocator
    of its own to read)."""
    module = _memory_module(device)
    return module.max_memory_allocated(device) if module is not None else None


def barrier(group=None) -> None:
    dist.barrier(group=group)
