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


# ------------------------------------------------------------------------------------------ dropout

def test_dropout_keeps_one_minus_p_and_preserves_expectation():
    from pretrain.model.layers import dropout

    x = torch.ones(400, 1000)
    torch.manual_seed(0)
    out = dropout(x, 0.1, True)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.003
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.9))
    torch.manual_seed(0)
    assert torch.equal(dropout(x, 0.1, True), out), "the mask is a function of the generator state"
    assert dropout(x, 0.1, False) is x and dropout(x, 0.0, True) is x
    half = dropout(x.bfloat16(), 0.5, True)
    assert half.dtype == torch.bfloat16 and set(half.unique().tolist()) <= {0.0, 2.0}


def test_attention_with_dropout_is_softmax_attention_with_the_drawn_mask():
    from pretrain.model.layers import attention_bias
    from pretrain.model.layers import self_attention as attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(3))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 11:] = 0  # padding of the second sequence
    attend = padding.bool()[:, None, None, :]
    bias = attention_bias(padding, torch.float32)
    assert bias.dtype == torch.float32 and bias.shape == (2, 1, 1, 16)
    assert torch.allclose(attention(q, k, v, bias, 0.0),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=attend), atol=1e-6)
    torch.manual_seed(7)
    out = attention(q, k, v, bias, 0.2)
    torch.manual_seed(7)
    keep = (torch.rand(2, 3, 16, 16) >= 0.2).double() / 0.8
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8 ** 0.5
    probs = torch.softmax(scores.masked_fill(~attend, float("-inf")), dim=-1)
    assert torch.allclose(out.double(), (probs * keep) @ v.double(), atol=1e-5)


def test_bf16_attention_matches_fp32_attention_on_the_same_operands():
    from pretrain.model.layers import attention_bias, self_attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g).bfloat16() for _ in range(3))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, 9:] = 0
    attend = padding.bool()[:, None, None, :]
    out = self_attention(q, k, v, attention_bias(padding, torch.bfloat16), 0.0)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=attend)
    assert out.dtype == torch.bfloat16
    assert _max_rel(out, exact) <= BF16_ULP
