"""fakegpu: a CPU test mode that sees device defects.

The test suite's own package (distribution bert-fakegpu, in the repository's tests/bert-fakegpu/),
never part of the product: tools/install.sh installs it beside the product (pip install -e
tests/bert-fakegpu), and pretrain/distributed/device.py loads it when BERT_FAKE_GPU=1.

`enable()` adds a second device type, ``fakegpu`` (torch's PrivateUse1 renamed), whose memory is
ordinary host memory but which torch treats as a separate, non-CPU device, and a c10d backend
``fakeccl`` bound ONLY to that device (gloo underneath). On a CPU-only machine this makes the
device bugs that CUDA/NCCL would catch visible:

- a collective on a CPU tensor fails as with NCCL: the process group has no backend for cpu, so
  torch raises "No backend type associated with device type cpu";
- a tensor made without ``device=`` is on cpu, not on the model's fakegpu:N;
- an op mixing a fakegpu tensor with a non-scalar CPU tensor, or fakegpu:0 with fakegpu:1, fails
  like CUDA ("Expected all tensors to be on the same device, but found at least two devices,
  fakegpu:0 and cpu!"); 0-dim CPU tensors are allowed, as CUDA allows them; copy-like ops
  (copy_, .to(), _to_copy, set_, indexing / index_put_ with CPU indices) cross devices as on CUDA;
- a CPU ``torch.Generator`` passed to a random op on fakegpu tensors fails like CUDA ("Expected a
  'fakegpu' device type for generator but found 'cpu'").

Everything else runs the CPU kernels at CPU speed: one boxed fallback (csrc/fakegpu.cpp) hands the
CPU kernel zero-copy CPU aliases of the fakegpu tensors and maps the results back (views alias the
original storage; in-place/out= ops return the original tensor). Autograd runs through the engine's
fakegpu device thread; the RNG of every fakegpu device is the CPU default generator (so a fakegpu
run draws the same random numbers as the same run on CPU, and torch.manual_seed seeds it).

Public API
    DEVICE_TYPE = "fakegpu", BACKEND = "fakeccl"
    enable()        idempotent: build/load the extension, rename PrivateUse1, register
                    torch.fakegpu, the fakeccl backend and DeepSpeed's accelerator.
    is_enabled()
    device_count(), current_device(), set_device(i)
    FakeGPUAccelerator   the DeepSpeed accelerator enable() installs (fakegpu/fakeccl speaking
                    subclass of DeepSpeed's CPU_Accelerator)

Environment
    FAKEGPU_DEVICE_COUNT  number of fakegpu devices (default 8, read once when the extension loads)
    FAKEGPU_BUILD_DIR     build directory of the JIT-compiled extension (default: under
                          TORCH_EXTENSIONS_DIR when set, else the environment's
                          <sys.prefix>/torch_extensions)
    FAKEGPU_EXTENSION     an extension already built from this same source for this same torch
                          (the fakegpu_ext .so): loaded instead of building one (about 20 s of
                          C++); the GPU kit's CI rehearsal hands it the suite's own build
    FAKEGPU_NO_DEEPSPEED=1  enable() leaves DeepSpeed's accelerator alone

Behaviour worth knowing
- module.to("fakegpu") keeps the Parameter objects (CPU <-> fakegpu counts as a compatible shallow
  copy, as CPU <-> CUDA does), so an optimizer built before the move still holds the module's
  parameters, and `cpu_param.data = fakegpu_tensor` works as it does with CUDA.
- scaled_dot_product_attention takes SDPA's math path on fakegpu (as on any out-of-tree device):
  equal to CPU's fused flash kernel up to rounding (~1e-7), not bit for bit. Everything else
  tested (linear, layer_norm, gelu, dropout, embedding, AdamW, DeepSpeed ZeRO 0-3 fp32/bf16) is
  bit-identical to the same computation on CPU.
- torch.save/torch.load of fakegpu tensors round-trips (loads back onto fakegpu).
- DeepSpeed's accelerator stays a "synchronized device" (no side streams), like the CPU one.
- memory statistics as CUDA's allocator reports them: torch.fakegpu.memory_allocated and
  max_memory_allocated count the bytes of every live storage of the device (its own allocations
  and the CPU kernels' results it takes over), reset_peak_memory_stats resets the peak; without
  CUDA's 512-byte block rounding and with no cache (memory_reserved = memory_allocated).

Not supported (fails with an error, never silently wrong)
- sparse / non-strided layouts on fakegpu: nn.Embedding(sparse=True) backward raises
  NotImplementedError ("Could not run 'aten::_sparse_coo_tensor_with_dims_and_tensors' with
  arguments from the 'Sparsefakegpu' backend"); dense embedding gradients work.
- ops that have no CPU kernel (CUDA-only fused kernels such as fused Adam, flash attention), except
  the fused LSTM cell every non-CPU LSTM takes, written with ordinary ops in _lstm.py (nn.LSTM
  equals the CPU's up to rounding, ~1e-7).
- dist._coalescing_manager (gloo has no startCoalescing either; all_reduce_coalesced works).
- autocast on fakegpu: inside torch.autocast("fakegpu", ...) ops raise "Could not run 'aten::...'
  with arguments from the 'Autocastfakegpu' backend" (no autocast kernels are registered); use
  explicit dtypes.
- streams: one default stream per device, events record host time, everything is synchronous.
- torch.compile on fakegpu: untested.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from pathlib import Path

import torch

DEVICE_TYPE = "fakegpu"
BACKEND = "fakeccl"

_lock = threading.Lock()
_ext = None
_lstm_kernels = None  # the fused LSTM cell kernels registered by enable() (kept alive here)
_SRC = Path(__file__).resolve().parent / "csrc" / "fakegpu.cpp"


def _load_extension():
    from torch.utils.cpp_extension import load

    built = os.environ.get("FAKEGPU_EXTENSION")
    if built:
        import importlib.util

        spec = importlib.util.spec_from_file_location("fakegpu_ext", built)
        if spec is None or not os.path.isfile(built):
            raise RuntimeError(f"FAKEGPU_EXTENSION={built} is not a built fakegpu_ext library")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    kwargs = {}
    build_dir = os.environ.get("FAKEGPU_BUILD_DIR")
    if not build_dir and "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        # this environment's own, as the product's extensions: torch's shared ~/.cache would be
        # rebuilt by every checkout over the other's build (the build hash covers the source path)
        build_dir = os.path.join(sys.prefix, "torch_extensions", "fakegpu_ext")
    if build_dir:
        os.makedirs(build_dir, exist_ok=True)
        kwargs["build_directory"] = build_dir
    return load(name="fakegpu_ext", sources=[str(_SRC)], extra_cflags=["-O2"], verbose=False, **kwargs)


def is_enabled() -> bool:
    return _ext is not None


def enable():
    """Make the fakegpu device and the fakeccl backend available (idempotent); returns the extension."""
    global _ext
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        backend_name = torch._C._get_privateuse1_backend_name()
        if backend_name not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(f"PrivateUse1 is already renamed to {backend_name!r}; fakegpu cannot use it")
        import torch.distributed as _dist  # noqa: F401  (the extension subclasses torch's c10d Backend)

        ext = _load_extension()
        if backend_name != DEVICE_TYPE:
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        from . import _device

        _device._bind(ext)
        if not hasattr(torch, DEVICE_TYPE):
            torch._register_device_module(DEVICE_TYPE, _device)
        if not hasattr(torch.Tensor, "is_" + DEVICE_TYPE):
            torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        _register_backend()
        global _lstm_kernels
        from ._lstm import register

        _lstm_kernels = register()
        atexit.register(_let_autograd_threads_settle)
        _ext = ext
        if os.environ.get("FAKEGPU_NO_DEEPSPEED", "0") in ("", "0"):
            _install_deepspeed_accelerator()
        return ext


def _let_autograd_threads_settle() -> None:
    # backward() returns as soon as the graph task completes, while the autograd engine's fakegpu
    # device thread may still be dropping its last reference to the task, whose saved thread-local
    # state holds Python objects. If the interpreter is already finalizing by then, that thread's
    # GIL acquisition exits the thread from inside a noexcept destructor: "terminate called without
    # an active exception", exit code 134. Letting those threads run briefly before finalization
    # avoids it.
    time.sleep(0.05)


def device_count() -> int:
    return enable().device_count()


def current_device() -> int:
    return enable().current_device()


def set_device(index: int) -> None:
    enable().set_device(int(index))


def _allow_cpu_tensors_in_backend(allow: bool) -> None:
    """Test hook only: let fakeccl accept CPU tensors handed to it directly (to show a test fails)."""
    enable()._set_allow_cpu_in_backend(bool(allow))


# --------------------------------------------------------------------------- fakeccl
def _create_fakeccl(store, rank, size, timeout):
    # through distributed_c10d: the class there is the one the program chose (the product makes
    # its gloo groups share one transport device: pretrain/distributed/internals.py)
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo(store, rank, size, timeout=timeout)
    return _ext_module().FakeCCLBackend(gloo, rank, size)


def _ext_module():
    from . import _device

    return _device._ext


def _register_backend() -> None:
    import torch.distributed as dist

    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create_fakeccl, extended_api=False, devices=[DEVICE_TYPE])


# --------------------------------------------------------------------------- DeepSpeed
class _TensorType:
    """get_accelerator().FloatTensor & co.: legacy constructors that build on the current fakegpu."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __call__(self, *args):
        device = torch.device(DEVICE_TYPE, current_device())
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            return torch.tensor(args[0], dtype=self.dtype, device=device)
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0].to(device=device, dtype=self.dtype)
        return torch.empty(*args, dtype=self.dtype, device=device)


