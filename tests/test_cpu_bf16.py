"""The bf16 GEMM route is chosen by measured speed, cached per machine, and both routes compute
the same numbers."""
import json

import pytest
import torch

from pretrain.model import cpu_bf16
from pretrain.model.layers import linear


@pytest.mark.parametrize("rates,route", [
    ({"native": 165.0, "fp32": 330.0}, "fp32"),    # reports avx512_bf16, runs bf16 at half the fp32 rate
    ({"native": 850.0, "fp32": 180.0}, "native"),  # AMX-class bf16
    ({"native": 40.0, "fp32": 170.0}, "fp32"),     # no native bf16: oneDNN emulates it
])
def test_the_faster_route_is_kept_and_cached(tmp_path, rates, route):
    calls = []

    def measure():
        calls.append(1)
        return rates

    chosen, record = cpu_bf16.calibrated_route(str(tmp_path), measure=measure)
    assert chosen == route and record["gflops"] == rates
    again, _ = cpu_bf16.calibrated_route(str(tmp_path), measure=measure)
    assert again == route and len(calls) == 1, "the second start-up must read the cache, not measure"
    (cache,) = tmp_path.iterdir()
    assert json.loads(cache.read_text())["route"] == route and cpu_bf16.machine_key() in cache.name


def test_a_corrupt_cache_is_measured_again(tmp_path):
    (tmp_path / f"bf16-gemm-{cpu_bf16.machine_key()}.json").write_text("{not json")
    assert cpu_bf16.calibrated_route(str(tmp_path), measure=lambda: {"native": 1.0, "fp32": 2.0})[0] == "fp32"


def test_measurement_reports_both_routes():
    rates = cpu_bf16.measure_routes(shape=(64, 64, 64), seconds_per_route=0.01)
    assert set(rates) == {"native", "fp32"} and all(r > 0 for r in rates.values())


@pytest.mark.parametrize("route", ["native", "fp32"])
def test_both_routes_compute_a_bf16_gemm(monkeypatch, route):
    """Forward and backward of `linear` agree between the routes (bf16 products are exact in
    fp32; only the accumulation order differs), and the override picks the route."""
    monkeypatch.setenv(cpu_bf16.OVERRIDE_ENV, route)
    cpu_bf16.bf16_route.cache_clear()
    try:
        assert cpu_bf16.bf16_route() == route
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 32, generator=g).bfloat16().requires_grad_()
        w = torch.randn(16, 32, generator=g).bfloat16().requires_grad_()
        b = torch.randn(16, generator=g).bfloat16().requires_grad_()
        out = linear(x, w, b)
        out.float().square().sum().backward()
        reference = torch.nn.functional.linear(x.detach().float(), w.detach().float(), b.detach().float())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
        assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    finally:
        cpu_bf16.bf16_route.cache_clear()


def test_a_bad_override_is_named(monkeypatch):
    monkeypatch.setenv(cpu_bf16.OVERRIDE_ENV, "fast")
    cpu_bf16.bf16_route.cache_clear()
    try:
        with pytest.raises(ValueError, match="BERT_BF16_GEMM='fast': expected one of native, fp32"):
            cpu_bf16.bf16_route()
    finally:
        cpu_bf16.bf16_route.cache_clear()
