"""Cross-device levels: device B graded against reference device A, case by case, by how its error against the
float64 golden compares with A's (``hal conformance compare``).

The rule of the cross-hardware checks vendors use to bring a device up beside a reference one (CANN's test kit's
L0/L1/L2; msprobe's dual-benchmark ratio is the same idea): three ratios of B's error to A's —

    mean_rel (mean |x − g| / |g|)   ≤ 10 / 5 / 2
    max_rel  (max  |x − g| / |g|)   ≤ 2 / 1.5 / 1.2   (|g| at least 2⁻⁷ of the golden's RMS: the small-value domain)
    rmse                            ≤ 2 / 1.5 / 1.2

— and the case's level is the highest whose three bounds all hold (L2 the strictest), else **fail**. An error below
its floor counts as the floor on both sides (``FLOORS``), so "A exact, B one rounding off" is not graded as an
infinite ratio. The rmse floor scales with the golden (``RMS_FLOOR_SHARE`` of its RMS, where the results record
``golden_rms``): an absolute 1e-9 graded float32 noise on values of magnitude 100 as a failure. And where B's rmse is
at that floor, B is as exact as the comparison can tell: its ratios count at most 1 — a near-zero golden element
(a gradient that is 0 in exact arithmetic) otherwise turns a 1e-17 error into a relative error of 1. Cases whose
results lack the three metrics (runs from before they were recorded, status-only cases) are not graded. ``matrix`` folds the grades per op
and dtype, worst case first: the report's picture.

A reference more exact than its dtype needs earns no credit (``DTYPE_FLOOR``): A's error counts as at least what
an implementation that rounds a few intermediate stages to the result dtype makes — max_rel 8 u, mean_rel 2 u, rmse
2 u of the golden's RMS, u the dtype's unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹, fp32 2⁻²⁴). Vendors' kernels commonly keep
a softmax's or a norm's intermediates in bf16 where the CPU keeps them in fp32 and rounds once; graded against the
CPU's single rounding, they failed while well inside their tolerance. ``explain`` says, for every case below L2,
both errors in roundings of the dtype, the floor that applied, the ratio that limits the level, and the likely
cause where the numbers point to one (intermediates in the dtype, TF32's 10-bit mantissa, another algorithm).
"""
from __future__ import annotations

import math
import re
from typing import Any

LEVELS = ("L2", "L1", "L0")  # strictest first
BOUNDS: dict[str, tuple[float, float, float]] = {  # level -> (mean_rel, max_rel, rmse) ratio bounds
    "L2": (2.0, 1.2, 1.2),
    "L1": (5.0, 1.5, 1.5),
    "L0": (10.0, 2.0, 2.0),
}
METRICS = ("mean_rel", "max_rel", "rmse")
FLOORS = {"mean_rel": 1e-6, "max_rel": 1e-6, "rmse": 1e-9}
RMS_FLOOR_SHARE = 1e-6  # rmse below this share of the golden's RMS is at the floor
RANK = {"fail": 0, "L0": 1, "L1": 2, "L2": 3}
UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11,
                 "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}
DTYPE_FLOOR = {"mean_rel": 2.0, "max_rel": 8.0, "rmse": 2.0}  # A's error floor, in unit roundoffs of the result dtype
TF32_UNIT_ROUNDOFF = 2.0 ** -11
DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32")


def _scale(ca: dict[str, Any], cb: dict[str, Any]) -> float | None:
    scale = (ca.get("metrics") or {}).get("golden_rms", (cb.get("metrics") or {}).get("golden_rms"))
    return float(scale) if isinstance(scale, (int, float)) and math.isfinite(scale) else None


