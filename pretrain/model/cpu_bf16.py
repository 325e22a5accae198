"""How bf16 matrix products run on this CPU: natively, or as exact fp32 GEMMs on upcast operands.

A CPU flag does not decide it. Without AVX512-BF16/AMX oneDNN emulates bf16 (4-5x slower than
fp32), but some CPUs that report avx512_bf16 still run a bf16 GEMM at half their fp32 rate
(seen: 165 vs 330 GFLOP/s at 2048^3 on 2 threads), and others at twice it. So both routes are
timed once on a GEMM of transformer size, and the faster one is kept in a small cache file per
machine (CPU model, flags, thread count, torch version). Both routes give the same numbers: bf16
products are exact in fp32, and both accumulate in fp32 and round the result to bf16.

BERT_BF16_GEMM=native|fp32 overrides the measurement.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time

import torch

ROUTES = ("native", "fp32")
OVERRIDE_ENV = "BERT_BF16_GEMM"
# [tokens x hidden] @ [hidden x ffn] of BERT-base at micro batch 2 x seq 256: big enough to
# show the steady-state rate, small enough to time both routes in well under a second.
CALIBRATION_SHAPE = (512, 768, 3072)


def _gemm(route: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b if route == "native" else (a.float() @ b.float()).to(torch.bfloat16)


def measure_routes(shape=CALIBRATION_SHAPE, seconds_per_route: float = 0.15) -> dict[str, float]:
    """GFLOP/s of each route on bf16 operands of `shape` (m, k, n), best of repeated runs."""
    m, k, n = shape
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(k, n, generator=generator).to(torch.bfloat16)
    rates = {}
    for route in ROUTES:
        _gemm(route, a, b)  # warm-up: oneDNN picks and caches its kernel
        best, deadline = float("inf"), time.perf_counter() + seconds_per_route
        for _ in range(50):
            started = time.perf_counter()
            _gemm(route, a, b)
            best = min(best, time.perf_counter() - started)
            if started > deadline:
                break
        rates[route] = 2.0 * m * k * n / best / 1e9
    return rates


def choose_route(rates: dict[str, float]) -> str:
    """The faster route; native on a tie (it saves the upcast copies' memory)."""
    return "native" if rates["native"] >= rates["fp32"] else "fp32"


def machine_key() -> str:
    """What the measurement depends on: CPU model and flags, threads, torch version."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    cpu += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    text = f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bert-pretrain")


def calibrated_route(cache_dir: str | None = None, measure=measure_routes) -> tuple[str, dict]:
    """(route, record) for this machine, measured once and then read from the cache."""
    path = os.path.join(cache_dir or default_cache_dir(), f"bf16-gemm-{machine_key()}.json")
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("route") in ROUTES:
            return record["route"], record
    except (OSError, ValueError):
        pass  # absent or unreadable: measure again
    rates = measure()
    record = {"route": choose_route(rates), "gflops": rates, "threads": torch.get_num_threads()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measure again next time
    return record["route"], record


@functools.lru_cache(maxsize=None)
def bf16_route() -> str:
    """The route every bf16 CPU GEMM of this process takes (decided once per process)."""
    forced = os.environ.get(OVERRIDE_ENV)
    if forced:
        if forced not in ROUTES:
            raise ValueError(f"{OVERRIDE_ENV}={forced!r}: expected one of {', '.join(ROUTES)}")
        return forced
    return calibrated_route()[0]


def upcast_bf16(tensor: torch.Tensor) -> bool:
    """Whether a bf16 product on this tensor's device should run as an fp32 GEMM."""
    return tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and bf16_route() == "fp32"
