"""The element-wise work of an encoder layer in as few passes over memory as the device allows.

Between its matrix products a ModernBERT layer runs only memory-bound operations: rotary turns of
queries and keys (in fp32, as transformers), the residual add and the LayerNorm after it, GeGLU's
GELU and product; a BERT layer its output linears' bias, dropout, residual add and LayerNorm.
Eager, each is a kernel or several, with fp32 intermediates written out and read back; compiled
(`model.compile`), each group below is one generated kernel forward and one backward (torch.compile,
dynamic shapes: the token count changes every micro-batch, one compilation serves them all).
Dropout's draw stays outside (eager, the RNG tracker's streams: BERT's kernel takes the keep mask,
ModernBERT's dropouts run eager); the functions are pure.

`LayerKernels(compiled)` hands a layer the eager or the compiled version of each; the compiled ones
are made once per process (functools.cache), so every layer shares one compilation.
"""
from __future__ import annotations

import functools
import os
import shutil

import torch
import torch.nn.functional as F

from ..common.errors import UserError
from ..config.choices import compile_enabled


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] turned by the angles (cos and sin broadcast to it), in fp32, returned in
    x's dtype (transformers' apply_rotary_pos_emb: non-interleaved halves)."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def rotate_query_key(query, key, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return rotate(query, cos, sin), rotate(key, cos, sin)


def geglu(projected: torch.Tensor) -> torch.Tensor:
    """GELU(first half) x second half of the last dimension (GegluInput's [inputs; gates] layout)."""
    inputs, gates = projected.chunk(2, dim=-1)
    return F.gelu(inputs) * gates


def add_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, LayerNorm of it): the residual stream and the next block's input."""
    hidden = residual + delta
    return hidden, F.layer_norm(hidden, hidden.shape[-1:], weight, bias, eps)


def bias_dropout_add_norm(x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor | None, scale: float,
                          residual: torch.Tensor, weight: torch.Tensor, norm_bias: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """LayerNorm(residual + dropout(x + bias)), BERT's post-LN residual after an output linear that
    handed its bias back unadded; dropout as `keep` (dropout.keep_mask; None: no dropout) times
    `scale` (1 / (1 - p))."""
    delta = x + bias
    if keep is not None:
        delta = delta * keep * scale
    return F.layer_norm(residual + delta, residual.shape[-1:], weight, norm_bias, eps)


EAGER = {"rotate_query_key": rotate_query_key, "geglu": geglu, "add_norm": add_norm,
         "bias_dropout_add_norm": bias_dropout_add_norm}


@functools.cache
def compiled(name: str):
    """The compiled version of EAGER[name], made once per process (torch.compile is lazy: the first
    call compiles)."""
    return torch.compile(EAGER[name], dynamic=True)


class LayerKernels:
    """The layer's element-wise groups, compiled or eager."""

    def __init__(self, use_compiled: bool):
        self.compiled = use_compiled
        pick = compiled if use_compiled else EAGER.__getitem__
        self.rotate_query_key = pick("rotate_query_key")
        self.geglu = pick("geglu")
        self.add_norm = pick("add_norm")
        self.bias_dropout_add_norm = pick("bias_dropout_add_norm")


class CompileUnavailable(UserError, RuntimeError):
    """model.compile asks for compiled kernels where torch cannot compile them."""


@functools.cache
def check_can_compile(device_type: str, key: str = "model.compile") -> None:
    """Refuse, in one line naming the config key that asked (`key`), a compilation that would fail
    deep inside torch: inductor builds CPU kernels with a C++ compiler, and compiles for CUDA and the
    CPU only."""
    if device_type == "cpu":
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            raise CompileUnavailable(f"{key}=true on the CPU needs a C++ compiler ({compiler}, or $CXX) for "
                                     f"torch's inductor, and none is on PATH: install one or set {key}=false")
    elif device_type != "cuda":
        raise CompileUnavailable(f"{key}=true: torch compiles for CUDA and the CPU, not for {device_type}; "
                                 f"set {key}=false (or auto)")


@functools.cache
def layer_kernels(setting: str, device_type: str) -> LayerKernels:
    """The kernels model.compile = `setting` gives a layer on `device_type` (one set per process)."""
    use_compiled = compile_enabled(setting, device_type)
    if use_compiled:
        check_can_compile(device_type)
    return LayerKernels(use_compiled)


def compile_counters() -> dict:
    """torch's own compile counters so far in this process: graphs compiled (`unique_graphs`) and
    frames compiled (`frames`: a recompilation is a frame compiled again)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "frames": int(counters["frames"].get("total", 0))}
