"""Every path of pretrain/model/attention.py against a plain dense reference (an explicit [seq, seq]
mask, softmax, matmul): forward and the gradients of q, k and v in fp32 within 1e-5, on packed rows
with several documents and padding (what the model attends: it computes real tokens only), windows smaller than the
documents and larger than the row, and global layers. Then the window's bound itself (a key at
distance half_window exactly is attended, one further is not), transformers' own masks, dropout,
bf16, every path on the CPU test device (fakegpu), and the CUDA FlexAttention path against the
same reference (GPU tier).

Run as a script (`python tests/test_attention_kernels.py cuda|fakegpu`) it is those tests' child:
it runs every path on that device, compares with the reference on the CPU and prints the largest
differences as JSON.
"""
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from pretrain.model import attention  # noqa: E402
from pretrain.model.attention import encoder_attention, run_path  # noqa: E402

SEQ = 30
HEADS, DIM = 2, 16  # 16: the smallest head size FlexAttention's kernels take on CUDA
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def padded_rows():
    """Unequal lengths: a full row, two right-padded ones (the last with 4 real tokens, so that its far
    padding reaches no real key within a small window), a left-padded one."""
    lengths = [(0, SEQ), (0, 17), (0, 4), (6, SEQ)]
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for row, (start, stop) in enumerate(lengths):
        mask[row, start:stop] = 1
    return mask


def packed_rows():
    """Several documents per row and trailing padding (as data/samples/packing.py makes them), a row
    of one document, and a row whose document 1 comes back after document 2 (not contiguous)."""
    rows = [[1] * 8 + [2] * 12 + [3] * 6 + [0] * 4,
            [4] * 3 + [5] * 20 + [6] * 7,
            [7] * SEQ,
            [1] * 5 + [2] * 5 + [1] * 5 + [0] * 15]
    return torch.tensor(rows)


def full_bucket_rows():
    """Documents of exactly a bucket's length (12 and 8: attention._ladder's sizes), as full rows
    are, beside ones that leave spare slots (6, and the 4 tokens of padding)."""
    return torch.tensor([[1] * 12 + [2] * 12 + [3] * 6,
                         [4] * 12 + [5] * 8 + [6] * 6 + [0] * 4])


MASKS = {"packed": ("sample_ids", packed_rows), "full-buckets": ("sample_ids", full_bucket_rows)}


def allowed_reference(masks: dict, half_window, seq: int) -> torch.Tensor:
    """[batch, seq, seq]: who attends whom, written out (module docstring of attention.py)."""
    index = torch.arange(seq)
    near = torch.ones(seq, seq, dtype=torch.bool)
    if half_window is not None:
        near = (index[:, None] - index[None, :]).abs() <= half_window
    ids = masks["sample_ids"]
    return (ids[:, :, None] == ids[:, None, :]) & near


def reference(query, key, value, masks, half_window, scale=None):
    allowed = allowed_reference(masks, half_window, query.shape[2])[:, None]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ value


def inputs(batch, seq=SEQ, seed=0, dtype=torch.float32):
    """q, k, v [batch, heads, seq, head_dim] as the model hands them over: transposed views of
    [batch, seq, heads, head_dim] tensors (not contiguous)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, HEADS, DIM, generator=generator).to(dtype).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def forward_backward(fn, q, k, v):
    """The output and the gradients of q, k, v for a fixed random upstream gradient."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    (out * upstream).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def assert_matches_reference(fn, kind, half_window, seq=SEQ, **tolerance):
    name, rows = MASKS[kind]
    masks = {name: rows()}
    q, k, v = inputs(masks[name].shape[0], seq)
    ours = forward_backward(lambda *t: fn(*t, masks), q, k, v)
    theirs = forward_backward(lambda *t: reference(*t, masks, half_window), q, k, v)
    for label, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs):
        assert torch.isfinite(a).all(), f"{label} not finite"
        torch.testing.assert_close(a, b, **(tolerance or TOLERANCE), msg=lambda m: f"{label}: {m}")


# windows: none, 0 (itself), smaller than documents, about a document, larger than the row
WINDOWS = [None, 0, 1, 4, 9, 40]
CASES = [(kind, hw) for kind in MASKS for hw in WINDOWS]


def paths_for(kind, half_window):
    """(path, block) pairs that apply to the case; small blocks so that rows span several bands."""
    paths = [("dense", None)]
    if half_window is None:
        paths.append(("documents", None))
    else:
        paths += [("banded", None), ("banded", 8), ("banded", 4)]
    return paths


