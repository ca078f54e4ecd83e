"""The verdict rules: one table of tolerances by op category and dtype, and how a case is judged.

A result ``a`` passes against its float64 reference ``e`` when, at every finite position,

    |a - e| <= atol + rtol * |e|          (torch.testing.assert_close's rule)

and its inf/NaN positions equal the reference's. The case's headline metric ``tol_ratio`` is
max |a - e| / (atol + rtol * |e|): ≤ 1 passes, and it is what the report plots against the line 1.

=============  ===========================================================================================
category       rule
=============  ===========================================================================================
exact          data movement (embedding lookup, gathers, copies, collectives on order-invariant data):
               rtol = atol = 0 — bitwise equal to the reference rounded to the result dtype
elementwise    one rounding of the output: rtol = the dtype's resolution (below), atol = the dtype's ATOL
normalization  softmax, rms_norm, layer_norm: a reduction whose output is O(1) whatever K is, so the
               bound does not grow with K: rtol = resolution, atol = ATOL
reduction      sums and losses over K elements: rtol = resolution, atol = ATOL × K
               (FlagGems' ``reduce_dim`` scaling: error grows with the reduction length)
matmul         linear, matmul, attention over an inner dimension K: rtol = resolution, atol = ATOL × K
=============  ===========================================================================================

Resolutions are torch.testing's defaults (fp32 1.3e-6, fp16 1e-3, bf16 1.6e-2, fp64 1e-7), which are
also FlagGems' ``RESOLUTION`` table. ATOL is torch.testing's for fp64 (1e-7) and fp32 (1e-5) and
FlagGems' base atol (1e-4) for fp16 and bf16: torch.testing's 1e-5 there assumes a reference in the
same dtype, not fp64, and the reference implementations themselves fail it on large inputs. Low-precision results are compared with a
reference computed in float64 from the SAME rounded inputs (FlagGems' upcast reference), so the bound
measures the implementation, not the input rounding.

HAL ops map to categories through ``OP_CATEGORY``: embedding → exact; silu, gelu, swiglu,
rotary_embedding → elementwise; softmax, rms_norm, add_rms_norm (its x + residual output:
elementwise) → normalization; cross_entropy → reduction (K = classes); linear, matmul,
scaled_dot_product_attention, linear_cross_entropy → matmul (K = inner length; for attention the
larger of head_dim and key length; for the fused head and loss the hidden size). Gradients are judged per input with the
category of the computation that produces them (e.g. a weight gradient summed over M rows is a
reduction with K = M).

Overrides: a case may widen a bound only through ``override(tolerance, reason)``; the reason is
stored with the outcome and printed in the report. The overrides the suites use:

=====================  ======================================================================================
where                  override and reason
=====================  ======================================================================================
ops: scaled inputs,   atol × the result's natural magnitude (``Sample.magnitude`` / ``GradSpec.magnitude`` in
normalised rows        ``hal/conformance/suites/inputs.py``: s² for a matmul of inputs scaled by s; for rms_norm / layer_norm
                       max |x̂| and max 1/√(s_row+eps) over the rows drawn, s_row their mean square or variance,
                       so a one-column layer_norm row, whose input gradient is 1/√eps times rounding noise,
                       gets the same verdict for every seed): the table's atol assumes O(1) values, so unscaled
                       it is vacuous for tiny results and below one rounding of large ones
ops: bf16 / fp16       atol = rtol × max|reference| (a normwise bound) where that is larger, for every backward
intermediates          case and the forward of rotary_embedding and scaled_dot_product_attention: autograd and
                       these references materialise intermediates (gradients of intermediates, x·cos and
                       rotate_half(x)·sin, attention probabilities) in the input dtype, so cancellation leaves
                       one rounding at the scale of the tensor rather than of each element. Where the
                       gradient is itself a difference that cancels (softmax's y·(g − Σy·g), attention's
                       dS·K), max|reference| depends on how much the seed's draw cancels, so the scale is
                       the same formula with every term in absolute value (``inputs.GradScale``, Higham's
                       |A||B|): the verdict is then the same for every seed (tests sweep seeds 0-20)
collectives: float     rtol = Higham's γ_(K-1) (γ_K for avg) where it exceeds the table's rtol (fp16 at K ≥ 4,
sum/avg/product        bf16 at K ≥ 6): a reduction over K ranks rounds up to K-1 times in the dtype, on positive
over K ranks           inputs (``hal/conformance/suites/collective_checks.py``, ``reduction_tolerance``)
=====================  ======================================================================================
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hal.conformance.verdicts.metrics import error_metrics

CATEGORIES = ("exact", "elementwise", "normalization", "reduction", "matmul")
ATOL_BASE = 1e-4  # dtypes without an entry in ATOL (fp8)
ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-7,  # torch.testing
    torch.float32: 1e-5,  # torch.testing
    torch.float16: 1e-4,  # FlagGems (torch.testing's 1e-5 assumes a reference in the same dtype)
    torch.bfloat16: 1e-4,  # FlagGems
}
RESOLUTION: dict[torch.dtype, float] = {
    torch.float64: 1e-7,
    torch.float32: 1.3e-6,
    torch.float16: 1e-3,
    torch.bfloat16: 1.6e-2,
}
if hasattr(torch, "float8_e4m3fn"):
    RESOLUTION[torch.float8_e4m3fn] = 0.125  # 3 mantissa bits: one rounding is up to 2^-4 relative, two roundings
if hasattr(torch, "float8_e5m2"):
    RESOLUTION[torch.float8_e5m2] = 0.25


OP_CATEGORY: dict[str, str] = {
    "embedding": "exact",
    "silu": "elementwise",
    "gelu": "elementwise",
    "swiglu": "elementwise",
    "rotary_embedding": "elementwise",
    "softmax": "normalization",
    "rms_norm": "normalization",
    "add_rms_norm": "normalization",  # its second output (x + residual) is judged as elementwise
    "layer_norm": "normalization",
    "cross_entropy": "reduction",
    "linear_cross_entropy": "matmul",  # K = hidden size: the logits' matmul dominates the error
    "linear": "matmul",
    "matmul": "matmul",
    "scaled_dot_product_attention": "matmul",
}


def op_category(op: str) -> str:
    """The tolerance category of HAL op ``op``; an op missing from the table is a ValueError."""
    try:
        return OP_CATEGORY[op]
    except KeyError:
        raise ValueError(f"op {op!r} has no tolerance category; add it to OP_CATEGORY in hal/conformance/verdicts/tolerances.py") from None


@dataclass(frozen=True)
class Tolerance:
    category: str
    dtype: str
    rtol: float
    atol: float
    reason: str = ""  # why the bound differs from the table (empty: straight from the table)

    def to_dict(self) -> dict[str, float | str]:
        d: dict[str, float | str] = {"rtol": self.rtol, "atol": self.atol, "category": self.category}
        if self.reason:
            d["override"] = self.reason
        return d


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tolerance_for(category: str, dtype: torch.dtype, k: int = 1) -> Tolerance:
    """The table's bound for ``category`` in ``dtype``; ``k`` is the reduction length (reduction, matmul)."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown tolerance category {category!r}; use one of {', '.join(CATEGORIES)}")
    if category == "exact" or not dtype.is_floating_point:
        return Tolerance(category, dtype_name(dtype), 0.0, 0.0)
    rtol = RESOLUTION.get(dtype)
    if rtol is None:
        raise ValueError(f"no tolerance is defined for {dtype_name(dtype)}")
    atol = ATOL.get(dtype, ATOL_BASE) * (max(1, k) if category in ("reduction", "matmul") else 1)
    return Tolerance(category, dtype_name(dtype), rtol, atol)


