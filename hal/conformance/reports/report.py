"""The run's files: results.json (machine-readable, versioned; see ``results`` for the schema),
summary.md and report.html, and the terminal summary.

Every file is written to a temporary name in its directory and renamed into place, so a crash or a
Ctrl-C never leaves a half-written report.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from hal.conformance.reports.html_report import render
from hal.conformance.reports.provenance import seal

# The document's names stay importable from here (``report.load_results``, ``report.json_safe``, ...).
from hal.conformance.reports.results import (  # noqa: F401
    CASE_COLUMNS,
    ERROR_METRICS,
    KIND,
    SCHEMA_VERSION,
    STATUSES,
    as_float,
    by_suite,
    case_row,
    counts_rows,
    device_label,
    dumps,
    failing_metric,
    failures,
    fmt,
    headline,
    json_safe,
    load_results,
    metadata_rows,
    title,
    validate,
    verdict_line,
    verdict_profile_text,
    worst_by_tol_ratio,
)
from hal.errors import ConfigError
from hal.run_dirs import new_run_dir, write_text_atomic

REPORT_FILES: tuple[str, ...] = ("results.json", "summary.md", "report.html")


# --- terminal summary --------------------------------------------------------------------------------------


def _text_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    rows = list(rows)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), *(line(r) for r in rows)]


def summary_text(doc: dict[str, Any], *, max_failures: int = 40, worst: int = 10) -> str:
    """What ``hal conformance run`` prints at the end: counts per suite, failures, worst tol_ratio."""
    out = [f"conformance: {title(doc)}", f"  hardware verification: {doc.get('verification')}",
           f"  torch {doc.get('torch')}, python {doc.get('python')}, host {doc.get('host')}, started {doc.get('started')}",
           f"  verdict profile: {verdict_profile_text(doc)}", ""]
    out += _text_table(["suite", *STATUSES, "total", "seconds"],
                       ([s, *(str(c.get(k, 0)) for k in STATUSES), str(c.get("total", 0)), fmt(c.get("seconds"))]
                        for s, c in counts_rows(doc)))
    bad = failures(doc)
    if bad:
        out += ["", f"failing cases ({len(bad)}):"]
        for c in bad[:max_failures]:
            metric, value, bound = failing_metric(c)
            measure = "" if metric == "error" else f" {metric} {value} (bound {bound})"
            out.append(f"  {c['status']:<5} {c['id']}{measure}: {c.get('reason') or ''}")
        if len(bad) > max_failures:
            out.append(f"  ... and {len(bad) - max_failures} more (see summary.md)")
    ranked = worst_by_tol_ratio(doc, worst)
    if ranked:
        out += ["", f"worst cases by tol_ratio (error / bound; > 1 fails), top {len(ranked)}:"]
        out += [f"  {fmt(v):>8}  {c['status']:<5} {c['id']}" for v, c in ranked]
    out += ["", f"verdict: {verdict_line(doc)}"]
    return "\n".join(out) + "\n"


# --- summary.md ------------------------------------------------------------------------------------------


def _md_cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_md_cell(v) for v in r) + " |" for r in rows]
    return out


def markdown(doc: dict[str, Any]) -> str:
    """summary.md: metadata, counts per suite, every failure, worst tol_ratio, every case per suite."""
    out = [f"# Conformance: {title(doc)} — {'PASS' if doc.get('verdict') == 'pass' else 'FAIL'}", ""]
    out += _md_table(["", ""], metadata_rows(doc)) + [""]
    out += [f"**Verdict:** {verdict_line(doc)}", "", "## Cases per suite", ""]
    out += _md_table(["suite", *STATUSES, "total", "seconds"],
                     ([f"**{s}**" if s == "total" else s, *(c.get(k, 0) for k in STATUSES), c.get("total", 0),
                       fmt(c.get("seconds"))] for s, c in counts_rows(doc)))
    bad = failures(doc)
    out += ["", f"## Failures ({len(bad)})", ""]
    if bad:
        out += _md_table(["case", "status", "metric", "value", "bound", "reason"],
                         ([c["id"], c["status"], *failing_metric(c), c.get("reason") or ""] for c in bad))
    else:
        out.append("None.")
    ranked = worst_by_tol_ratio(doc)
    if ranked:
        out += ["", "## Worst cases by tol_ratio", "", "tol_ratio = max error / bound; above 1 fails.", ""]
        out += _md_table(["tol_ratio", "status", "case"], ([fmt(v), c["status"], c["id"]] for v, c in ranked))
    out += ["", "## All cases", ""]
    for suite, cases in by_suite(doc).items():
        out += [f"### {suite} ({len(cases)})", ""]
        out += _md_table(CASE_COLUMNS, (case_row(c) for c in cases)) + [""]
    return "\n".join(out).rstrip() + "\n"


# --- files ----------------------------------------------------------------------------------------------------


def default_report_dir(backend: str) -> Path:
    """``runs/conformance-<backend>-<date-time>``, with a suffix if that exists already."""
    return new_run_dir(f"conformance-{backend}")


def check_report_dir(path: str | os.PathLike[str], *, refuse_existing: Sequence[str] = ()) -> Path:
    """Create ``path`` if needed and prove it writable — before the run, so no run's work is lost. A file
    named in ``refuse_existing`` already there is an earlier report: refused, never silently replaced."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--report {path}: exists and is not a directory; give a directory")
    earlier = [name for name in refuse_existing if (directory / name).exists()]
    if earlier:
        raise ConfigError(f"--report {path}: already holds a report ({', '.join(earlier)}); give a new directory, "
                          "or add --overwrite to replace it")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"--report {path}: cannot write there ({exc.strerror or exc}); give a writable directory") from None
    return directory


def write_reports(doc: dict[str, Any], directory: str | os.PathLike[str]) -> list[Path]:
    """results.json, summary.md and report.html in ``directory``; everything is rendered before any file is written."""
    directory = check_report_dir(directory)
    doc = doc if "digest" in doc else seal(json_safe(doc))  # bound to its content: ``hal conformance verify``
    return write_files(directory, {"results.json": dumps(doc), "summary.md": markdown(doc), "report.html": render(doc)})


def write_files(directory: str | os.PathLike[str], texts: dict[str, str]) -> list[Path]:
    """Each text whole or not at all (``write_text_atomic``), in the order given; their paths. Every report kind (run,
    survey, parity) renders all of its texts first, then writes them here."""
    paths = []
    for name, text in texts.items():
        write_text_atomic(Path(directory) / name, text)
        paths.append(Path(directory) / name)
    return paths
