"""fp8-mixed stages: the decoder layers' linears run fp8 forward matmuls (torch._scaled_mm, on the CPU here too)."""
from __future__ import annotations

import pytest
import torch

from hal.downgrades import clear_downgrades, fallback_policy, recorded_downgrades
from hal.parallel.models.linear import fp8_matmuls, layer_linear

if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
    pytest.skip("this torch has no fp8 matmul", allow_module_level=True)


def _leaves(rows: int = 64, inner: int = 128, out: int = 96) -> tuple[torch.Tensor, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, inner, generator=g, requires_grad=True), torch.nn.Parameter(torch.randn(out, inner, generator=g) / inner ** 0.5)


def test_fp8_forward_is_close_to_bf16_and_the_backward_is_bf16s() -> None:
    x, w = _leaves()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer_linear(x, w)
        with fp8_matmuls(torch.float8_e4m3fn):
            got = layer_linear(x, w)
    assert got.dtype == want.dtype == torch.bfloat16
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert 0 < rel < 0.08  # e4m3 keeps 3 mantissa bits: a few per cent, never exact
    cotangent = torch.randn(got.shape).to(torch.bfloat16)
    gx, gw = torch.autograd.grad(got, (x, w), cotangent)
    wx, ww = torch.autograd.grad(want, (x, w), cotangent)
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32  # the master weight's dtype
    torch.testing.assert_close(gx, wx, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, ww, rtol=2e-2, atol=2e-2)


def test_a_shape_scaled_mm_cannot_take_runs_in_bf16_and_says_so() -> None:
    x, w = _leaves(inner=40)  # 40 is not a multiple of 16
    clear_downgrades()
    with fallback_policy("allow"), fp8_matmuls(torch.float8_e4m3fn):
        layer_linear(x, w)
    seen = recorded_downgrades()
    assert any("fp8 linear" in d.subject and d.used == "bf16 matmul" for d in seen), seen
    clear_downgrades()


def test_outside_fp8_matmuls_the_linear_is_the_plain_one() -> None:
    x, w = _leaves()
    torch.testing.assert_close(layer_linear(x, w), x @ w.t())
