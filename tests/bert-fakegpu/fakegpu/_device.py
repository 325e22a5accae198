"""The `torch.fakegpu` device module (what `torch.cuda` is to cuda), registered by enable().

torch looks several of these functions up by name for a PrivateUse1 device: autocast
(get_amp_supported_dtype), torch.utils.checkpoint (device, get_rng_state, set_rng_state),
torch.manual_seed (manual_seed_all), torch.random.fork_rng, DataLoader pinning.

RNG: every fakegpu device's default generator draws from the CPU default generator (see
FakeGenerator in csrc/fakegpu.cpp), so the RNG state of a fakegpu device IS the CPU RNG state and
a fakegpu run draws the same random numbers as the same run on CPU.
"""
from __future__ import annotations

import torch

_ext = None  # the compiled extension, set by enable()
default_generators: tuple[torch.Generator, ...] = ()  # per device; all draw from the CPU default generator


def _bind(ext) -> None:
    global _ext, default_generators
    _ext = ext
    default_generators = tuple(ext.default_generator(i) for i in range(ext.device_count()))


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    return None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _ext.device_count()


def current_device() -> int:
    return _ext.current_device()


def _index(device) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "fakegpu":
            raise ValueError(f"expected a fakegpu device, got {device}")
        return device.index
    raise TypeError(f"not a device: {device!r}")


def set_device(device) -> None:
    idx = _index(device)
    if idx is not None:
        _ext.set_device(idx)


class device:
    """Context manager that makes `device` current (like torch.cuda.device)."""

    def __init__(self, device):
        self.idx = _index(device)
        self.prev = None

    def __enter__(self):
        self.prev = current_device()
        if self.idx is not None and self.idx >= 0:
            _ext.set_device(self.idx)
        return self

    def __exit__(self, *exc):
        _ext.set_device(self.prev)
        return False


def synchronize(device=None) -> None:
    return None


def empty_cache() -> None:
    return None


# --------------------------------------------------------------------------- RNG (= the CPU RNG)
def get_rng_state(device="fakegpu") -> torch.Tensor:
    return torch.default_generator.get_state()


def set_rng_state(new_state: torch.Tensor, device="fakegpu") -> None:
    torch.default_generator.set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state() for _ in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for state in new_states:
        set_rng_state(state)


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def seed_all() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


def default_generator(idx: int | None = None) -> torch.Generator:
    return _ext.default_generator(-1 if idx is None else idx)


# --------------------------------------------------------------------------- dtypes, streams
def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def current_stream(device=None) -> torch.Stream:
    idx = _index(device)
    return torch.accelerator.current_stream(current_device() if idx is None else idx)


def default_stream(device=None) -> torch.Stream:
    return current_stream(device)


def Stream(device=None, priority: int = 0, **kwargs) -> torch.Stream:  # noqa: N802 (torch API name)
    idx = _index(device)
    return torch.Stream(device=torch.device("fakegpu", current_device() if idx is None else idx), priority=priority)


def Event(enable_timing: bool = False, **kwargs) -> torch.Event:  # noqa: N802
    return torch.Event(device="fakegpu", enable_timing=enable_timing)


class stream:
    """Single default stream per device: selecting a stream changes nothing."""

    def __init__(self, stream=None):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


def _ordinal(device) -> int:
    idx = _index(device)
    return current_device() if idx is None else idx


def memory_allocated(device=None) -> int:
    """Bytes of the device's live storages (as torch.cuda.memory_allocated, without its 512-byte rounding)."""
    return _ext.memory_allocated(_ordinal(device))


def max_memory_allocated(device=None) -> int:
    return _ext.max_memory_allocated(_ordinal(device))


def reset_peak_memory_stats(device=None) -> None:
    _ext.reset_peak_memory_stats(_ordinal(device))


def memory_reserved(device=None) -> int:
    return memory_allocated(device)  # no caching: what is allocated is what is held
