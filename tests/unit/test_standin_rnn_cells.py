"""The stand-in's host versions of the fused recurrent cells: the forward as torch's recurrent cells compute it, the
backward as autograd differentiates that forward."""
from __future__ import annotations

import pytest
import torch

from hal.backends.standins.rnn_cells import HOST_KERNELS, gru_cell, gru_cell_backward, lstm_cell, lstm_cell_backward

B, H = 3, 5


def _inputs(chunks: int, bias: bool) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return [make(B, chunks * H), make(B, chunks * H), make(B, H),
            make(chunks * H) if bias else None, make(chunks * H) if bias else None]


@pytest.mark.parametrize("bias", [True, False])
def test_the_lstm_cell_is_torchs_lstm_cell_and_its_backward_autograds(bias: bool) -> None:
    xg, hg, cx, ib, hb = _inputs(4, bias)
    hy, cy, workspace = lstm_cell(xg, hg, cx, ib, hb)
    # torch's own cell on the same gates: the input is both gate inputs side by side, each through an identity
    eye = torch.eye(4 * H, dtype=torch.float64)
    want_h, want_c = torch.lstm_cell(torch.cat((xg, hg), 1), (torch.zeros(B, H, dtype=torch.float64), cx),
                                     torch.cat((eye, eye), 1), torch.zeros(4 * H, H, dtype=torch.float64), ib, hb)
    torch.testing.assert_close(hy, want_h)
    torch.testing.assert_close(cy, want_c)

    leaves = [t.clone().requires_grad_() for t in (xg, hg, cx)]
    out_h, out_c, _ = lstm_cell(*leaves, ib, hb)
    grad_h, grad_c = torch.randn_like(out_h), torch.randn_like(out_c)
    want = torch.autograd.grad((out_h * grad_h).sum() + (out_c * grad_c).sum(), leaves)
    grad_gates, grad_cx, grad_bias = lstm_cell_backward(grad_h, grad_c, cx, cy, workspace, bias)
    torch.testing.assert_close(grad_gates, want[0])
    torch.testing.assert_close(grad_gates, want[1])  # the gates are a sum: one gradient for both
    torch.testing.assert_close(grad_cx, want[2])
    torch.testing.assert_close(grad_bias, want[0].sum(0))
    none_h, _, _ = lstm_cell_backward(None, grad_c, cx, cy, workspace, bias)  # an undefined gradient is zero
    torch.testing.assert_close(none_h, lstm_cell_backward(torch.zeros_like(grad_h), grad_c, cx, cy, workspace, bias)[0])


@pytest.mark.parametrize("bias", [True, False])
def test_the_gru_cell_is_torchs_gru_cell_and_its_backward_autograds(bias: bool) -> None:
    xg, _, hx, ib, hb = _inputs(3, bias)
    w_hh = torch.randn(3 * H, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    hg = hx @ w_hh.t()  # the hidden gates torch's cell computes from hx
    hy, workspace = gru_cell(xg, hg, hx, ib, hb)
    torch.testing.assert_close(hy, torch.gru_cell(xg, hx, torch.eye(3 * H, dtype=torch.float64), w_hh, ib, hb))

    leaves = [t.clone().requires_grad_() for t in (xg, hg, hx)]
    out, _ = gru_cell(*leaves, ib, hb)
    grad = torch.randn_like(out)
    want = torch.autograd.grad((out * grad).sum(), leaves)
    grad_x, grad_h, grad_hx, grad_ib, grad_hb = gru_cell_backward(grad, workspace, bias)
    for got, expected in zip((grad_x, grad_h, grad_hx), want):
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad_ib, want[0].sum(0))
    torch.testing.assert_close(grad_hb, want[1].sum(0))


def test_every_kernel_names_an_aten_operator() -> None:
    for name in HOST_KERNELS:
        assert hasattr(torch.ops.aten, name), name