def override(tol: Tolerance, reason: str, *, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """A wider (or narrower) bound for one case, with the reason the report prints."""
    if not reason:
        raise ValueError("a tolerance override needs its reason")
    return replace(tol, rtol=tol.rtol if rtol is None else rtol, atol=tol.atol if atol is None else atol, reason=reason)


def tol_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float:
    """max |a - e| / (atol + rtol |e|) over finite positions; exact bounds give 0 or inf."""
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    mask = torch.isfinite(a) & torch.isfinite(e)
    a, e = a[mask], e[mask]
    if a.numel() == 0:
        return 0.0
    diff = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    if tol.rtol == 0 and tol.atol == 0:
        return 0.0 if bool((diff == 0).all()) else float("inf")
    return float((diff / bound).max())


@dataclass(frozen=True)
class Judgement:
    passed: bool
    metrics: dict[str, float]
    failed_metric: str | None
    reason: str


def judge(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, dtype: torch.dtype | None = None) -> Judgement:
    """Compare ``actual`` with its float64 reference under ``tol``; name the deciding metric."""
    if tuple(actual.shape) != tuple(expected.shape):
        return Judgement(False, {}, "shape", f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    metrics = error_metrics(actual, expected, dtype or actual.dtype)
    metrics["tol_ratio"] = tol_ratio(actual, expected, tol)
    if metrics["nonfinite_mismatch"] > 0:
        return Judgement(False, metrics, "nonfinite_mismatch",
                         f"{int(metrics['nonfinite_mismatch'])} inf/NaN position(s) differ from the reference")
    if metrics["tol_ratio"] > 1.0:
        return Judgement(False, metrics, "tol_ratio",
                         f"max error {metrics['max_abs']:.3g} is {metrics['tol_ratio']:.3g}x the bound "
                         f"(rtol {tol.rtol:g}, atol {tol.atol:g}, {tol.category})")
    return Judgement(True, metrics, None, "")
