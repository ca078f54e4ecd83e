"""Whether an op's result on the device is right: against a float64 golden value, else against torch's CPU kernel.

A result passes a sample when every output element is within the golden tolerance of the float64 reference computed
from the same (exactly widened) inputs, or — where computing in the dtype itself is what moves it off the golden
value (a floor at a rounding boundary, a dtype's own overflow) — within torch.testing's default tolerance of
PyTorch's CPU kernel run in the same dtype. Non-finite values must sit where the references have them; integer and
bool results must be equal.

Golden tolerance, per dtype: ``|a - g| <= rtol * |g| + atol * max(1, max |g|)`` — rtol one rounding of the result
(torch.testing's resolutions), atol the same scaled to the output's magnitude, so a sum that cancels to near zero is
held to the rounding of its terms, not to a relative error of its tiny result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# dtype -> (rtol, atol): golden (float64) comparison
GOLDEN: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 8e-3),
    torch.float16: (1e-3, 1e-3),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex32: (1e-3, 1e-3),
}
# dtype -> (rtol, atol): torch.testing.assert_close's defaults, against the CPU kernel in the same dtype
SAME_DTYPE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.complex128: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex32: (1e-3, 1e-5),
}
TABLE_VERSION = "survey-tolerances-1"  # part of the cohort digest: a changed table makes surveys incomparable


@dataclass(frozen=True)
class Miss:
    """The worst element of an output outside its bound: where, the values, the error and the bound."""

    output: str
    index: int
    got: str
    expected: str
    error: float
    bound: float
    why: str

    def text(self) -> str:
        return (f"{self.output}[{self.index}]: got {self.got}, expected {self.expected} "
                f"(error {self.error:.3g} > bound {self.bound:.3g}; {self.why})")


def _scalar(x: torch.Tensor) -> str:
    v = x.item()
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _nonfinite_miss(name: str, got: torch.Tensor, ref: torch.Tensor) -> Miss | None:
    if not (got.is_floating_point() or got.is_complex()):
        return None
    g, r = torch.view_as_real(got) if got.is_complex() else got, torch.view_as_real(ref) if ref.is_complex() else ref
    gn, rn = torch.isnan(g), torch.isnan(r)
    gi, ri = torch.isinf(g), torch.isinf(r)
    bad = (gn != rn) | (gi != ri) | (gi & ri & (torch.sign(g) != torch.sign(r)))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        return Miss(name, i, _scalar(g.flatten()[i]), _scalar(r.flatten()[i]), float("inf"), 0.0, "non-finite mismatch")
    return None


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, rtol_atol: tuple[float, float] | None,
            *, scale_atol: bool) -> tuple[Miss | None, float]:
    """(the worst element outside its bound or None, the largest error / bound ratio) of ``got`` (on the host)
    against ``ref``. ``rtol_atol`` None: equal is required (integers, bool)."""
    if got.shape != ref.shape:
        return Miss(name, 0, f"shape {tuple(got.shape)}", f"shape {tuple(ref.shape)}", float("inf"), 0.0,
                    "shape differs"), float("inf")
    if got.numel() == 0:
        return None, 0.0
    if rtol_atol is None or not (got.is_floating_point() or got.is_complex()):
        unequal = got.to(ref.dtype) != ref if got.dtype != ref.dtype else got != ref
        if got.is_floating_point() or got.is_complex():
            unequal &= ~(torch.isnan(got) & torch.isnan(ref.to(got.dtype)))
        if bool(unequal.any()):
            i = int(unequal.flatten().nonzero()[0])
            return Miss(name, i, _scalar(got.flatten()[i]), _scalar(ref.flatten()[i]), float("inf"), 0.0,
                        "must be equal"), float("inf")
        return None, 0.0
    miss = _nonfinite_miss(name, got, ref)
    if miss is not None:
        return miss, float("inf")
    wide = torch.complex128 if got.is_complex() else torch.float64
    g, r = got.to(wide), ref.to(wide)
    finite = torch.isfinite(r) if not r.is_complex() else torch.isfinite(torch.view_as_real(r)).all(-1)
    err = torch.where(finite, (g - r).abs(), torch.zeros((), dtype=torch.float64))
    mag = torch.where(finite, r.abs(), torch.zeros((), dtype=torch.float64))
    rtol, atol = rtol_atol
    top = float(mag.max()) if scale_atol else 1.0
    bound = rtol * mag + atol * max(1.0, top)
    ratio = err / bound
    worst = int(ratio.flatten().argmax())
    worst_ratio = float(ratio.flatten()[worst])
    if worst_ratio <= 1.0:
        return None, worst_ratio
    return Miss(name, worst, _scalar(got.flatten()[worst]), _scalar(ref.flatten()[worst]),
                float(err.flatten()[worst]), float(bound.flatten()[worst]), "outside the tolerance"), worst_ratio


def judge_outputs(got: list[tuple[str, Any]], golden: list[tuple[str, Any]] | None,
                  same: list[tuple[str, Any]]) -> tuple[Miss | None, str, float]:
    """(the miss that fails the sample or None, which reference decided: golden | cpu, the worst golden ratio).

    ``got``, ``golden`` and ``same`` are the flattened outputs (name, host tensor or plain value) of the device, the
    float64 reference (None where the op has no float64 kernel on the CPU) and the CPU kernel in the same dtype."""
    if len(got) != len(same):
        return Miss("outputs", 0, str(len(got)), str(len(same)), float("inf"), 0.0, "number of outputs differs"), "cpu", 0.0
    if golden is not None and len(golden) != len(same):
        golden = None  # the widened call returns another structure (a dtype-dependent result): judged by the CPU kernel
    worst_golden = 0.0
    golden_miss: Miss | None = None
    for i, ((name, g), (_, s)) in enumerate(zip(got, same)):
        if not isinstance(g, torch.Tensor) or not isinstance(s, torch.Tensor):
            if isinstance(g, torch.Tensor) != isinstance(s, torch.Tensor) or (g != s and not _both_nan(g, s)):
                return Miss(name, 0, repr(g), repr(s), float("inf"), 0.0, "value differs"), "cpu", 0.0
            continue
        if g.dtype != s.dtype:
            return Miss(name, 0, str(g.dtype), str(s.dtype), float("inf"), 0.0, "result dtype differs"), "cpu", 0.0
        floating = g.is_floating_point() or g.is_complex()
        if golden is not None and floating and isinstance(golden[i][1], torch.Tensor):
            miss, ratio = compare(name, g, golden[i][1], GOLDEN.get(g.dtype), scale_atol=True)
            worst_golden = max(worst_golden, ratio)
            if miss is None:
                continue
            golden_miss = golden_miss or miss
        miss, _ = compare(name, g, s, SAME_DTYPE.get(g.dtype) if floating else None, scale_atol=False)
        if miss is not None:
            return golden_miss or miss, "cpu", worst_golden
    return None, ("golden" if golden_miss is None and golden is not None else "cpu"), worst_golden


def _both_nan(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b