@pytest.mark.parametrize("kind,half_window,path,block", [
    (kind, hw, path, block) for kind, hw in CASES for path, block in paths_for(kind, hw)])
def test_path_matches_dense_reference(kind, half_window, path, block):
    def fn(q, k, v, masks):
        return run_path(path, q, k, v, **masks, half_window=half_window, block=block)

    assert_matches_reference(fn, kind, half_window)


def test_full_buckets_attend_without_a_mask():
    """The documents path's buckets whose documents fill every slot take no mask (SDPA's fastest
    kernels); the others keep theirs; the result is the reference's (test_path_matches_dense_reference)."""
    plan = attention._document_plan(full_bucket_rows())
    assert {size: full for _, size, _, full in plan["buckets"]} == {8: False, 12: True}
    q, k, v = inputs(2)
    run_path("documents", q, k, v, full_bucket_rows(), cache=None)
    attention._documents(q, k, v, plan, 0.0, DIM ** -0.5)
    biases = plan["biases"][torch.float32]
    assert biases[12] is None and biases[8] is not None


@pytest.mark.parametrize("kind,half_window", CASES)
def test_encoder_attention_matches_dense_reference(kind, half_window):
    def fn(q, k, v, masks):
        return encoder_attention(q, k, v, **masks, half_window=half_window)

    assert_matches_reference(fn, kind, half_window)


@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("half_window", [None, 64])
@pytest.mark.parametrize("extra", [0, 17])
def test_longer_rows_take_the_chosen_path(kind, half_window, extra):
    """Rows long enough for several default-size bands (BAND_BLOCK), a whole number of them or not,
    and for several document buckets."""
    seq = 3 * attention.BAND_BLOCK + extra
    ids = torch.zeros(2, seq, dtype=torch.long)
    ids[0, :150], ids[0, 150:160], ids[0, 160:370] = 1, 2, 3
    ids[1, :seq - 3] = 4
    rows = {"sample_ids": ids}
    q, k, v = inputs(2, seq)
    ours = forward_backward(lambda *t: encoder_attention(*t, **rows, half_window=half_window), q, k, v)
    theirs = forward_backward(lambda *t: reference(*t, rows, half_window), q, k, v)
    for label, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("path,block", [("dense", None), ("banded", None), ("banded", 4), (None, None)])
@pytest.mark.parametrize("kind", list(MASKS))
def test_window_bound_is_inclusive(path, block, kind):
    """Query i sees a change of the value at i + half_window and at i - half_window, and none at
    i +- (half_window + 1): the bound of masking_utils' sliding_window_bidirectional_overlay."""
    half_window, seq, i = 5, 40, 20
    masks = {"sample_ids": torch.ones(1, seq, dtype=torch.long)}
    q, k, v = (t.detach() for t in inputs(1, seq))

    def run(value):
        if path is None:
            return encoder_attention(q, k, value, **masks, half_window=half_window)
        return run_path(path, q, k, value, **masks, half_window=half_window, block=block)

    base = run(v)
    for j, seen in ((i + half_window, True), (i - half_window, True), (i + half_window + 1, False),
                    (i - half_window - 1, False)):
        changed = v.clone()
        changed[:, :, j] += 1.0
        moved = (run(changed)[:, :, i] - base[:, :, i]).abs().max().item()
        assert (moved > 1e-3) == seen, f"key at distance {j - i} {'not ' if seen else ''}attended (moved {moved})"


@pytest.mark.parametrize("half_window", [None, 3])
def test_transformers_eager_masks(half_window):
    """transformers' own masks for padded rows (create_bidirectional_mask /
    create_bidirectional_sliding_window_mask, eager) and eager_attention_forward give our output, at
    every real query, of the same rows as the model attends them: each row one sample (its real
    tokens; unpadding.py), its padding a number of its own."""
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask
    from transformers.models.modernbert.modeling_modernbert import eager_attention_forward

    config = ModernBertConfig(hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_hidden_layers=2,
                              local_attention=2 * (half_window or 1))
    config._attn_implementation = "eager"
    padding_mask = padded_rows()
    embeds = torch.zeros(padding_mask.shape[0], SEQ, HEADS * DIM)
    build = create_bidirectional_mask if half_window is None else create_bidirectional_sliding_window_mask
    hf_mask = build(config=config, inputs_embeds=embeds, attention_mask=padding_mask)
    q, k, v = (t.detach() for t in inputs(padding_mask.shape[0]))
    theirs = eager_attention_forward(torch.nn.Module().eval(), q, k, v, hf_mask, scaling=DIM ** -0.5)[0]
    rows = torch.arange(1, padding_mask.shape[0] + 1)[:, None]
    sample_ids = torch.where(padding_mask != 0, rows, rows + padding_mask.shape[0])
    ours = encoder_attention(q, k, v, sample_ids, half_window=half_window).transpose(1, 2)
    real = padding_mask != 0
    torch.testing.assert_close(ours[real], theirs[real], **TOLERANCE)


