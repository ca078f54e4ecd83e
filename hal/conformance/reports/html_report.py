"""report.html: one self-contained page — inline CSS, plots as inline SVG, no scripts, no external files.

It opens from a mail attachment or an air-gapped machine exactly as on the machine that ran the suite.
A plot that cannot be drawn (matplotlib absent, or it raised) is replaced by a visible note saying
why and how to get it; the page itself is always written.
"""
from __future__ import annotations

import html
from typing import Any, Callable

from hal.conformance.reports.results import (
    CASE_COLUMNS,
    STATUSES,
    by_suite,
    case_row,
    counts_rows,
    failing_metric,
    failures,
    fmt,
    metadata_rows,
    title,
    verdict_line,
    worst_by_tol_ratio,
)

from . import plots

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fafafa}
main{max-width:1280px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:32px 0 10px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:14px;margin:18px 0 6px}
.verdict{display:inline-block;padding:3px 12px;border-radius:4px;font-weight:700;color:#fff;margin-left:8px;font-size:15px}
.verdict.pass{background:#1e8449}.verdict.fail{background:#c0392b}
.summary{margin:6px 0 14px;color:#444}
table{border-collapse:collapse;margin:6px 0;background:#fff}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.meta th{background:#f6f6f6;width:190px}
.st{font-weight:600;white-space:nowrap}
.st.pass{color:#1e8449}.st.fail,.st.error{color:#c0392b}.st.skip,.st.unsupported{color:#7f8c8d}
tr.bad td{background:#fdf0ef}
.unverified{color:#b9770e;font-weight:600}
.note{background:#fff8e1;border:1px solid #f0d98c;padding:8px 12px;border-radius:4px;margin:6px 0}
.plot{background:#fff;border:1px solid #e3e3e3;padding:8px;margin:8px 0;overflow-x:auto}
.plot svg{max-width:100%;height:auto}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
pre{white-space:pre-wrap;font-size:12px;background:#f6f6f6;padding:6px;margin:4px 0;max-height:320px;overflow:auto}
code,.id{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
footer{margin-top:36px;color:#888;font-size:12px}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _status(status: str) -> str:
    return f'<span class="st {_e(status)}">{_e(status)}</span>'


def _table(header: list[str], rows: list[list[str]], *, numeric: set[int] = frozenset(), row_class: list[str] | None = None) -> str:
    """A table from already-escaped cell HTML; ``numeric`` columns are right-aligned."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = "".join(f'<td class="num">{c}</td>' if j in numeric else f"<td>{c}</td>" for j, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _header(doc: dict[str, Any]) -> str:
    verdict = "pass" if doc.get("verdict") == "pass" else "fail"
    rows = []
    for key, value in metadata_rows(doc):
        cell = _e(value)
        if key == "hardware verification" and not doc.get("verified_on_hardware"):
            cell = f'<span class="unverified">{cell}</span>'
        if key == "backend" and len(value) > 120:  # auto's reason lists every backend passed over: fold it
            cell = f"<details><summary>{_e(value[:110])}…</summary>{cell}</details>"
        rows.append(f"<tr><th>{_e(key)}</th><td>{cell}</td></tr>")
    return (f"<h1>hal conformance: {_e(title(doc))}<span class=\"verdict {verdict}\">{verdict.upper()}</span></h1>"
            f"<p class=\"summary\">{_e(verdict_line(doc))}</p>"
            f"<table class=\"meta\">{''.join(rows)}</table>")


def _counts(doc: dict[str, Any]) -> str:
    rows, classes = [], []
    for suite, c in counts_rows(doc):
        name = f"<b>{_e(suite)}</b>" if suite == "total" else _e(suite)
        rows.append([name, *(_e(c.get(s, 0)) for s in STATUSES), _e(c.get("total", 0)), _e(fmt(c.get("seconds")))])
        classes.append("bad" if c.get("fail", 0) or c.get("error", 0) else "")
    return "<h2>Cases per suite</h2>" + _table(["suite", *STATUSES, "total", "seconds"], rows,
                                               numeric=set(range(1, len(STATUSES) + 3)), row_class=classes)


def _traceback(case: dict[str, Any]) -> str:
    tb = case.get("traceback")
    return f"<details><summary>traceback</summary><pre>{_e(tb)}</pre></details>" if tb else ""


def _failures(doc: dict[str, Any]) -> str:
    bad = failures(doc)
    if not bad:
        return "<h2>Failures (0)</h2><p>None: every case that ran passed, or was skipped or unsupported with its reason.</p>"
    rows = [[f'<span class="id">{_e(c["id"])}</span>', _status(c["status"]), *(_e(v) for v in failing_metric(c)),
             _e(c.get("reason") or "") + _traceback(c)] for c in bad]
    return f"<h2>Failures ({len(bad)})</h2>" + _table(["case", "status", "metric", "value", "bound", "reason"], rows,
                                                     numeric={3, 4})


def _worst(doc: dict[str, Any]) -> str:
    ranked = worst_by_tol_ratio(doc)
    if not ranked:
        return ""
    rows = [[_e(fmt(v)), _status(c["status"]), f'<span class="id">{_e(c["id"])}</span>'] for v, c in ranked]
    return ("<h3>Worst cases by tol_ratio (max error / bound; above 1 fails)</h3>"
            + _table(["tol_ratio", "status", "case"], rows, numeric={0}))


PLOTS: list[tuple[str, str, Callable[[dict[str, Any]], str | None], str]] = [
    ("tol_ratio", "Error against tolerance per op and dtype", plots.tol_ratio_svg,
     "no case in this run reports a tol_ratio metric (ops, precision and onnx cases do)"),
    ("loss", "Training loss against the reference", plots.loss_svg,
     "no case in this run carries a loss curve (training cases do: data steps / loss / reference_loss)"),
    ("busbw", "Collective bus bandwidth against message size", plots.busbw_svg,
     "no case in this run carries a bandwidth table (collectives cases do: data sizes_bytes / busbw_gbs)"),
]


def _plots(doc: dict[str, Any]) -> str:
    out = ["<h2>Plots</h2>"]
    missing = plots.missing()
    for key, heading, draw, empty in PLOTS:
        out.append(f'<h3 id="plot-{key}">{_e(heading)}</h3>')
        if missing:
            out.append(f'<p class="note">Plot missing: {_e(missing)}.</p>')
            continue
        try:
            svg = draw(doc)
        except Exception as exc:  # shown on the page: a broken plot must not cost the report
            out.append(f'<p class="note">Plot missing: drawing it failed ({_e(type(exc).__name__)}: {_e(exc)}).</p>')
            continue
        out.append(f'<div class="plot">{svg}</div>' if svg else f"<p>Nothing to plot: {_e(empty)}.</p>")
    return "".join(out)


def _bound(case: dict[str, Any]) -> str:
    tol = case.get("tolerance") or {}
    parts = [str(tol["category"])] if "category" in tol else []
    parts += [f"{k} {fmt(tol[k])}" for k in ("rtol", "atol") if k in tol]
    parts += [f"{k} {fmt(v)}" for k, v in tol.items() if k not in ("category", "rtol", "atol", "override")]
    text = _e(", ".join(parts))
    if tol.get("override"):
        text += f"<br><i>override: {_e(tol['override'])}</i>"
    return text


def _all_cases(doc: dict[str, Any]) -> str:
    out = ["<h2>All cases</h2>"]
    for suite, cases in by_suite(doc).items():
        bad = sum(c["status"] in ("fail", "error") for c in cases)
        counts = ", ".join(f"{sum(c['status'] == s for c in cases)} {s}" for s in STATUSES if any(c["status"] == s for c in cases))
        rows, classes = [], []
        for c in cases:
            cells = case_row(c)
            rows.append([f'<span class="id">{_e(cells[0])}</span>', _status(cells[1]), *(_e(v) for v in cells[2:6]),
                         _bound(c), _e(cells[6]) + _traceback(c)])
            classes.append("bad" if c["status"] in ("fail", "error") else "")
        header = [*CASE_COLUMNS[:6], "bound", CASE_COLUMNS[6]]
        out.append(f"<details{' open' if bad else ''}><summary>{_e(suite)} — {len(cases)} case(s): {_e(counts)}</summary>"
                   + _table(header, rows, numeric={2, 3, 4, 5}, row_class=classes) + "</details>")
    return "".join(out)


def render(doc: dict[str, Any]) -> str:
    """The whole page for a results document."""
    body = "".join([_header(doc), _counts(doc), _failures(doc), _worst(doc), _plots(doc), _all_cases(doc)])
    footer = (f"<footer>hetero-hal {_e(doc.get('hal_version'))} · results schema {_e(doc.get('schema'))} · "
              "this page is self-contained: no scripts, no external files</footer>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>hal conformance: {_e(title(doc))} — {_e(str(doc.get('verdict')).upper())}</title>"
            f"<style>{CSS}</style></head><body><main>{body}{footer}</main></body></html>\n")
