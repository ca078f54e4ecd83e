"""The operator registry: reference semantics, dispatch by backend/dtype/priority, visible fallbacks."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from hal import ops
from hal.downgrades import DowngradeWarning, clear_downgrades, fallback_policy, recorded_downgrades
from hal.errors import FallbackRefused

from ..conftest import run_hal

REQUIRED_OPS = {"linear", "matmul", "rms_norm", "layer_norm", "softmax", "gelu", "silu", "swiglu",
                "rotary_embedding", "scaled_dot_product_attention", "cross_entropy", "embedding"}


@pytest.fixture(autouse=True)
def _clean():
    clear_downgrades()
    yield
    clear_downgrades()
    ops.registry.clear_caches()


def test_registry_has_the_required_ops() -> None:
    assert REQUIRED_OPS <= set(ops.registry.names())


def test_rms_norm_reference_matches_formula() -> None:
    x, w = torch.randn(3, 5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 16 + 1e-5) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), expected)


def test_swiglu_reference_matches_formula() -> None:
    x = torch.randn(4, 10, dtype=torch.float64)
    a, b = x[:, :5], x[:, 5:]
    torch.testing.assert_close(ops.swiglu(x), a / (1 + torch.exp(-a)) * b)


def test_rotary_reference_equals_complex_rotation() -> None:
    """Independent derivation: rotating pairs (x_i, x_{i+d/2}) by angle θ_i is a complex product."""
    seq, dim = 6, 8
    x = torch.randn(2, seq, dim, dtype=torch.float64)
    theta = torch.outer(torch.arange(seq, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    z = torch.complex(x[..., : dim // 2], x[..., dim // 2 :]) * torch.polar(torch.ones_like(theta), theta)
    torch.testing.assert_close(ops.rotary_embedding(x, cos, sin), torch.cat([z.real, z.imag], -1))


def test_sdpa_reference_handles_grouped_query_attention() -> None:
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    out = ops.scaled_dot_product_attention(q, k, v, is_causal=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ vv)


def test_embedding_dispatches_on_the_weight() -> None:
    weight = torch.randn(10, 4, dtype=torch.bfloat16)
    out = ops.embedding(torch.tensor([[1, 3]]), weight)
    assert out.dtype is torch.bfloat16 and torch.equal(out[0, 1], weight[3])


def test_higher_priority_impl_wins_for_its_dtype_only() -> None:
    calls = []

    @ops.registry.register("softmax", "test_fast_softmax", backends=["cpu"], dtypes=[torch.float32], priority=50)
    def fast(x, dim=-1):
        calls.append(x.dtype)
        return torch.softmax(x, dim)

    try:
        ops.softmax(torch.randn(3, 3))
        ops.softmax(torch.randn(3, 3, dtype=torch.float64))
        assert calls == [torch.float32]
        assert ops.registry.choose("softmax", "cpu", torch.float32).impl.name == "test_fast_softmax"
        assert ops.registry.choose("softmax", "cuda", torch.float32).impl.name == "reference"
    finally:
        ops.registry.unregister("softmax", "test_fast_softmax")
    ops.softmax(torch.randn(3, 3))
    assert calls == [torch.float32], "unregistering must invalidate the dispatch cache"


def _register_unrunnable():
    @ops.registry.register("gelu", "test_vendor_gelu", backends=["cpu"], priority=30,
                           requires=lambda: "test_vendor_runtime is not installed")
    def vendor_gelu(x, approximate="none"):
        raise AssertionError("must never run: its requirement is missing")


def test_fallback_is_recorded_and_warned_under_warn() -> None:
    _register_unrunnable()
    try:
        with fallback_policy("warn"), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.testing.assert_close(ops.gelu(torch.ones(2)), torch.nn.functional.gelu(torch.ones(2)))
        assert [(d.kind, d.requested, d.used) for d in recorded_downgrades()] == [("op", "test_vendor_gelu", "reference")]
        assert "test_vendor_runtime is not installed" in recorded_downgrades()[0].reason
        assert any(issubclass(w.category, DowngradeWarning) for w in seen)
    finally:
        ops.registry.unregister("gelu", "test_vendor_gelu")


def test_fallback_refused_under_error() -> None:
    _register_unrunnable()
    try:
        with fallback_policy("error"), pytest.raises(FallbackRefused, match="test_vendor_gelu -> reference"):
            ops.gelu(torch.ones(2))
    finally:
        ops.registry.unregister("gelu", "test_vendor_gelu")


def test_hal_ops_json_covers_every_op_and_dtype() -> None:
    result = run_hal("ops", "--backend", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == "cpu"
    assert REQUIRED_OPS <= set(report["ops"])
    for row in report["ops"].values():
        assert set(row) == {"float32", "bfloat16", "float16", "float64"}
        assert all(cell["impl"] for cell in row.values())


def test_hal_ops_shows_vendor_fallbacks_for_an_absent_runtime() -> None:
    result = run_hal("ops", "--backend", "ascend")
    assert result.returncode == 0, result.stderr
    assert "npu_rms_norm not used: torch_npu is not installed" in result.stdout
