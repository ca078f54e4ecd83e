"""The fused LSTM and GRU cells an accelerator's ``nn.LSTM`` / ``nn.GRU`` dispatch, computed on the host.

On an accelerator (CUDA, PrivateUse1) ATen's recurrent layers call ``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``
and, in the backward, their ``*_backward`` kernels: kernels only a device library provides (CUDA's ``RNN.cu``; torch_npu
registers its own recurrent operators), with no CPU kernel for a host-backed device to run. These are the same
pointwise formulas as CUDA's kernels, on host tensors: the gates activated (sigmoid; tanh for the candidate), the
new cell and hidden state, and the ``workspace`` the backward reads (LSTM: the four activated gates; GRU: the reset,
input and new gates, the previous hidden state and the hidden candidate). The CPU's own recurrent path sums the
same terms in another order, so results agree with it within rounding, not bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
              input_bias: torch.Tensor | None = None,
              hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gates = input_gates + hidden_gates
    if input_bias is not None and hidden_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat((i, f, g, o), 1)


def lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor, cy: torch.Tensor,
                       workspace: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_hy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy) + (0 if grad_cy is None else grad_cy)
    grad_gates = torch.cat((grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                            grad_hy * tanh_cy * o * (1 - o)), 1)
    return grad_gates, grad_c * f, grad_gates.sum(0)


def gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
             input_bias: torch.Tensor | None = None,
             hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if input_bias is not None and hidden_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, ii, inew = input_gates.chunk(3, 1)
    hr, hi, hnew = hidden_gates.chunk(3, 1)
    reset, update = (ir + hr).sigmoid(), (ii + hi).sigmoid()
    new = (inew + reset * hnew).tanh()
    hy = new + update * (hx - new)
    return hy, torch.cat((reset, update, new, hx, hnew), 1)


def gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor,
                      has_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    reset, update, new, hx, hnew = workspace.chunk(5, 1)
    grad_new = grad_hy * (1 - update) * (1 - new * new)
    grad_update = grad_hy * (hx - new) * update * (1 - update)
    grad_reset = grad_new * hnew * reset * (1 - reset)
    grad_input = torch.cat((grad_reset, grad_update, grad_new), 1)
    grad_hidden = torch.cat((grad_reset, grad_update, grad_new * reset), 1)
    return grad_input, grad_hidden, grad_hy * update, grad_input.sum(0), grad_hidden.sum(0)


# operator name (its overload packet) -> the host computation the stand-in's dispatch runs in its place
HOST_KERNELS: dict[str, Callable[..., Any]] = {
    "_thnn_fused_lstm_cell": lstm_cell,
    "_thnn_fused_lstm_cell_backward_impl": lstm_cell_backward,
    "_thnn_fused_gru_cell": gru_cell,
    "_thnn_fused_gru_cell_backward": gru_cell_backward,
}
