"""Cross-device levels a person can act on: a reference more exact than its dtype needs earns no credit (the dtype
floor), and every case below L2 says both errors in roundings of the dtype and the likely cause. The B sides are
real computations of what vendor kernels do — a softmax backward with bf16 intermediates, an fp32 matmul through
TF32 — against torch's CPU kernels, the kind of cases a CPU-vs-H100 compare graded "fail" while both passed."""
from __future__ import annotations

import pytest
import torch

from hal.conformance.reports import levels
from hal.conformance.verdicts.metrics import error_metrics


def _case(op: str, dtype: str, actual: torch.Tensor, golden: torch.Tensor) -> dict:
    return {"id": f"ops::{op}/reference/{dtype}/normal/backward", "metrics": error_metrics(actual, golden)}


def _softmax_backward_cases() -> tuple[dict, dict]:
    torch.manual_seed(0)
    g = torch.randn(64, 1024).to(torch.bfloat16)
    y = torch.softmax(torch.randn(64, 1024), -1).to(torch.bfloat16)
    golden = torch.ops.aten._softmax_backward_data(g.double(), y.double(), -1, torch.float64)
    cpu = torch.ops.aten._softmax_backward_data(g, y, -1, torch.bfloat16)  # float32 inside, one rounding out
    total = torch.zeros(64, 1, dtype=torch.bfloat16)
    for start in range(0, 1024, 32):  # Σ y·g accumulated in bf16, 32 products at a time, then y·(g − Σ) in bf16
        total = total + (y * g)[:, start:start + 32].float().sum(-1, keepdim=True).to(torch.bfloat16)
    kernel = y * (g - total)
    return _case("softmax", "bfloat16", cpu, golden), _case("softmax", "bfloat16", kernel, golden)


def test_a_kernel_keeping_bf16_intermediates_is_graded_and_said_to() -> None:
    a, b = _softmax_backward_cases()
    r = levels.ratios(a, b)
    level = levels.grade(r)
    assert level != "L2"
    why = levels.explain(a, b, r, level)
    assert why["dtype"] == "bfloat16" and why["roundings"]["a"] <= 1.5 and why["roundings"]["b"] > 2
    assert "keeps intermediates in bfloat16" in why["cause"], why["cause"]
    assert "mean_rel" in why["a_floor"]  # the CPU's single rounding is below the dtype floor: A counts as 2 u


def test_a_reference_more_exact_than_its_dtype_earns_no_credit(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    golden = torch.randn(4096, dtype=torch.float64)
    once = golden.to(torch.bfloat16)  # the best a bf16 result can be
    wobble = torch.empty(4096, dtype=torch.float64).uniform_(-1, 1) * 2.0 ** -9  # half a rounding of error inside
    twice = (golden * (1 + wobble)).to(torch.bfloat16)  # ... then the result's rounding: a correct bf16 kernel
    a, b = _case("gelu", "bfloat16", once, golden), _case("gelu", "bfloat16", twice, golden)
    assert levels.grade(levels.ratios(a, b)) == "L2"
    monkeypatch.setattr(levels, "DTYPE_FLOOR", {"mean_rel": 0.0, "max_rel": 0.0, "rmse": 0.0})
    assert levels.grade(levels.ratios(a, b)) != "L2"  # without the floor, one rounding's reference fails it


def test_tf32_and_another_algorithm_are_told_apart_in_float32() -> None:
    torch.manual_seed(2)
    x, w = torch.randn(256, 512), torch.randn(512, 256)
    golden = x.double() @ w.double()

    def tf32(t: torch.Tensor) -> torch.Tensor:  # a 10-bit mantissa, as TF32 tensor cores read their inputs
        bits = t.view(torch.int32) & ~((1 << 13) - 1)
        return bits.view(torch.float32)

    a = _case("matmul", "float32", x @ w, golden)
    b_tf32 = _case("matmul", "float32", tf32(x) @ tf32(w), golden)
    r = levels.ratios(a, b_tf32)
    assert levels.grade(r) == "fail" and "TF32" in levels.explain(a, b_tf32, r, "fail")["cause"]
    b_other = _case("matmul", "float32", (x @ w) * (1 + 2.0 ** -16), golden)
    r = levels.ratios(a, b_other)
    assert "another algorithm" in levels.explain(a, b_other, r, levels.grade(r))["cause"]
