"""Every DeepSpeed and megatron-core internal this project relies on, in one module.

Internal means anything those libraries do not document as API: private attributes (`_hp_mapping`,
`_global_grad_norm`, megatron's `_forward_impl`), and the bookkeeping attributes of DeepSpeed's
optimizer wrappers and ZeRO-3 parameters. Nothing outside this module names them; `PINNED` lists
each one with the class that holds it, and tests/test_internals.py checks every entry against the
installed versions (in their source, and on real engines), so an upgrade that renames one fails
there, in one place, instead of deep inside a training run.
"""
from __future__ import annotations

import contextlib
import datetime
import types
from typing import NamedTuple

import torch

# Library module -> the internal names of it this module reads or writes: attributes its classes
# set on their instances (or on parameters), and methods we override or call.
PINNED: dict[str, tuple[str, ...]] = {
    "deepspeed.runtime.engine": (
        "basic_optimizer", "global_steps", "global_samples", "_global_grad_norm", "enable_backward_allreduce",
        "clip_fp32_gradients", "skipped_steps", "checkpoint_engine"),
    "deepspeed.runtime.zero.stage_1_and_2": (  # DeepSpeedZeroOptimizer (ZeRO-1/2)
        "bit16_groups", "single_partition_of_fp32_groups", "real_dp_process_group", "zenflow",
        "gradient_accumulation_dtype", "communication_data_type", "loss_scaler",
        "reduce_ipg_grads", "overlap_comm"),  # the last two: waiting_calls
    "deepspeed.runtime.bf16_optimizer": (  # BF16_Optimizer
        "bf16_groups", "fp32_groups_flat_partition", "real_dp_process_group", "using_real_optimizer",
        "grad_acc_dtype"),
    "deepspeed.runtime.zero.stage3": (  # DeepSpeedZeroOptimizer_Stage3
        "fp16_groups", "fp32_partitioned_groups_flat", "sub_group_to_group_id", "params_in_nvme_and_cpu",
        "swap_optimizer", "gradient_accumulation_dtype", "communication_data_type", "loss_scaler",
        "__reduce_and_partition_ipg_grads", "independent_gradient_partition_epilogue", "parameter_offload"),
    "deepspeed.runtime.fp16.unfused_optimizer": (  # FP16_UnfusedOptimizer
        "fp16_groups", "fp32_groups", "clip_grad", "_global_grad_norm", "low_precision_dtype", "loss_scale_config",
        "fused_lamb_legacy", "overflow", "_skip_invalid_grad_norm", "_update_scale"),
    "deepspeed.runtime.fp16.loss_scaler": ("raise_error_at_min_scale", "use_grad_scaling", "cur_scale"),
    "deepspeed.runtime.zero.partition_parameters": (  # what deepspeed.zero.Init adds to each parameter
        "ds_id", "ds_tensor", "ds_shape", "ds_numel", "ds_process_group", "partition_numel"),
    "deepspeed.utils.mixed_precision_linkage": ("_hp_mapping",),  # ZeRO-1/2, bf16: parameter -> fp32 fragment
    "deepspeed.utils.tensor_fragment": ("get_hp_fragment_address", "lp_fragment_address"),
    "megatron.core.tensor_parallel.layers": ("_forward_impl", "tensor_model_parallel", "partition_dim"),
    "deepspeed.comm.torch": ("build_shm_op", "shm_comm_op"),  # TorchBackend's CPU shared-memory all-reduce op
    "deepspeed.comm.comm": ("cdb",),  # the backend deepspeed.init_distributed started
    # the calls in which a rank waits for the others (waiting_calls: the straggler figures, the timers)
    "deepspeed.runtime.zero.parameter_offload": ("get_param_coordinator",),
    "deepspeed.runtime.zero.partitioned_param_coordinator": ("fetch_sub_module",),
    "deepspeed.runtime.pipe.engine": ("_INSTRUCTION_MAP", "_aggregate_total_loss"),
    # the class new_group constructs for each gloo group (one_gloo_device_per_process)
    "torch.distributed.distributed_c10d": ("ProcessGroupGloo",),
}


