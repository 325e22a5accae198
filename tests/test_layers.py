"""The bf16 GEMM route for CPUs without native bf16: same arithmetic as a bf16 GEMM.

A bf16 GEMM multiplies bf16 operands (exact in fp32), accumulates in fp32 and rounds the
result to bf16. `_Fp32GemmLinear` must agree with a float64 reference on the same bf16
operands to within bf16 rounding of the output, forward and backward, and must not be
farther from it than torch's own bf16 F.linear is.
"""
import torch
import torch.nn.functional as F

from pretrain.model.layers import _Fp32GemmLinear, linear

BF16_ULP = 2.0 ** -8  # relative spacing of bf16 numbers


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 17, 96, generator=g).bfloat16().requires_grad_()
    w = torch.randn(40, 96, generator=g).bfloat16().requires_grad_()
    b = torch.randn(40, generator=g).bfloat16().requires_grad_()
    upstream = torch.randn(3, 17, 40, generator=g).bfloat16()
    return x, w, b, upstream


def _max_rel(a, ref):
    return ((a.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()


def test_fp32_gemm_linear_matches_exact_reference_within_bf16_rounding():
    x, w, b, upstream = _operands()
    out = _Fp32GemmLinear.apply(x, w, b)
    out.backward(upstream)
    assert out.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16

    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.linear(xd, wd, bd)
    ref.backward(upstream.double())

    native_x, native_w, native_b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    native = F.linear(native_x, native_w, native_b)
    native.backward(upstream)

    for ours, theirs, exact in ((out, native, ref), (x.grad, native_x.grad, xd.grad),
                                (w.grad, native_w.grad, wd.grad), (b.grad, native_b.grad, bd.grad)):
        assert _max_rel(ours, exact) <= BF16_ULP
        assert _max_rel(ours, exact) <= _max_rel(theirs, exact) + BF16_ULP / 2


def test_fp32_gemm_linear_skips_gradients_nobody_needs():
    x, w, b, upstream = _operands(1)
    x.requires_grad_(False)
    out = _Fp32GemmLinear.apply(x, w, None)
    out.backward(upstream)
    assert x.grad is None and w.grad is not None


def test_linear_leaves_fp32_to_torch():
    x, w, b = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