def _accelerator_class():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class FakeGPUAccelerator(CPU_Accelerator):
        """DeepSpeed's CPU accelerator speaking fakegpu/fakeccl: device names, the current device,
        on_accelerator() and the legacy tensor constructors all point at fakegpu:N; host timers,
        synchronous execution (no side streams), RSS-based memory stats and the CPU op builders
        are the CPU accelerator's."""

        def __init__(self):
            super().__init__()
            self._name = DEVICE_TYPE
            self._communication_backend_name = BACKEND

        def device_name(self, device_index=None):
            return DEVICE_TYPE if device_index is None else f"{DEVICE_TYPE}:{int(device_index)}"

        def device(self, device_index=None):
            return torch.fakegpu.device(device_index)

        def set_device(self, device_index):
            if isinstance(device_index, torch.device):
                device_index = device_index.index
            if isinstance(device_index, str):
                device_index = torch.device(device_index).index if ":" in device_index else int(device_index)
            set_device(int(device_index))

        def current_device(self):
            return current_device()

        def current_device_name(self):
            return f"{DEVICE_TYPE}:{current_device()}"

        def device_count(self):
            return device_count()

        def default_generator(self, device_index):
            return torch.fakegpu.default_generator(device_index)

        def is_available(self):
            return True

        def communication_backend_name(self):
            return BACKEND

        def on_accelerator(self, tensor):
            return tensor.device.type == DEVICE_TYPE

        # A GPU computes fp16; the CPU kernels behind fakegpu do too (slowly), so DeepSpeed's fp16
        # wrappers and loss scaling run here (the CPU accelerator has fp16 only with MKL-DNN's).
        def is_fp16_supported(self):
            return True

        def supported_dtypes(self):
            return [torch.float32, torch.bfloat16, torch.float16]

        BFloat16Tensor = property(lambda self: _TensorType(torch.bfloat16))
        ByteTensor = property(lambda self: _TensorType(torch.uint8))
        DoubleTensor = property(lambda self: _TensorType(torch.float64))
        FloatTensor = property(lambda self: _TensorType(torch.float32))
        HalfTensor = property(lambda self: _TensorType(torch.float16))
        IntTensor = property(lambda self: _TensorType(torch.int32))
        LongTensor = property(lambda self: _TensorType(torch.int64))

    return FakeGPUAccelerator


def __getattr__(name):
    if name == "FakeGPUAccelerator":
        return _accelerator_class()
    raise AttributeError(name)


_ACCELERATOR_CLASS = None


def _install_deepspeed_accelerator() -> None:
    global _ACCELERATOR_CLASS
    try:
        from deepspeed.accelerator import real_accelerator
    except ImportError:
        return
    current = real_accelerator.ds_accelerator
    if current is not None and getattr(current, "_name", None) == DEVICE_TYPE:
        return
    if _ACCELERATOR_CLASS is None:
        _ACCELERATOR_CLASS = _accelerator_class()
    real_accelerator.set_accelerator(_ACCELERATOR_CLASS())
