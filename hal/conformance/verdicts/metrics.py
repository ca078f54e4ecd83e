"""Error metrics of a result against its float64 reference, computed in float64 on the CPU.

Every metric ignores positions where the reference is non-finite; those are checked separately
(``nonfinite_mismatch``: positions where inf/NaN disagree — same inf sign, NaN where NaN).
ULP distance is measured in units of the result dtype's spacing at the reference value, so it
reads the same for fp32, bf16 and fp16.
"""
from __future__ import annotations

import math

import torch


def _finite_pair(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.isfinite(expected) & torch.isfinite(actual)
    return actual[mask], expected[mask]


def nonfinite_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Positions where the inf/NaN pattern differs (NaN vs not, or inf vs other value/sign)."""
    a, e = actual.double(), expected.double()
    nan_diff = torch.isnan(a) != torch.isnan(e)
    inf_diff = (torch.isinf(a) | torch.isinf(e)) & ~(torch.isnan(a) | torch.isnan(e)) & (a != e)
    return int((nan_diff | inf_diff).sum())


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """Max |actual - expected| in units of ``dtype``'s spacing at |expected| (finite positions)."""
    if not dtype.is_floating_point or actual.numel() == 0:
        return 0.0
    a, e = _finite_pair(actual.double(), expected.double())
    if a.numel() == 0:
        return 0.0
    return float(((a - e).abs() / spacing(e, dtype)).max())


def spacing(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each |e| (float64): 2^(floor(log2|e|) - mantissa bits), floored at the smallest
    subnormal step — one ULP."""
    info = torch.finfo(dtype)
    mantissa = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}.get(dtype)
    if mantissa is None:  # fp8 and others: use eps-relative spacing
        mantissa = int(round(-math.log2(info.eps)))
    mag = e.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mantissa).clamp_min(info.tiny * 2.0 ** -mantissa)


SMALL_VALUE_SHARE = 2.0 ** -7  # elements below this share of the golden's RMS are in the small-value domain


def error_metrics(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, float]:
    """max_abs, max_rel, max_rel_sv (max_rel with the small-value domain), mean_rel (over non-zero golden values),
    rmse, rel_l2, cosine (and ulp for float dtypes) of
    ``actual`` against ``expected``, and golden_rms (the golden's own scale: what the cross-device levels floor rmse by).

    ``expected`` is the float64 reference; ``dtype`` is the dtype the result was computed in (for ULP).
    Shapes must match; empty tensors give zero errors and cosine 1.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"result shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}")
    a_all = actual.detach().to("cpu", torch.float64)
    e_all = expected.detach().to("cpu", torch.float64)
    out: dict[str, float] = {"nonfinite_mismatch": float(nonfinite_mismatch(a_all, e_all))}
    a, e = _finite_pair(a_all.reshape(-1), e_all.reshape(-1))
    if a.numel() == 0:
        out.update(max_abs=0.0, max_rel=0.0, max_rel_sv=0.0, mean_rel=0.0, rmse=0.0, rel_l2=0.0, cosine=1.0, golden_rms=0.0)
    else:
        diff = (a - e).abs()
        rel = diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
        out["max_abs"] = float(diff.max())
        out["max_rel"] = float(rel.max())
        # the small-value domain (CANN's precision standard's idea): an element far below the output's RMS is judged
        # by its absolute error at that scale, as its relative error is noise from cancellation
        small = SMALL_VALUE_SHARE * float(e.pow(2).mean().sqrt())
        out["max_rel_sv"] = float((diff / e.abs().clamp_min(max(small, torch.finfo(torch.float64).tiny))).max())
        out["mean_rel"] = float(rel[e != 0].mean()) if bool((e != 0).any()) else 0.0  # where the golden is not 0
        out["rmse"] = float(diff.pow(2).mean().sqrt())
        out["golden_rms"] = float(e.pow(2).mean().sqrt())
        norm_e = float(e.norm())
        out["rel_l2"] = float((a - e).norm()) / norm_e if norm_e > 0 else float((a - e).norm())
        norm_a = float(a.norm())
        out["cosine"] = float((a * e).sum()) / (norm_a * norm_e) if norm_a > 0 and norm_e > 0 else (1.0 if norm_a == norm_e else 0.0)
    if dtype is not None and dtype.is_floating_point:
        out["ulp"] = ulp_distance(a_all, e_all, dtype)
    return out
