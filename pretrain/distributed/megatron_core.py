"""megatron-core, imported the one way this project imports it: every module of ours that uses
megatron-core imports this module first (tests/test_structure.py holds the product to it).

On import, megatron-core wraps its fused kernels (megatron/core/jit.py: `jit_fuser = torch.compile`,
applied to GeGLU, bias-GeLU, ... in megatron/core/fusions) in torch.compile, and that wrapping alone
imports TorchDynamo and Inductor: 2 of the 5.3 s a rank took to import the trainer on this
project's 2-core CI machine, paid by every rank of every launch, whether or not a fused kernel is
ever called (ours calls none on the CPU). torch.compile compiles a function at its first call
anyway; here those wrappings are made at their first call too, so a process that never calls one
never imports Inductor, and one that does compiles it then, as before.
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch

__all__ = ["ModelParallelConfig", "parallel_state", "tensor_parallel", "indexed_dataset",
           "dataset_helpers"]


@contextlib.contextmanager
def _torch_compile_at_first_call() -> Iterator[None]:
    real = torch.compile

    def at_first_call(model=None, **options):
        if model is None:  # @torch.compile(fullgraph=True, ...)
            return lambda function: at_first_call(function, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = at_first_call
    try:
        yield
    finally:
        torch.compile = real


with _torch_compile_at_first_call(), warnings.catch_warnings():
    # megatron-core warns on import that optional GPU kernels are missing
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    # megatron.core's first import: megatron.core.jit binds torch.compile here, once
    from megatron.core import ModelParallelConfig, parallel_state, tensor_parallel  # noqa: E402
    from megatron.core.datasets import indexed_dataset  # noqa: E402


def dataset_helpers():
    """megatron-core's compiled dataset helpers (megatron.core.datasets.helpers_cpp: blending indices)."""
    from megatron.core.datasets import helpers_cpp

    return helpers_cpp
