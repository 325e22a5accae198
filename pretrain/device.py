"""Device placement, our collectives, and the DeepSpeed internals we touch: the whole device
and communication surface of the project in one module.

The rules this module keeps, so that the code that runs on CPU/gloo runs unchanged on CUDA/NCCL:
- An NCCL process group has no CPU backend: every tensor handed to a collective lives on the
  model's device (`Parallel.device`). `all_reduce` and friends refuse a CPU tensor on such a
  group with an error naming the call, instead of NCCL's "No backend type associated with
  device type cpu" from deep inside.
- A tensor made without `device=` lands on the CPU: code that feeds a collective or the model
  says `device=` explicitly.
- Host syncs (`.item()`, `.tolist()`) are taken once per reduction, never per tensor.

The CPU test mode (env BERT_FAKE_GPU=1) puts the model on `fakegpu`, a second device type whose
only communication backend is bound to that device (pretrain/fakegpu): there a CPU tensor in a
collective or a mixed-device op fails as it would on a GPU.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch
import torch.distributed as dist

FAKE_GPU_ENV = "BERT_FAKE_GPU"
# Backends that have no CPU implementation: a CPU tensor in their collectives is a device bug.
DEVICE_ONLY_BACKENDS = ("nccl", "fakeccl")


class DeviceError(RuntimeError):
    """A tensor on the wrong device, or a rank without a usable device."""


# ----------------------------------------------------------------------------- placement
def fake_gpu_requested(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(FAKE_GPU_ENV, "0") not in ("", "0")


def select_device(local_rank: int, environ=None) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK (DeepSpeed uses the raw LOCAL_RANK as the ordinal
    too, so the two must agree), fakegpu:LOCAL_RANK in the CPU test mode, else the CPU."""
    env = os.environ if environ is None else environ
    if fake_gpu_requested(env):
        from . import fakegpu

        fakegpu.enable()
        device = _checked_ordinal(fakegpu.DEVICE_TYPE, local_rank, fakegpu.device_count(), env)
        fakegpu.set_device(device.index)  # as for CUDA: deepspeed.zero.Init places on the current device
        return device
    if torch.cuda.is_available():
        device = _checked_ordinal("cuda", local_rank, torch.cuda.device_count(), env)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


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
    """TF32 for fp32 matrix products and convolutions on a GPU (torch's default is off for
    matmuls: NVIDIA's BERT and most GPU users turn it on; train.tf32=false gives exact fp32)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def describe(parallel) -> str:
    """One log line: where this job runs."""
    return (f"{parallel.world_size} rank(s) on {parallel.device.type} (this rank: {parallel.device}, backend "
            f"{parallel.backend}): TP{parallel.tp_size} x PP{parallel.pp_size} x DP{parallel.dp_size}")


def backend_for(device: torch.device) -> str:
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    from . import fakegpu

    if device.type == fakegpu.DEVICE_TYPE:
        return fakegpu.BACKEND
    raise DeviceError(f"no communication backend for device type {device.type!r}")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy (for files and numpy); one device-to-host transfer."""
    return tensor.detach().to("cpu")


# ----------------------------------------------------------------------------- collectives
def _check(tensor: torch.Tensor, group, call: str) -> None:
    if tensor.device.type == "cpu" and dist.get_backend(group) in DEVICE_ONLY_BACKENDS:
        raise DeviceError(f"{call}: a CPU tensor on a {dist.get_backend(group)} process group, which has no "
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


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj` (torch serialises through the group's own device)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def reduce_floats(values, device: torch.device, group=None, op: str = "sum") -> list[float]:
    """Reduce a few host numbers over `group` in one collective (float64, on `device`); one host sync."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return all_reduce(tensor, group, op).tolist()


def barrier(group=None) -> None:
    dist.barrier(group=group)


# ----------------------------------------------------------------------------- DeepSpeed internals
def is_zero3_param(param: torch.Tensor) -> bool:
    """A parameter partitioned by ZeRO-3 (deepspeed.zero.Init gives it ds_id and ds_tensor)."""
    return hasattr(param, "ds_id")


def zero3_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's flat ZeRO-3 partition of `param` (padding past ds_numel on the last rank)."""
    return param.ds_tensor


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the (TP-local) parameter, also while ZeRO-3 holds only a partition of it."""
    return param.ds_shape if is_zero3_param(param) else param.shape


def hp_fragment(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(start in the rank's flat fp32 partition, numel, start in the flat parameter) of this
    parameter's piece under ZeRO-1/2 and DeepSpeed's BF16_Optimizer (DeepSpeed's `_hp_mapping`,
    utils/tensor_fragment.py), or None when the parameter lies entirely on other ranks."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.get_hp_fragment_address()
    return address.start, address.numel, mapping.lp_fragment_address.start


def set_global_grad_norm(engine, norm: float) -> None:
    """What engine.get_global_grad_norm() reports after our own clipping replaced DeepSpeed's."""
    engine._global_grad_norm = norm


def loss_scale(engine) -> float | None:
    """The fp16 dynamic loss scale (None if the wrapper has none). Every DeepSpeed fp16 wrapper
    (FP16_Optimizer, FP16_UnfusedOptimizer, the ZeRO optimizers) exposes the `loss_scale`
    property; only some have `cur_scale` (FP16_UnfusedOptimizer keeps it in loss_scale_config).
    Wrappers without loss scaling report 1.0."""
    scale = getattr(engine.optimizer, "loss_scale", None)
    return None if scale is None else float(scale)


@contextlib.contextmanager
def no_optimizer_steps(optimizer: torch.optim.Optimizer):
    """Suppress optimizer.step() while DeepSpeed builds its engine.

    DeepSpeed's FP16_UnfusedOptimizer (fp16, and bf16 at ZeRO-0) and FP16_Optimizer call
    `optimizer.step()` once with zero gradients from their constructor
    (deepspeed/runtime/fp16/unfused_optimizer.py, initialize_optimizer_states). With decoupled
    weight decay that is a real update: AdamW multiplies every decayed weight by (1 - lr*wd),
    LAMB (trust ratio 1/wd on the update wd*w) by (1 - lr), and both start their step counters
    at 1. Our optimizers create their state lazily, so skipping that step loses nothing.

    The guard is an instance-level `step` that defers to the class's own; it stays in place
    afterwards, because the LR scheduler built inside deepspeed.initialize wraps whatever
    `optimizer.step` is at that moment.
    """
    def guarded_step(self, *args, **kwargs):
        if self._deepspeed_constructing:
            return None
        return type(self).step(self, *args, **kwargs)

    optimizer._deepspeed_constructing = True
    optimizer.step = types.MethodType(guarded_step, optimizer)
    try:
        yield optimizer
    finally:
        optimizer._deepspeed_constructing = False