# ----------------------------------------------------------------------------- deepspeed.comm
@contextlib.contextmanager
def without_shared_memory_comm():
    """DeepSpeed's CPU backend JIT-builds its shared-memory all-reduce op in every process it starts
    (30-40 s of compiling on 2 cores, once per extensions directory) and maps a 69 MB /dev/shm
    buffer per rank that it never unlinks, for `inference_all_reduce` alone: DeepSpeed's inference
    kernels call it, its training engine never does (every reduction goes through
    torch.distributed). Inside this block its backend starts without the op."""
    import importlib

    # by name: `import deepspeed.comm.torch as m` gives the torch package (deepspeed.comm's attribute)
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")

    build = ds_comm_torch.build_shm_op
    ds_comm_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm_torch.build_shm_op = build


def uses_shared_memory_comm() -> bool:
    """Whether deepspeed.init_distributed started its CPU shared-memory all-reduce op."""
    import deepspeed.comm.comm as ds_comm

    return getattr(getattr(ds_comm, "cdb", None), "shm_comm_op", None) is not None


# ----------------------------------------------------------------------------- torch.distributed
def one_gloo_device_per_process() -> None:
    """Make every gloo process group of this process share the transport device of the first.

    torch gives each gloo group its own device, and each device its own event-loop thread that
    wakes every 10 ms whether or not the group is used (gloo/transport/tcp/loop.cc). megatron-core
    builds 18 groups for a 2-rank job and DeepSpeed's pipeline engine 6 more per engine: measured
    on 2 CPU cores, those idle wake-ups took 15-18 % of the machine during the layout tests. One
    device serves any number of groups (each group still has its own pairs and sockets); the first
    group's devices are the ones torch chooses (GLOO_SOCKET_IFNAME, TORCH_GLOO_LAZY_INIT).
    Idempotent; affects only gloo, the CPU backend (NCCL groups are untouched)."""
    import importlib

    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    torch_class = c10d.ProcessGroupGloo
    if getattr(torch_class, "shares_one_device", False):
        return
    devices = []

    class _InstanceCheck(type(torch_class)):
        # torch hands back the groups it holds as its own class: isinstance checks against the
        # name we replace (distributed_c10d._set_pg_timeout) must still accept them
        def __instancecheck__(cls, instance):
            return isinstance(instance, torch_class)

    class SharedDeviceGloo(torch_class, metaclass=_InstanceCheck):
        shares_one_device = True

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            if not devices:  # the first group: torch's own choice of devices, kept for the others
                super().__init__(store, rank, size, timeout)
                devices.extend(self.options._devices)
                return
            options = torch_class._Options()
            options._devices, options._timeout, options._threads = devices, timeout, 2 * len(devices)
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


# ----------------------------------------------------------------------------- megatron-core
def is_tp_sharded(param: torch.Tensor) -> bool:
    """megatron-core marks sharded weights with tensor_model_parallel=True; everything else is
    replicated over TP (including biases of row-parallel layers)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """The dimension megatron-core cut a TP-sharded parameter along; None when replicated."""
    return param.partition_dim if is_tp_sharded(param) else None


class PlainGemmOverride:
    """Mixin for megatron-core's parallel linears: their `_forward_impl` (the GEMM with the TP
    communication of its backward) becomes the subclass's `plain_forward` (one F.linear, the bias
    inside the GEMM) wherever megatron's autograd function has nothing to overlap: on the CPU, and
    on an accelerator when its backward all-reduces no input gradient (tensor parallelism 1, and
    every row-parallel linear). Megatron's own runs for column-parallel linears at TP > 1 on an
    accelerator, where its backward overlaps the input-gradient all-reduce with the weight-gradient
    GEMM."""

    plain_forward = None  # staticmethod(f(input, weight, *args, **kwargs)), set by the subclass

    def _forward_impl(self, input, weight, *args, **kwargs):
        if weight.device.type == "cpu" or not kwargs.get("allreduce_dgrad", False):
            return type(self).plain_forward(input, weight, *args, **kwargs)
        return super()._forward_impl(input, weight, *args, **kwargs)


class GemmOperandsOverride:
    """Mixin for megatron-core's parallel linears: the subclass's `gemm_operands(weight, bias)`
    rewrites what the GEMM takes, inside `_forward_impl`: after the module's hooks, so ZeRO-3 has
    gathered the weight, and with autograd carrying the gradient back to the stored layout."""

    def gemm_operands(self, weight, bias):
        raise NotImplementedError

    def _forward_impl(self, input, weight, bias=None, **kwargs):
        weight, bias = self.gemm_operands(weight, bias)
        return super()._forward_impl(input=input, weight=weight, bias=bias, **kwargs)


# ----------------------------------------------------------------------------- ZeRO-3 parameters
def is_zero3_param(param: torch.Tensor) -> bool:
    """A parameter partitioned by ZeRO-3 (deepspeed.zero.Init gives it ds_id and ds_tensor)."""
    return hasattr(param, "ds_id")


def zero3_partition(param: torch.Tensor) -> torch.Tensor:
    """This rank's flat ZeRO-3 partition of `param` (padding past ds_numel on the last rank)."""
    return param.ds_tensor


