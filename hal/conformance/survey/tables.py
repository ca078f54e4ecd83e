"""A survey's findings as a person reads them: a grade per op, rates, a table per op family, the gaps listed.

Grades per op, Torch-FL's way of counting (FlagOS, 2026): STRICT — every dtype surveyed passes; BASIC — float32
passes, another dtype does not; otherwise the op's worst outcome (FAILED, a wrong answer, before FALLBACK, RAISED,
UNTESTED). The strict rate is STRICT ops over the ops with at least one tested dtype; the basic rate counts BASIC
too. A pair that ran on the host (FALLBACK) is a gap, never a pass.
"""
from __future__ import annotations

import html
from collections import Counter, defaultdict
from typing import Any, Iterable

KIND = "survey"
SCHEMA = 1
STATUSES = ("pass", "failed", "raised", "fallback", "untested")
GRADES = ("STRICT", "BASIC", "FAILED", "FALLBACK", "RAISED", "UNTESTED")
_WORST = ("failed", "fallback", "raised", "untested")


def grade(statuses: dict[str, str]) -> str:
    """An op's grade from its {dtype: status}."""
    tested = {d: s for d, s in statuses.items() if s != "untested"}
    if not tested:
        return "UNTESTED"
    if all(s == "pass" for s in tested.values()):
        return "STRICT"
    if tested.get("float32") == "pass":
        return "BASIC"
    return next(w for w in _WORST if w in tested.values()).upper()


