"""Cross-device levels: device B graded against reference device A, case by case, by how its error against the
float64 golden compares with A's (``hal conformance compare``).

The rule of the cross-hardware checks vendors use to bring a device up beside a reference one (CANN's test kit's
L0/L1/L2; msprobe's dual-benchmark ratio is the same idea): three ratios of B's error to A's —

    mean_rel (mean |x − g| / |g|)   ≤ 10 / 5 / 2
    max_rel  (max  |x − g| / |g|)   ≤ 2 / 1.5 / 1.2
    rmse                            ≤ 2 / 1.5 / 1.2

— and the case's level is the highest whose three bounds all hold (L2 the strictest), else **fail**. An error below
its floor counts as the floor on both sides (``FLOORS``), so "A exact, B one rounding off" is not graded as an
infinite ratio. The rmse floor scales with the golden (``RMS_FLOOR_SHARE`` of its RMS, where the results record
``golden_rms``): an absolute 1e-9 graded float32 noise on values of magnitude 100 as a failure. And where B's rmse is
at that floor, B is as exact as the comparison can tell: its ratios count at most 1 — a near-zero golden element
(a gradient that is 0 in exact arithmetic) otherwise turns a 1e-17 error into a relative error of 1. Cases whose
results lack the three metrics (runs from before they were recorded, status-only cases) are not graded. ``matrix`` folds the grades per op
and dtype, worst case first: the report's picture.
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
DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int64", "int32")


def ratios(ca: dict[str, Any], cb: dict[str, Any]) -> dict[str, float] | None:
    """B's error over A's for the three metrics (each floored), or None where a case lacks one."""
    ma, mb = ca.get("metrics") or {}, cb.get("metrics") or {}
    scale = ma.get("golden_rms", mb.get("golden_rms"))
    floors = dict(FLOORS)
    if isinstance(scale, (int, float)) and math.isfinite(scale):
        floors["rmse"] = max(FLOORS["rmse"], RMS_FLOOR_SHARE * scale)
    out = {}
    for name in METRICS:
        a, b = ma.get(name), mb.get(name)
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or math.isnan(a):
            return None
        out[name] = math.inf if math.isnan(b) else max(b, floors[name]) / max(a, floors[name])
    if mb["rmse"] <= floors["rmse"]:  # B's error is below what the golden's scale lets us see
        out = {name: min(r, 1.0) for name, r in out.items()}
    return out


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
