"""Verdict profiles: which rule judges a result against its float64 reference (``hal conformance run --verdict``).

Why selectable: a team bringing up an accelerator works to its vendor's rule, which can be stricter than ours for
some dtypes; the same run judged under that rule says where it stands, and every report records the rule it used.

* ``hal`` (default): the table and documented overrides of ``tolerances`` (category-aware: a matmul's atol grows
  with its inner length K; the bound scales with the result's natural magnitude).
* ``torch``: ``torch.testing.assert_close``'s defaults for the result dtype, at every finite position
  (fp16 1e-3 / 1e-5, bf16 1.6e-2 / 1e-5, fp32 1.3e-6 / 1e-5, fp64 1e-7 / 1e-7), no category scaling.
* ``cann``: the mixed-tolerance rule of Huawei's CANN operator precision standard, as the issue summarises it —
  an element passes when |a − g| ≤ atol + rtol·|g| with rtol = atol per dtype (fp16 2⁻⁹, bf16 2⁻⁶; fp32 2⁻¹⁰ /
  2⁻¹⁶; fp8 e4m3 2⁻² / 2⁻⁴, e5m2 2⁻¹ / 2⁻³); the case passes when at least 99 % of the finite elements pass **and**
  the largest finite error is at most max(atol, 32 ULP of the golden value in the result's dtype) at its element
  (our reading of "max(fallback, 32 ULP of the low-precision golden)": the fallback taken as the dtype's atol);
  inf/NaN positions must match. Not checked against CANN's own text or tools here (no Ascend hardware or CANN
  toolkit); the figures are the issue's.

Under every profile an ``exact`` case (data movement) stays bitwise: vendors check those by binary consistency.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hal.conformance.verdicts.metrics import error_metrics, spacing
from hal.conformance.verdicts.tolerances import ATOL, ATOL_BASE, RESOLUTION, Judgement, Tolerance, dtype_name, judge

PROFILES = ("hal", "torch", "cann")
DEFAULT = "hal"
CANN_PASS_SHARE = 0.99  # share of finite elements within atol + rtol·|g|
CANN_ULP_CAP = 32  # the largest error, in ULP of the golden value in the result's dtype

TORCH_TOL: dict[torch.dtype, tuple[float, float]] = {  # (rtol, atol): torch.testing.assert_close's defaults
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}
CANN_TOL: dict[torch.dtype, tuple[float, float]] = {  # (rtol, atol)
    torch.float16: (2.0 ** -9, 2.0 ** -9),
    torch.bfloat16: (2.0 ** -6, 2.0 ** -6),
    torch.float32: (2.0 ** -10, 2.0 ** -16),
}
if hasattr(torch, "float8_e4m3fn"):
    CANN_TOL[torch.float8_e4m3fn] = (2.0 ** -2, 2.0 ** -4)
if hasattr(torch, "float8_e5m2"):
    CANN_TOL[torch.float8_e5m2] = (2.0 ** -1, 2.0 ** -3)


def check_profile(name: str) -> str:
    """``name`` if it is a verdict profile, else a ValueError naming them."""
    if name not in PROFILES:
        raise ValueError(f"verdict profile {name!r} is unknown; use one of {', '.join(PROFILES)}")
    return name


def judge_under(profile: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance,
                dtype: torch.dtype | None = None) -> tuple[Judgement, Tolerance]:
    """``actual`` against its float64 reference under ``profile``: the judgement and the bound it applied (``tol``,
    our table's, under ``hal`` and for exact cases; the profile's own per-dtype bound otherwise)."""
    dtype = dtype or actual.dtype
    exact = tol.rtol == 0.0 and tol.atol == 0.0
    if profile == "hal" or exact or not dtype.is_floating_point:
        return judge(actual, expected, tol, dtype), tol
    table = TORCH_TOL if profile == "torch" else CANN_TOL
    if dtype not in table:  # cann defines no fp64 rule: our table judges it, said in the bound's reason
        bound = Tolerance(tol.category, tol.dtype, tol.rtol, tol.atol,
                          f"verdict profile {profile} has no {dtype_name(dtype)} rule: hal's table"
                          + (f"; {tol.reason}" if tol.reason else ""))
        return judge(actual, expected, bound, dtype), bound
    rtol, atol = table[dtype]
    bound = Tolerance(tol.category, dtype_name(dtype), rtol, atol, f"verdict profile {profile}")
    if profile == "torch":
        return judge(actual, expected, bound, dtype), bound
    return _judge_cann(actual, expected, bound, dtype), bound


def _judge_cann(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, dtype: torch.dtype) -> Judgement:
    if tuple(actual.shape) != tuple(expected.shape):
        return Judgement(False, {}, "shape", f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    metrics = error_metrics(actual, expected, dtype)
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    g = expected.detach().to("cpu", torch.float64).reshape(-1)
    finite = torch.isfinite(a) & torch.isfinite(g)
    a, g = a[finite], g[finite]
    diff = (a - g).abs()
    passing = diff <= tol.atol + tol.rtol * g.abs()
    share = float(passing.double().mean()) if a.numel() else 1.0
    cap = torch.maximum(torch.full_like(g, tol.atol), CANN_ULP_CAP * spacing(g, dtype))
    worst = float((diff / cap).max()) if a.numel() else 0.0
    metrics.update(pass_share=share, ulp_cap_ratio=worst, tol_ratio=worst)
    if metrics["nonfinite_mismatch"] > 0:
        return Judgement(False, metrics, "nonfinite_mismatch",
                         f"{int(metrics['nonfinite_mismatch'])} inf/NaN position(s) differ from the reference")
    if share < CANN_PASS_SHARE:
        return Judgement(False, metrics, "pass_share",
                         f"{share:.2%} of the elements within rtol {tol.rtol:g} / atol {tol.atol:g} (cann needs "
                         f"{CANN_PASS_SHARE:.0%})")
    if worst > 1.0:
        return Judgement(False, metrics, "ulp_cap_ratio",
                         f"largest error {metrics['max_abs']:.3g} is {worst:.3g}x max(atol, {CANN_ULP_CAP} ULP) of its "
                         "golden value (cann)")
    return Judgement(True, metrics, None, "")


@dataclass(frozen=True)
class Looser:
    """Where our default table (``hal``) is looser than a profile for a dtype: its bound for an O(1) elementwise
    result against the profile's."""

    dtype: str
    ours: tuple[float, float]
    theirs: tuple[float, float]

    def line(self, profile: str) -> str:
        parts = [f"{name} {mine:.3g} > {profile}'s {theirs:.3g}" for name, mine, theirs in
                 (("rtol", self.ours[0], self.theirs[0]), ("atol", self.ours[1], self.theirs[1])) if mine > theirs]
        return f"{self.dtype}: our default {', '.join(parts)}"


def looser_than(profile: str) -> list[Looser]:
    """Every dtype where our elementwise bound (rtol or atol) exceeds ``profile``'s — what the report says."""
    if profile == "hal":
        return []
    table = TORCH_TOL if profile == "torch" else CANN_TOL
    out = []
    for dtype, (rtol, atol) in table.items():
        if dtype not in RESOLUTION:
            continue
        ours = (RESOLUTION[dtype], ATOL.get(dtype, ATOL_BASE))
        if ours[0] > rtol or ours[1] > atol:
            out.append(Looser(dtype_name(dtype), ours, (rtol, atol)))
    return out