def zero3_values(param: torch.Tensor) -> torch.Tensor:
    """This rank's elements of `param` under ZeRO-3: its partition less the padding past the
    parameter's end (whose memory DeepSpeed leaves as it found it)."""
    size, numel, group = param.partition_numel(), param.ds_numel, param.ds_process_group
    start = torch.distributed.get_rank(group) * size
    return param.ds_tensor.narrow(0, 0, max(0, min(size, numel - start)))


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the (TP-local) parameter, also while ZeRO-3 holds only a partition of it."""
    return param.ds_shape if is_zero3_param(param) else param.shape


class Zero3Partition(NamedTuple):
    size: int  # elements per rank (the parameter padded to a multiple of the DP size)
    numel: int  # elements of the whole parameter
    process_group: object  # the group it is partitioned over


def zero3_partition_info(param: torch.Tensor) -> Zero3Partition:
    return Zero3Partition(param.partition_numel(), param.ds_numel, param.ds_process_group)


# ----------------------------------------------------------------------------- ZeRO-1/2 and bf16 fragments
def hp_fragment(param: torch.Tensor) -> tuple[int, int, int] | None:
    """(start in the rank's flat fp32 partition, numel, start in the flat parameter) of this
    parameter's piece under ZeRO-1/2 and DeepSpeed's BF16_Optimizer (DeepSpeed's `_hp_mapping`,
    utils/tensor_fragment.py), or None when the parameter lies entirely on other ranks."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.get_hp_fragment_address()
    return address.start, address.numel, mapping.lp_fragment_address.start


# ----------------------------------------------------------------------------- optimizer wrappers
class FlatPartitions(NamedTuple):
    """What a ZeRO-1/2 or BF16_Optimizer wrapper steps: per param group, the model parameters
    and this rank's flat fp32 partition, partitioned over one DP group per param group."""

    model_groups: list
    fp32_partitions: list
    process_groups: list


class Zero3Groups(NamedTuple):
    """ZeRO-3: per sub-group, the model parameters and the flat fp32 tensor of their partitions,
    and the client param group each sub-group belongs to."""

    model_groups: list
    fp32_flat: list
    group_of_sub_group: dict


class WholeCopies(NamedTuple):
    """FP16_UnfusedOptimizer (fp16, bf16 at ZeRO-0): one whole fp32 copy per model parameter."""

    model_groups: list
    fp32_copies: list


def optimizer_wrapper(engine):
    """DeepSpeed's wrapper around our optimizer, read as one of FlatPartitions, Zero3Groups or
    WholeCopies; the client torch optimizer itself when DeepSpeed steps it directly (ZeRO-0
    fp32). Raises NotImplementedError for wrappers whose layout we do not read (fused fp16,
    ZenFlow, NVMe offload, MoE groups are checked by the caller)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    kind = type(opt).__name__
    if isinstance(opt, DeepSpeedZeroOptimizer):
        if getattr(opt, "zenflow", False):
            raise NotImplementedError(f"{kind} with ZenFlow is not supported")
        return FlatPartitions(opt.bit16_groups, opt.single_partition_of_fp32_groups, opt.real_dp_process_group)
    if isinstance(opt, BF16_Optimizer):
        if not opt.using_real_optimizer:
            raise ValueError(f"{kind} has no client optimizer")
        return FlatPartitions(opt.bf16_groups, opt.fp32_groups_flat_partition, opt.real_dp_process_group)
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        if getattr(opt, "params_in_nvme_and_cpu", False) or getattr(opt, "swap_optimizer", False):
            raise NotImplementedError(f"{kind} with NVMe offload is not supported")
        return Zero3Groups(opt.fp16_groups, opt.fp32_partitioned_groups_flat, opt.sub_group_to_group_id)
    if isinstance(opt, FP16_UnfusedOptimizer):
        return WholeCopies(opt.fp16_groups, opt.fp32_groups)
    if isinstance(opt, (FP16_Optimizer, ZeROOptimizer)):
        raise NotImplementedError(f"DeepSpeed optimizer wrapper {kind} is not supported (supported: ZeRO-0 fp32, "
                                  "ZeRO-1/2, ZeRO-3, BF16_Optimizer, FP16_UnfusedOptimizer)")
    if isinstance(opt, torch.optim.Optimizer):
        return opt
    raise TypeError(f"engine.optimizer is a {kind}, not an optimizer DeepSpeed builds")


def gradient_dtypes(engine) -> tuple[torch.dtype, torch.dtype]:
    """(accumulation, reduction): the dtype DeepSpeed's wrapper sums gradients over micro-batches
    in, and the one it reduces them over data-parallel ranks in, as the wrapper was built."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return opt.gradient_accumulation_dtype, opt.communication_data_type
    if isinstance(opt, BF16_Optimizer):  # the engine reduces its fp32 buffers (buffered_allreduce_fallback)
        return opt.grad_acc_dtype, engine.communication_data_type
    # the model's own .grad tensors (ZeRO-0), reduced by the engine
    dtype = next(p.dtype for p in engine.module.parameters())
    return dtype, engine.communication_data_type


@contextlib.contextmanager
def checkpoint_engine_replaced(engine, replacement):
    """Inside the block, engine.save_checkpoint (and the pipeline engine's layer files) writes through
    `replacement(DeepSpeed's checkpoint engine)`: DeepSpeed calls the engine's `save(state_dict,
    path)` for every file it writes (deepspeed/runtime/checkpoint_engine/, engine.py's
    _save_checkpoint and _save_zero_checkpoint, pipe/module.py's save_state_dict). Yields the
    replacement; DeepSpeed's own is back afterwards, for loads and later saves."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = replacement(original)
    try:
        yield engine.checkpoint_engine
    finally:
        engine.checkpoint_engine = original


def client_optimizer(engine) -> torch.optim.Optimizer:
    """Our torch optimizer, as DeepSpeed holds it (it keeps the optimizer state of the tensors
    DeepSpeed steps: fp32 partitions or copies under a wrapper, the parameters at ZeRO-0 fp32)."""
    return engine.basic_optimizer


def set_position(engine, step: int, samples: int) -> None:
    """The engine's own step and sample counters (its checkpoints and the pipeline engine use
    them), after a layout-free load."""
    engine.global_steps, engine.global_samples = step, samples


def report_grad_norm(engine, norm) -> None:
    """What engine.get_global_grad_norm() reports after our own clipping replaced DeepSpeed's: the
    engine copies a wrapper's `_global_grad_norm` into its own after the wrapper's step, so both
    are set (a client optimizer stepped directly, at ZeRO-0 fp32, has none)."""
    engine._global_grad_norm = norm
    if engine.optimizer is not engine.basic_optimizer:
        engine.optimizer._global_grad_norm = norm


def replace_fp32_clipping(engine, clip) -> None:
    """ZeRO-0 fp32: the engine calls `clip()` where it would clip with its own routine."""
    engine.clip_fp32_gradients = clip


def disable_wrapper_clipping(engine) -> None:
    """FP16_UnfusedOptimizer: only divide out the loss scale, never clip (by its inexact norm)."""
    engine.optimizer.clip_grad = 0.0


def multi_tensor_bf16_step(engine) -> bool:
    """bf16 at ZeRO-0: DeepSpeed's FP16_UnfusedOptimizer steps tensor by tensor: a non-finite check
    with one host sync per gradient, a norm of fp32 copies of every gradient, a cast, a division by a
    loss scale of 1 and a copy back per parameter (about ten kernels and a sync for each of BERT-large's
    ~400 tensors: what made bf16 ZeRO-0 21-40% slower than ZeRO-1 on an H100). Its step is replaced by
    the same work in multi-tensor kernels and one host sync: the non-finite check over every gradient
    (agreed over the world, as DeepSpeed's over the model-parallel group), the fp32 gradients (zeros
    where a parameter has none, as DeepSpeed's), the client optimizer's step, the copy back to bf16.
    DeepSpeed's own gradient norm is skipped: the trainer's ExactClipping reports the norm and clips
    (the wrapper's clipping must be off already). Returns whether the step was replaced (only for
    bf16 without loss scaling; fp16 keeps DeepSpeed's)."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from . import device

    wrapper = engine.optimizer
    scaling = getattr(wrapper, "loss_scale_config", None)
    if not (isinstance(wrapper, FP16_UnfusedOptimizer) and wrapper.low_precision_dtype == torch.bfloat16
            and not scaling.use_grad_scaling and scaling.cur_scale == 1.0 and not wrapper.fused_lamb_legacy):
        return False
    if wrapper.clip_grad != 0:
        raise RuntimeError("multi_tensor_bf16_step: the wrapper still clips by its own norm; switch its clipping "
                           "off first (disable_wrapper_clipping)")
    pairs = [(low, high) for lows, highs in zip(wrapper.fp16_groups, wrapper.fp32_groups)
             for low, high in zip(lows, highs)]
    flag_device = pairs[0][0].device if pairs else torch.device("cpu")

    def multi_tensor_step(closure=None):
        stepped = [(low, high) for low, high in pairs if low.grad is not None]
        grads = [low.grad for low, _ in stepped]
        nonfinite = torch.zeros((), dtype=torch.float32, device=flag_device)
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).float()
            nonfinite = torch.logical_not(torch.isfinite(norms).all()).float()
        if device.all_reduce(nonfinite, op="max").item():  # the step's one host sync
            return wrapper._skip_invalid_grad_norm()
        wrapper.overflow = False
        wrapper._update_scale(False)  # its iteration count; the scale stays 1
        fp32_grads = [torch.empty_like(high) for _, high in stepped]
        torch._foreach_copy_(fp32_grads, grads)
        for (_, high), grad in zip(stepped, fp32_grads):
            high.grad = grad
        for low, high in pairs:
            if low.grad is None:
                high.grad = torch.zeros_like(high)
        wrapper.optimizer.step()
        for _, high in pairs:
            high.grad = None
        torch._foreach_copy_([low.data for low, _ in pairs], [high.data for _, high in pairs])
        return wrapper.overflow

    wrapper.step = multi_tensor_step
    return True


def let_loss_scaler_reach_minimum(engine) -> None:
    """fp16 under ZeRO: DeepSpeed's DynamicLossScaler raises a bare Exception at the first overflow
    at its minimum scale (raise_error_at_min_scale); let it stay there instead, so that the trainer's
    resilience.max_consecutive_skips decides, as it does at ZeRO-0 (whose scaler never raises)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and hasattr(scaler, "raise_error_at_min_scale"):
        scaler.raise_error_at_min_scale = False


def skip_backward_allreduce(engine) -> None:
    """One data-parallel replica: the engine has nothing to average, so it need not flatten and
    reduce every gradient."""
    engine.enable_backward_allreduce = False


def loss_scale(engine) -> float | None:
    """The fp16 dynamic loss scale (None if the wrapper has none). Every DeepSpeed fp16 wrapper
    (FP16_Optimizer, FP16_UnfusedOptimizer, the ZeRO optimizers) exposes the `loss_scale`
    property; only some have `cur_scale` (FP16_UnfusedOptimizer keeps it in loss_scale_config).
    Wrappers without loss scaling report 1.0."""
    scale = getattr(engine.optimizer, "loss_scale", None)
    return None if scale is None else float(scale)


def overflow_skips(engine) -> int:
    """Optimizer steps DeepSpeed's wrapper skipped itself since the engine was built, before our
    optimizer was called: fp16 loss-scale overflows, and non-finite gradients or gradient norms
    under ZeRO-1/2/3 and the bf16 wrappers. Its `_take_model_step` counts them (the wrapper's
    `overflow` flag) and leaves the LR scheduler alone."""
    return int(engine.skipped_steps)


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


# ----------------------------------------------------------------------------- waiting calls
class WaitingCall(NamedTuple):
    """A call in which a rank waits for the others: the method `name` of `owner`, or the function
    under key `name` of the dict `owner`; timed as `phase`, synchronised around or not."""

    owner: object
    name: object
    phase: str
    synced: bool = True


def waiting_calls(engine) -> list[WaitingCall]:
    """The DeepSpeed calls in which a rank waits for the others, at every ZeRO stage and with
    pipeline parallelism (DeepSpeed 0.19's names, read from the engine as it was built, so that
    each ZeRO stage's calls are found where that stage makes them):

    - grad_reduce: the engine's `allreduce_gradients` (ZeRO-0/1 and the bf16 wrapper reduce there,
      at the last micro-batch's backward; ZeRO-2/3 end their reduction there) and
      `buffered_allreduce_fallback` (what it calls at ZeRO-0, the pipeline engine's bf16 path);
      ZeRO-1/2's bucket reductions `reduce_ipg_grads` (at ZeRO-2, and ZeRO-1 with overlap_comm,
      called from the gradient hooks inside backward); ZeRO-3's `__reduce_and_partition_ipg_grads`
      (its hooks) and `independent_gradient_partition_epilogue` (which waits for its reduction
      stream); the pipeline engine's ReduceTiedGrads instruction (the tied embedding's all-reduce
      between the first and the last stage). The hooks' bucket reductions are not synchronised
      where overlap_comm (ZeRO-3's default) overlaps them with backward on their own stream;
    - param_gather: ZeRO-3's parameter coordinator's `fetch_sub_module` (the all-gather each
      module's parameters wait for, forward and backward), not synchronised (its prefetch overlap);
    - pipe_comm: the pipeline engine's send and receive instructions (activations, gradients) and
      `_aggregate_total_loss` (the loss broadcast from the last stage at the end of the batch). The
      engine runs its instructions from the class's `_INSTRUCTION_MAP`: the engine is given its
      own copy, whose entries can be wrapped.
    """
    calls = [WaitingCall(engine, method, "grad_reduce") for method in ("allreduce_gradients",
                                                                        "buffered_allreduce_fallback")]
    optimizer = engine.optimizer
    overlapped = bool(getattr(optimizer, "overlap_comm", False))
    for method, synced in (("reduce_ipg_grads", not overlapped),
                           ("_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", not overlapped),
                           ("independent_gradient_partition_epilogue", True)):
        if callable(getattr(optimizer, method, None)):
            calls.append(WaitingCall(optimizer, method, "grad_reduce", synced))
    offload = getattr(optimizer, "parameter_offload", None)  # ZeRO-3
    if offload is not None:
        calls.append(WaitingCall(offload.get_param_coordinator(), "fetch_sub_module", "param_gather", False))
    instructions = getattr(type(engine), "_INSTRUCTION_MAP", None)  # the pipeline engine
    if instructions is not None:
        from deepspeed.runtime.pipe import schedule

        if "_INSTRUCTION_MAP" not in vars(engine):
            engine._INSTRUCTION_MAP = dict(instructions)
        table = engine._INSTRUCTION_MAP
        calls += [WaitingCall(table, instruction, "pipe_comm") for instruction in (
            schedule.SendActivation, schedule.RecvActivation, schedule.SendGrad, schedule.RecvGrad)]
        calls += [WaitingCall(table, schedule.ReduceTiedGrads, "grad_reduce"),
                  WaitingCall(engine, "_aggregate_total_loss", "pipe_comm")]
    return calls