def floors_for(ca: dict[str, Any], cb: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(the floors both errors count as at least, the higher floor only A's counts as: the dtype's ``DTYPE_FLOOR``)."""
    scale = _scale(ca, cb)
    floors = dict(FLOORS)
    if scale is not None:
        floors["rmse"] = max(FLOORS["rmse"], RMS_FLOOR_SHARE * scale)
    u = UNIT_ROUNDOFF.get(op_and_dtype(str(ca.get("id", "")))[1])
    a_floors = dict(floors)
    if u is not None:
        a_floors["mean_rel"] = max(floors["mean_rel"], DTYPE_FLOOR["mean_rel"] * u)
        a_floors["max_rel"] = max(floors["max_rel"], DTYPE_FLOOR["max_rel"] * u)
        if scale is not None:
            a_floors["rmse"] = max(floors["rmse"], DTYPE_FLOOR["rmse"] * u * scale)
    return floors, a_floors


def _with_small_values(m: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """The metrics with max_rel taken over the small-value domain (``metrics.max_rel_sv``) where both runs have it:
    a golden element far below the output's RMS (a gradient that cancels to near 0) judged by its absolute error."""
    if isinstance(m.get("max_rel_sv"), (int, float)) and isinstance(other.get("max_rel_sv"), (int, float)):
        return {**m, "max_rel": m["max_rel_sv"]}
    return m


def ratios(ca: dict[str, Any], cb: dict[str, Any]) -> dict[str, float] | None:
    """B's error over A's for the three metrics (each floored; A's also at the dtype's floor), or None where a case
    lacks one."""
    ma0, mb0 = ca.get("metrics") or {}, cb.get("metrics") or {}
    ma, mb = _with_small_values(ma0, mb0), _with_small_values(mb0, ma0)
    floors, a_floors = floors_for(ca, cb)
    out = {}
    for name in METRICS:
        a, b = ma.get(name), mb.get(name)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or math.isnan(a):
            return None
        out[name] = math.inf if math.isnan(b) else max(b, floors[name]) / max(a, a_floors[name])
    if mb["rmse"] <= floors["rmse"]:  # B's error is below what the golden's scale lets us see
        out = {name: min(r, 1.0) for name, r in out.items()}
    return out


def explain(ca: dict[str, Any], cb: dict[str, Any], r: dict[str, float], level: str) -> dict[str, Any]:
    """Why a case is below L2: both errors (and in roundings of the dtype), the floors, the limiting ratio, the cause."""
    ma0, mb0 = ca.get("metrics") or {}, cb.get("metrics") or {}
    ma, mb = _with_small_values(ma0, mb0), _with_small_values(mb0, ma0)
    op, dtype = op_and_dtype(str(ca.get("id", "")))
    floors, a_floors = floors_for(ca, cb)
    target = BOUNDS["L2"]
    limiting = max(METRICS, key=lambda m: r[m] / target[METRICS.index(m)])
    u = UNIT_ROUNDOFF.get(dtype)
    out: dict[str, Any] = {
        "level": level, "dtype": dtype, "limiting": limiting, "ratio": r[limiting],
        "a": {m: ma.get(m) for m in METRICS}, "b": {m: mb.get(m) for m in METRICS},
        "a_floor": {m: a_floors[m] for m in METRICS if (ma.get(m) or 0.0) < a_floors[m]},
        "tol_ratio": {"a": ma.get("tol_ratio"), "b": mb.get("tol_ratio")},
    }
    if u is not None:
        out["roundings"] = {"a": (ma.get("max_rel") or 0.0) / u, "b": (mb.get("max_rel") or 0.0) / u}
    out["cause"] = _cause(op, dtype, ma, mb, u)
    return out


def _cause(op: str, dtype: str, ma: dict[str, Any], mb: dict[str, Any], u: float | None) -> str:
    a, b = float(ma.get("max_rel") or 0.0), float(mb.get("max_rel") or 0.0)
    mean_b = float(mb.get("mean_rel") or 0.0)
    if dtype == "float32" and TF32_UNIT_ROUNDOFF / 8 <= mean_b <= TF32_UNIT_ROUNDOFF * 8:
        return ("B's typical error is of TF32's 10-bit mantissa (2^-11): a reduced-precision fp32 matmul (TF32, HF32) "
                "in B's kernel, or a setting that allows it")
    if u is not None and dtype in ("bfloat16", "float16") and b > 2 * u and a <= 2 * u:
        return (f"B's worst element is {b / u:.0f} roundings of {dtype}, A's {a / u:.1f}: B keeps intermediates in "
                f"{dtype} (accumulating in the input dtype) where A computes in float32 and rounds once")
    if u is not None and b > 64 * u:
        return (f"B's error is {b / u:.0f} roundings of {dtype}: another algorithm (a fused kernel, another summation "
                "order or an approximation), not a rounding of the same one")
    return "B is less exact than A by the ratio shown; both errors are within the case's tolerance where both passed"


def grade(r: dict[str, float] | None) -> str | None:
    """The highest level whose bounds all hold, "fail" when none does, None for an ungraded case."""
    if r is None:
        return None
    for level in LEVELS:
        if all(r[m] <= bound for m, bound in zip(METRICS, BOUNDS[level])):
            return level
    return "fail"


def op_and_dtype(case_id: str) -> tuple[str, str]:
    """('ops::softmax', 'bfloat16') from 'ops::softmax/reference/bfloat16/normal/forward': the suite and the name's
    first part, and the first dtype named in the id ('—' where none is)."""
    suite, _, name = case_id.partition("::")
    parts = re.split(r"[/\[\]]", name)
    dtype = next((p for p in parts if p in DTYPES), "—")
    return f"{suite}::{parts[0]}", dtype


def matrix(graded: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """{op: {dtype: the worst grade of its cases}} from (case id, grade) pairs."""
    out: dict[str, dict[str, str]] = {}
    for case_id, level in graded:
        op, dtype = op_and_dtype(case_id)
        row = out.setdefault(op, {})
        if dtype not in row or RANK[level] < RANK[row[dtype]]:
            row[dtype] = level
    return out


def matrix_text(grades: dict[str, dict[str, str]]) -> list[str]:
    """The matrix as text lines: one row an op, one column a dtype."""
    if not grades:
        return []
    dtypes = [d for d in DTYPES + ("—",) if any(d in row for row in grades.values())]
    header = ["op", *dtypes]
    rows = [[op, *(row.get(d, "") for d in dtypes)] for op, row in sorted(grades.items())]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]


_COLOURS = {"L2": "#c8e6c9", "L1": "#fff9c4", "L0": "#ffe0b2", "fail": "#ffcdd2"}


def matrix_html(grades: dict[str, dict[str, str]], title: str, subtitle: str) -> str:
    """A one-file page (no scripts, no external files) with the matrix, each cell coloured by its level."""
    import html

    dtypes = [d for d in DTYPES + ("—",) if any(d in row for row in grades.values())]
    head = "".join(f"<th>{html.escape(d)}</th>" for d in ["op", *dtypes])
    body = []
    for op, row in sorted(grades.items()):
        cells = "".join(f'<td style="background:{_COLOURS.get(row.get(d, ""), "#fff")}">{html.escape(row.get(d, ""))}</td>'
                        for d in dtypes)
        body.append(f"<tr><th>{html.escape(op)}</th>{cells}</tr>")
    legend = " ".join(f'<span style="background:{c};padding:0 .4em">{k}</span>' for k, c in _COLOURS.items())
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>hal conformance compare</title><style>"
            "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:left}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p><p>{legend}</p>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></body></html>\n")
