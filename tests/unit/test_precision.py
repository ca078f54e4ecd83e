"""Precision policy: each mode resolves against device capabilities; downgrades obey the fallback policy."""
from __future__ import annotations

import warnings

import pytest
import torch

from hal import get_backend
from hal.capabilities import DTYPE_KEYS, DeviceCapabilities, DtypeSupport
from hal.downgrades import DowngradeWarning, clear_downgrades, recorded_downgrades
from hal.errors import FallbackRefused, UnsupportedError
from hal.precision import resolve_precision

N, E, A = DtypeSupport.NATIVE, DtypeSupport.EMULATED, DtypeSupport.ABSENT


def caps(name: str = "test device", **support: DtypeSupport) -> DeviceCapabilities:
    dtypes = {k: N for k in DTYPE_KEYS} | support
    return DeviceCapabilities("cpu", name, None, "x", name, None, None, None, {k: None for k in DTYPE_KEYS}, dtypes, {})


CPU = get_backend("cpu")
CUDA = get_backend("cuda")  # identity only: resolve_precision reads its reduced-precision format
ASCEND = get_backend("ascend")


@pytest.fixture(autouse=True)
def _fresh_log():
    clear_downgrades()
    yield
    clear_downgrades()


def test_fp32_is_plain() -> None:
    plan = resolve_precision("fp32", CPU, caps(), "error")
    assert (plan.mode, plan.autocast_dtype, plan.loss_scaling, plan.reduced_precision_matmul) == ("fp32", None, False, None)


def test_bf16_native_keeps_bf16_without_scaling() -> None:
    plan = resolve_precision("bf16-mixed", CPU, caps(), "error")
    assert plan.autocast_dtype is torch.bfloat16 and not plan.loss_scaling and not plan.downgrades


def test_bf16_without_native_becomes_fp16_with_loss_scaling_when_allowed() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plan = resolve_precision("bf16-mixed", CPU, caps("V100-like", bf16=E), "warn")
    assert plan.mode == "fp16-mixed" and plan.autocast_dtype is torch.float16 and plan.loss_scaling
    assert [d.used for d in plan.downgrades] == ["fp16-mixed"]
    assert recorded_downgrades() == list(plan.downgrades)
    assert any(issubclass(w.category, DowngradeWarning) and "V100-like" in str(w.message) for w in seen)


def test_bf16_without_native_is_an_error_when_fallback_error() -> None:
    with pytest.raises(FallbackRefused, match="bf16-mixed -> fp16-mixed"):
        resolve_precision("bf16-mixed", CPU, caps(bf16=E), "error")
    assert recorded_downgrades() == []


def test_allow_records_without_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail the test
        plan = resolve_precision("bf16-mixed", CPU, caps(bf16=E), "allow")
    assert plan.mode == "fp16-mixed" and len(recorded_downgrades()) == 1


def test_bf16_and_fp16_both_absent_is_unsupported() -> None:
    with pytest.raises(UnsupportedError, match="neither bf16 nor fp16"):
        resolve_precision("bf16-mixed", CPU, caps(bf16=A, fp16=A), "allow")


def test_fp16_mixed_uses_dynamic_loss_scaling() -> None:
    plan = resolve_precision("fp16-mixed", CPU, caps(), "error")
    assert plan.autocast_dtype is torch.float16 and plan.loss_scaling


def test_tf32_native_on_a_tf32_backend() -> None:
    plan = resolve_precision("tf32", CUDA, caps("H100"), "error")
    assert plan.reduced_precision_matmul == "tf32" and not plan.downgrades


def test_tf32_on_an_hf32_backend_is_a_recorded_substitution() -> None:
    plan = resolve_precision("tf32", ASCEND, caps("Ascend910B", tf32=A), "allow")
    assert plan.reduced_precision_matmul == "hf32" and plan.downgrades[0].used == "hf32"


def test_tf32_without_any_reduced_format_falls_to_fp32() -> None:
    plan = resolve_precision("tf32", CPU, caps(tf32=A), "allow")
    assert plan.mode == "fp32" and plan.reduced_precision_matmul is None


def test_fp8_requires_native_fp8_and_never_falls_back() -> None:
    with pytest.raises(UnsupportedError, match="fp8-mixed needs native fp8"):
        resolve_precision("fp8-mixed", CUDA, caps("A100", fp8_e4m3=E), "allow")
    plan = resolve_precision("fp8-mixed", CUDA, caps("H100"), "error")
    assert plan.fp8_dtype is torch.float8_e4m3fn and plan.autocast_dtype is torch.bfloat16


def test_plan_drives_real_autocast_and_scaler_on_cpu() -> None:
    plan = resolve_precision("bf16-mixed", CPU, CPU.capabilities(), "allow")
    a = torch.randn(8, 8)
    with plan.autocast(CPU):
        out = a @ a
    assert out.dtype is plan.autocast_dtype
    scaler = resolve_precision("fp16-mixed", CPU, caps(), "allow").grad_scaler(CPU)
    assert scaler.is_enabled()
    assert not resolve_precision("fp32", CPU, caps(), "allow").grad_scaler(CPU).is_enabled()