@pytest.mark.parametrize("path,half_window", [("dense", 4), ("banded", 4), ("dense", None),
                                              ("documents", None), (None, 4), (None, None)])
def test_dropout_draws_from_the_default_generator(path, half_window):
    """Attention dropout on CPU: the same seed gives the same output (the RNG tracker's forks replay
    it on recomputation), another seed another one, and gradients flow."""
    name, rows = MASKS["packed"]
    masks = {name: rows()}
    q, k, v = inputs(masks[name].shape[0])

    def run(seed):
        torch.manual_seed(seed)
        if path is None:
            return encoder_attention(q, k, v, **masks, half_window=half_window, dropout_p=0.3)
        return run_path(path, q, k, v, **masks, half_window=half_window, dropout_p=0.3)

    first, again, other = run(0), run(0), run(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    plain = encoder_attention(q, k, v, **masks, half_window=half_window)
    assert not torch.allclose(first, plain)
    first.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dense_dropout_is_reference_with_the_drawn_mask():
    """The dense path's dropout is inverted dropout of the probabilities with layers.dropout's draw."""
    masks = {"sample_ids": packed_rows()}
    q, k, v = (t.detach() for t in inputs(4))
    torch.manual_seed(3)
    ours = run_path("dense", q, k, v, **masks, half_window=4, dropout_p=0.25)
    torch.manual_seed(3)
    keep = torch.rand(4, HEADS, SEQ, SEQ).ge_(0.25).mul_(1 / 0.75)
    allowed = allowed_reference(masks, 4, SEQ)[:, None]
    probs = torch.softmax((q @ k.transpose(-1, -2) * DIM ** -0.5).masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(ours, (probs * keep) @ v, **TOLERANCE)


@pytest.mark.parametrize("half_window", [None, 4])
@pytest.mark.parametrize("kind", list(MASKS))
def test_bf16_returns_bf16_close_to_fp32(kind, half_window):
    name, rows = MASKS[kind]
    masks = {name: rows()}
    q, k, v = (t.detach() for t in inputs(masks[name].shape[0], dtype=torch.bfloat16))
    out = encoder_attention(q, k, v, **masks, half_window=half_window)
    assert out.dtype == torch.bfloat16
    expected = reference(q.float(), k.float(), v.float(), masks, half_window)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_choose_path_avoids_a_dense_mask_at_long_rows():
    """At 8,192 tokens no choice builds the [seq x seq] mask."""
    for half_window in (None, 64):
        assert attention.choose_path(8192, half_window) != "dense"


def stand_in_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn as its docstring states it, written out on the CPU:
    [T, heads, dim] operands, sequence i the tokens [cu[i], cu[i + 1]), query t of a sequence
    attending its keys within [t - left, t + right] (-1: unbounded)."""
    out = torch.zeros_like(query)
    left, right = window_size
    for start, stop in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        assert stop - start <= max_q
        q, k, v = (t[start:stop].transpose(0, 1) for t in (query, key, value))
        index = torch.arange(stop - start)
        offset = index[None, :] - index[:, None]  # key - query
        allowed = ((offset >= -left) | (left < 0)) & ((offset <= right) | (right < 0))
        scores = (q @ k.transpose(-1, -2)) * scale
        out[start:stop] = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v).transpose(0, 1)
    return out


@pytest.mark.parametrize("half_window", [None, 0, 4, 40])
def test_varlen_path_calls_the_kernel_with_each_document(monkeypatch, half_window):
    """Our side of the CUDA varlen path on the CPU: cu_seqlens from the sample ids (a row's trailing
    padding its own sequence), [T, heads, dim] operands, the window as (w, w), the output put back,
    with a stand-in for the kernel that follows varlen_attn's documented contract (the kernel itself
    runs in the GPU tier)."""
    from pretrain.model.micro_batch import MicroBatchCache

    monkeypatch.setattr(attention, "_varlen_attn", lambda: stand_in_varlen_attn)
    ids = packed_rows()[:3]  # documents as contiguous runs (the model's always are; row 3 has one in two runs)
    bounds, longest = attention.document_bounds(ids)
    assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == ids.numel()
    assert longest == SEQ  # row 2 is one document of the whole row
    q, k, v = inputs(*ids.shape)
    cache = MicroBatchCache()

    def ours(*t):
        return attention._varlen(*(x.transpose(1, 2) for x in t), ids, half_window, DIM ** -0.5, cache).transpose(1, 2)

    got = forward_backward(ours, q, k, v)
    want = forward_backward(lambda *t: reference(*t, {"sample_ids": ids}, half_window), q, k, v)
    for label, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m: f"{label}: {m}")
    assert cache.builds == 1


@pytest.mark.parametrize("kind", ["packed", "full-buckets"])
def test_flex_attention_mask_rule_on_the_cpu(monkeypatch, kind):
    """Our side of the CUDA FlexAttention path on the CPU, forward: the mask_mod (same document,
    within the window) and its BlockMask, built once per micro-batch and window, run by torch's
    uncompiled flex_attention (which materialises the scores) against the reference. The compiled
    kernel runs in the GPU tier: flex_attention has no CPU backward, and inductor's CPU template
    does not build with dynamic shapes (torch 2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from pretrain.model.micro_batch import MicroBatchCache

    monkeypatch.setattr(attention, "_compiled_flex", lambda: (flex_attention, create_block_mask))
    ids = MASKS[kind][1]()
    cache = MicroBatchCache()
    real = (ids != 0)[:, None, :, None]  # padding (id 0) attends padding: not compared
    for half_window in WINDOWS:
        q, k, v = (t.detach() for t in inputs(ids.shape[0]))
        ours = attention._flex_attention(q, k, v, ids, half_window, DIM ** -0.5, cache)
        want = reference(q, k, v, {"sample_ids": ids}, half_window)
        torch.testing.assert_close(ours.masked_fill(~real, 0), want.masked_fill(~real, 0), **TOLERANCE,
                                   msg=lambda m: f"half_window {half_window}: {m}")
    assert cache.builds == len(WINDOWS)


def run_device_check(device_type: str, env: dict) -> dict:
    """This file as a child process checking `device_type` (it must not enable either device here)."""
    from distributed import run_python

    done = run_python([os.path.abspath(__file__), device_type], env, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"].startswith(device_type), result["device"]
    assert result["dropout_finite"]
    return result


def assert_close_everywhere(result: dict, tolerance: float):
    assert len(result["cases"]) >= 32, sorted(result["cases"])
    for case, differences in result["cases"].items():
        for label, difference in differences.items():
            assert difference <= tolerance, f"{case} {label}: {difference}"


@pytest.mark.slow  # a child process on the test device (its extension built by tools/install.sh)
def test_every_path_on_the_cpu_test_device():
    """On fakegpu (the CPU test mode that fails like CUDA on a tensor made on an implicit device)
    every path, and encoder_attention's choice, matches the CPU reference, dropout included."""
    pytest.importorskip("fakegpu")
    from distributed import child_env

    assert_close_everywhere(run_device_check("fakegpu", child_env({"BERT_FAKE_GPU": "1"})), 1e-5)


@pytest.mark.gpu(1)
def test_cuda_flex_attention_matches_reference():
    """FlexAttention (compiled, block mask) on CUDA against the CPU reference, forward and gradients,
    and every CPU path run by CUDA's SDPA (the route of attention dropout there); the model's kernels
    (packed_attention: FlexAttention fp32, varlen flash attention bf16 where torch has it) with one
    mask build per micro-batch; dropout runs to finite values. In a child with the session's GPUs
    (this process hides them)."""
    from distributed import child_env, gpu_env

    result = run_device_check("cuda", child_env(gpu_env(BERT_FAKE_GPU="0")))
    assert_close_everywhere(result, 1e-4)  # fp32 with TF32 off; the kernels' summation orders differ
    assert any(case.endswith("encoder_attention") for case in result["cases"])
    # the model's kernels: flex in fp32 (1e-4), varlen in bf16 (its rounding, relative to the values)
    kernels = result["kernel_cases"]
    assert len(kernels) == (12 if result["varlen_available"] else 6), sorted(kernels)
    for case, differences in kernels.items():
        limit = 2e-2 if case.endswith("varlen") else 1e-4
        assert all(d <= limit for d in differences.values()), (case, differences)
    assert result["auto_fp32"] == "flex"
    assert result["auto_bf16"] == ("varlen" if result["varlen_available"] else "flex")


def _device_check(device_type: str) -> dict:
    """The child: each case on `device_type` against the reference on the CPU, largest differences."""
    if device_type == "fakegpu":
        import fakegpu

        fakegpu.enable()
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch._dynamo.config.recompile_limit = 64  # one compilation per shape and mask kind here
    device = torch.device(device_type, 0)
    long_ids = torch.zeros(2, 300, dtype=torch.long)
    long_ids[0, :130], long_ids[0, 130:140], long_ids[0, 140:290] = 1, 2, 3
    long_ids[1, :250] = 4
    rows = {"packed": {"sample_ids": packed_rows()}, "packed300": {"sample_ids": long_ids}}
    cases = {}
    for kind, masks in rows.items():
        batch, seq = next(iter(masks.values())).shape
        on_device = {name: m.to(device) for name, m in masks.items()}
        for half_window in (None, 0, 4, 64):
            q, k, v = inputs(batch, seq)
            theirs = forward_backward(lambda *t: reference(*t, masks, half_window), q, k, v)
            runs = {"encoder_attention": lambda *t: encoder_attention(*t, **on_device, half_window=half_window)}
            for path, block in paths_for(kind.rstrip("0123456789"), half_window):
                runs[f"{path}/{block}"] = (lambda path, block: lambda *t: run_path(
                    path, *t, **on_device, half_window=half_window, block=block))(path, block)
            for name, fn in runs.items():
                ours = forward_backward(fn, *(t.detach().to(device) for t in (q, k, v)))
                assert ours[0].device == device
                cases[f"{kind} half_window={half_window} {name}"] = {
                    label: (a.cpu() - b).abs().max().item()
                    for label, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs)}
    kernels = _cuda_kernel_cases(device, rows) if device_type == "cuda" else {}
    finite = True
    for half_window in (None, 4):
        q, k, v = (t.detach().to(device).requires_grad_() for t in inputs(4))
        out = encoder_attention(q, k, v, sample_ids=packed_rows().to(device), half_window=half_window, dropout_p=0.2)
        out.sum().backward()
        finite = finite and all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))
    return {"device": str(out.device), "cases": cases, "dropout_finite": finite, **kernels}


