"""The fused LSTM cell torch uses on every non-CPU device, for fakegpu.

aten's LSTM takes `_thnn_fused_lstm_cell` (and its backward `_thnn_fused_lstm_cell_backward_impl`)
for any input that is not on the CPU; those have CUDA kernels only, so nn.LSTM on fakegpu would
fail where on CUDA it runs (through cuDNN or these kernels). Here they are written with ordinary
ops on the fakegpu tensors (which run the CPU kernels): the gates' activations are the workspace
the backward reads, as in CUDA's kernel. Equal to the CPU's LSTM up to rounding (~1e-7).
"""
from __future__ import annotations

import torch


def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    return o * cy.tanh(), cy, torch.cat([i, f, g, o], 1)


def fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad of the gates' pre-activations, grad of cx, grad of the bias or None)."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_hy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = torch.cat([grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                            grad_hy * tanh_cy * o * (1 - o)], 1)
    return grad_gates, grad_c * f, grad_gates.sum(0) if has_bias else None


def register() -> torch.library.Library:
    """Register both for PrivateUse1; the returned library must stay alive."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_thnn_fused_lstm_cell", fused_lstm_cell, "PrivateUse1")
    library.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward_impl, "PrivateUse1")
    return library