def grades(findings: Iterable[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """op -> (family, grade)."""
    per_op: dict[str, dict[str, str]] = defaultdict(dict)
    fam: dict[str, str] = {}
    for f in findings:
        per_op[f["op"]][f["dtype"]] = f["status"]
        fam[f["op"]] = f["family"]
    return {op: (fam[op], grade(s)) for op, s in per_op.items()}


def rates(graded: dict[str, tuple[str, str]]) -> dict[str, Any]:
    count = Counter(g for _, g in graded.values())
    tested = sum(n for g, n in count.items() if g != "UNTESTED")
    strict, basic = count.get("STRICT", 0), count.get("STRICT", 0) + count.get("BASIC", 0)
    return {"ops": len(graded), "tested_ops": tested, "grades": {g: count.get(g, 0) for g in GRADES},
            "strict_rate": strict / tested if tested else 0.0, "basic_rate": basic / tested if tested else 0.0}


def family_rows(graded: dict[str, tuple[str, str]]) -> list[list[Any]]:
    """[family, ops, STRICT, BASIC, FAILED, FALLBACK, RAISED, UNTESTED, strict %] per family, then the total."""
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for fam, g in graded.values():
        by[fam][g] += 1
    rows = []
    for fam in sorted(by, key=lambda f: (-sum(by[f].values()), f)):
        rows.append(_row(fam, by[fam]))
    rows.append(_row("all", Counter(g for _, g in graded.values())))
    return rows


def _row(name: str, c: Counter[str]) -> list[Any]:
    tested = sum(n for g, n in c.items() if g != "UNTESTED")
    pct = f"{100 * c.get('STRICT', 0) / tested:.1f}" if tested else "-"
    return [name, sum(c.values()), *(c.get(g, 0) for g in GRADES), pct]


def dtype_rows(findings: list[dict[str, Any]]) -> list[list[Any]]:
    """[dtype, pairs, pass, of which within the float64 golden tolerance, failed, raised, fallback, untested]."""
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for f in findings:
        by[f["dtype"]][f["status"]] += 1
        if f["status"] == "pass" and f.get("decided_by") == "golden":
            by[f["dtype"]]["golden"] += 1
    return [[d, sum(c[s] for s in STATUSES), c["pass"], c["golden"], *(c.get(s, 0) for s in STATUSES[1:])]
            for d, c in by.items()]


def gaps(findings: list[dict[str, Any]], statuses: tuple[str, ...] = ("failed", "fallback", "raised")) -> list[dict[str, Any]]:
    return [f for f in findings if f["status"] in statuses]


def _table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    rows = [[str(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


FAMILY_HEADER = ["family", "ops", *GRADES, "strict %"]
DTYPE_HEADER = ["dtype", "pairs", "pass", "of which golden", *STATUSES[1:]]


def header_lines(doc: dict[str, Any]) -> list[str]:
    r = doc["rates"]
    prov = doc.get("provenance", {})
    dev = prov.get("device", {})
    lines = [f"operator survey: backend {doc['backend']} on {dev.get('name', '?')}"
             + (f" ({doc['standin']})" if doc.get("standin") else ""),
             f"cohort {doc['cohort']['digest']}: {r['ops']} ops of torch {doc['cohort']['torch']}'s op_db, "
             f"{len(doc['findings'])} (op, dtype) pairs, dtypes {', '.join(doc['cohort']['dtypes'])}, "
             f"{doc['cohort']['settings']['max_samples']} samples a pair, backward "
             f"{'on' if doc['cohort']['settings']['backward'] else 'off'}",
             f"strict rate {100 * r['strict_rate']:.1f} % ({r['grades']['STRICT']} of {r['tested_ops']} tested ops), "
             f"basic rate {100 * r['basic_rate']:.1f} %; {doc['wall_s']:.0f} s with {doc['jobs']} job(s)"]
    for d, why in doc["cohort"].get("absent", {}).items():
        lines.append(f"not surveyed: {d} ({why})")
    return lines


def summary_text(doc: dict[str, Any], *, max_gaps: int = 30) -> str:
    graded = grades(doc["findings"])
    lines = header_lines(doc) + [""] + _table(FAMILY_HEADER, family_rows(graded)) + [""]
    lines += _table(DTYPE_HEADER, dtype_rows(doc["findings"])) + [""]
    wrong = gaps(doc["findings"])
    if wrong:
        lines.append(f"wrong answers, host fallbacks and raises ({len(wrong)}):")
        for f in wrong[:max_gaps]:
            lines.append(f"  {f['status'].upper():<8} {f['op']} {f['dtype']}: {f.get('detail', '')}")
        if len(wrong) > max_gaps:
            lines.append(f"  ... {len(wrong) - max_gaps} more in survey.md / results.json")
    return "\n".join(lines) + "\n"


def _md(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    esc = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(esc(x) for x in r) + " |" for r in rows]


def markdown(doc: dict[str, Any]) -> str:
    graded = grades(doc["findings"])
    out = ["# Operator survey", ""] + [f"- {line}" for line in header_lines(doc)]
    out += ["", f"- digest: `{doc.get('digest', '')}`", "", "## By family", ""] + _md(FAMILY_HEADER, family_rows(graded))
    out += ["", "## By dtype", ""] + _md(DTYPE_HEADER, dtype_rows(doc["findings"]))
    out += ["", "## Wrong answers, host fallbacks, raises", ""]
    rows = [[f["status"], f["op"], f["dtype"], f.get("detail", ""), f.get("sample", "")] for f in gaps(doc["findings"])]
    out += _md(["status", "op", "dtype", "what", "sample"], rows) if rows else ["none"]
    untested = Counter(f.get("detail", "").split(":")[0] for f in doc["findings"] if f["status"] == "untested")
    out += ["", "## Untested, by reason", ""] + _md(["reason", "pairs"], untested.most_common())
    out += ["", "## Every op", ""] + _md(["op", "family", "grade"], sorted([op, fam, g] for op, (fam, g) in graded.items()))
    return "\n".join(out) + "\n"


_COLORS = {"STRICT": "#1e8449", "BASIC": "#82c91e", "FAILED": "#c0392b", "FALLBACK": "#e67e22", "RAISED": "#f1c40f",
           "UNTESTED": "#bbb"}


def _bars(rows: list[list[Any]]) -> str:
    """A stacked bar per family (share of its ops per grade), inline SVG."""
    width, bar_h, label_w = 760, 16, 190
    body = []
    for i, row in enumerate(rows):
        name, total, counts = row[0], row[1], row[2:2 + len(GRADES)]
        y = 8 + i * (bar_h + 6)
        body.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end" font-size="12">{html.escape(str(name))}</text>')
        x = float(label_w)
        for g, n in zip(GRADES, counts):
            if n:
                w = (width - label_w - 60) * n / max(total, 1)
                body.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{_COLORS[g]}">'
                            f'<title>{g}: {n}</title></rect>')
                x += w
        body.append(f'<text x="{x + 4:.1f}" y="{y + 12}" font-size="11">{total}</text>')
    legend = "".join(f'<rect x="{label_w + 110 * j}" y="{8 + len(rows) * (bar_h + 6)}" width="10" height="10" fill="{_COLORS[g]}"/>'
                     f'<text x="{label_w + 14 + 110 * j}" y="{17 + len(rows) * (bar_h + 6)}" font-size="11">{g}</text>'
                     for j, g in enumerate(GRADES))
    height = 30 + len(rows) * (bar_h + 6)
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">{"".join(body)}{legend}</svg>'


def _html_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(doc: dict[str, Any]) -> str:
    from hal.conformance.reports.html_report import CSS

    graded = grades(doc["findings"])
    fam = family_rows(graded)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>operator survey: {html.escape(doc['backend'])}</title>"
             f"<style>{CSS}</style></head><body><main><h1>Operator survey: {html.escape(doc['backend'])}</h1>"]
    parts += [f"<p class='summary'>{html.escape(line)}</p>" for line in header_lines(doc)]
    parts.append(f"<p class='summary'>digest <code>{html.escape(doc.get('digest', ''))}</code> "
                 "(<code>hal conformance verify</code> recomputes it)</p>")
    parts += ["<h2>By family</h2>", _bars(fam[:-1]), _html_table(FAMILY_HEADER, fam)]
    parts += ["<h2>By dtype</h2>", _html_table(DTYPE_HEADER, dtype_rows(doc["findings"]))]
    rows = [[f["status"], f["op"], f["dtype"], f.get("detail", ""), f.get("sample", "")] for f in gaps(doc["findings"])]
    parts += ["<h2>Wrong answers, host fallbacks, raises</h2>",
              _html_table(["status", "op", "dtype", "what", "sample"], rows) if rows else "<p>none</p>"]
    parts += ["<h2>Provenance</h2>", _html_table(["key", "value"], _flat(doc.get("provenance", {})))]
    parts += ["<h2>Every op</h2>", _html_table(["op", "family", "grade"], sorted([op, f, g] for op, (f, g) in graded.items()))]
    parts.append("</main></body></html>")
    return "".join(parts)


def _flat(d: dict[str, Any], prefix: str = "") -> list[list[str]]:
    rows: list[list[str]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            rows += _flat(v, f"{prefix}{k}.")
        else:
            rows.append([f"{prefix}{k}", str(v)])
    return rows