def _cuda_kernel_cases(device, rows) -> dict:
    """The model's CUDA kernels (packed_attention, token-major, masks from a MicroBatchCache):
    FlexAttention in fp32 and, where torch has it, varlen flash attention in bf16, each against the
    fp32 reference; differences relative to the reference's largest value."""
    from pretrain.model.attention import cuda_kernel, packed_attention, varlen_available
    from pretrain.model.micro_batch import MicroBatchCache

    runs = [("flex", torch.float32)] + ([("varlen", torch.bfloat16)] if varlen_available() else [])
    out = {}
    for kind in ("packed", "packed300"):
        ids = rows[kind]["sample_ids"]
        for half_window in (None, 4, 64):
            q, k, v = inputs(*ids.shape)
            theirs = forward_backward(lambda *t: reference(*t, {"sample_ids": ids}, half_window), q, k, v)
            for kernel, dtype in runs:
                cache = MicroBatchCache()

                def fn(*t):  # head-major in and out, as the reference; token-major inside
                    return packed_attention(*(x.transpose(1, 2) for x in t), ids.to(device), half_window=half_window,
                                            cache=cache, kernel=kernel).transpose(1, 2)

                ours = forward_backward(fn, *(t.detach().to(device, dtype) for t in (q, k, v)))
                assert ours[0].dtype == dtype and cache.builds == 1  # the one mask / boundary set
                out[f"{kind} half_window={half_window} {kernel}"] = {
                    label: ((a.float().cpu() - b).abs().max() / b.abs().max()).item()
                    for label, a, b in zip(("output", "dq", "dk", "dv"), ours, theirs)}
    return {"kernel_cases": out, "varlen_available": varlen_available(),
            "auto_bf16": cuda_kernel("auto", torch.bfloat16), "auto_fp32": cuda_kernel("auto", torch.float32)}


if __name__ == "__main__" and sys.argv[1:2] in (["cuda"], ["fakegpu"]):
    print(json.dumps(_device_check(sys.argv[1])))
