"""The run's files: results.json (machine-readable, versioned), summary.md, and the terminal summary.

results.json (``"kind": "hal-conformance-run"``, ``"schema": 1``) holds the metadata (backend,
backend_reason, device {type, index, name}, verification, verified_on_hardware, capabilities, torch,
python, hal_version, host, platform, started, wall_seconds, seed, max_world_size, suites, patterns,
collected), ``verdict`` (pass | fail), ``counts`` ({by_suite: {suite: {pass, fail, error, skip,
unsupported, total, seconds}}, total: {...}}) and ``cases``: one object per case with id, suite, name,
description, tags, status, metrics, tolerance, failed_metric, reason, data, seconds and, for errors,
traceback. JSON has no inf/NaN: non-finite numbers are the strings "inf", "-inf" and "nan"
(``as_float`` reads them back). Readers must ignore keys they do not know; a change that breaks
readers bumps ``schema``.

Every file is written to a temporary name in its directory and renamed into place, so a crash or a
Ctrl-C never leaves a half-written report.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable

import torch

from hal.errors import ConfigError
from hal.run_dirs import new_run_dir

KIND = "hal-conformance-run"
SCHEMA_VERSION = 1
STATUSES: tuple[str, ...] = ("pass", "fail", "error", "skip", "unsupported")
ERROR_METRICS: tuple[str, ...] = ("tol_ratio", "rel_l2", "max_rel", "max_abs", "ulp")  # headline order
REPORT_FILES: tuple[str, ...] = ("results.json", "summary.md", "report.html")


# --- JSON ------------------------------------------------------------------------------------------------


def json_safe(obj: Any) -> Any:
    """Plain JSON values: non-finite floats as strings, tensors/arrays as numbers or lists, dtypes as names."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if isinstance(obj, torch.Tensor):
        return json_safe(obj.detach().cpu().item() if obj.numel() == 1 and obj.dim() == 0 else obj.detach().cpu().tolist())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return json_safe(dataclasses.asdict(obj))
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return json_safe(obj.tolist())
    return str(obj)


def as_float(value: Any) -> float | None:
    """A number from results.json (including "inf"/"-inf"/"nan"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return None


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(json_safe(doc), indent=2, allow_nan=False) + "\n"


def validate(doc: Any, origin: str) -> dict[str, Any]:
    """``doc`` if it is a results document this code reads; a one-line ConfigError otherwise."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise ConfigError(f"{origin}: not a hal conformance results file (no \"kind\": \"{KIND}\"); "
                          "give the results.json of 'hal conformance run'")
    schema = doc.get("schema")
    if not isinstance(schema, int) or schema < 1 or schema > SCHEMA_VERSION:
        raise ConfigError(f"{origin}: results schema {schema!r} is not one this hal reads (1..{SCHEMA_VERSION}); "
                          "upgrade hetero-hal")
    cases = doc.get("cases")
    if not isinstance(cases, list) or any(not isinstance(c, dict) or not isinstance(c.get("id"), str)
                                          or c.get("status") not in STATUSES for c in cases):
        raise ConfigError(f"{origin}: \"cases\" must be a list of objects with an id and a status; the file is damaged")
    return doc


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a results.json; unreadable or invalid files raise a one-line ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; give the results.json of 'hal conformance run'") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); give the results.json of "
                          "'hal conformance run'") from None
    return validate(doc, str(path))


# --- reading cases -------------------------------------------------------------------------------------------


def headline(case: dict[str, Any]) -> tuple[str, float] | None:
    """The case's error metric that reports and compare use: tol_ratio, else rel_l2, max_rel, max_abs, ulp."""
    metrics = case.get("metrics") or {}
    for name in ERROR_METRICS:
        value = as_float(metrics.get(name))
        if value is not None:
            return name, value
    return None


def fmt(value: Any) -> str:
    """A number for a table: 3 significant digits; non-numbers as text; missing as an em dash."""
    number = as_float(value)
    if number is None:
        return "—" if value is None else str(value)
    if math.isnan(number) or math.isinf(number):
        return str(number)
    if number == int(number) and abs(number) < 1e6:
        return str(int(number))
    return f"{number:.3g}"


def failing_metric(case: dict[str, Any]) -> tuple[str, str, str]:
    """(metric, value, bound) for a failing case's table row."""
    metric = case.get("failed_metric")
    if case["status"] == "error":
        return "error", "—", "—"
    if metric:
        bound = "1" if metric == "tol_ratio" else fmt((case.get("tolerance") or {}).get(metric))
        return metric, fmt((case.get("metrics") or {}).get(metric)), bound
    head = headline(case)
    return (head[0], fmt(head[1]), "—") if head else ("—", "—", "—")


def failures(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["cases"] if c["status"] in ("fail", "error")]


def worst_by_tol_ratio(doc: dict[str, Any], n: int = 10) -> list[tuple[float, dict[str, Any]]]:
    rows = [(as_float((c.get("metrics") or {}).get("tol_ratio")), c) for c in doc["cases"]]
    ranked = [(v, c) for v, c in rows if v is not None and not math.isnan(v)]
    ranked.sort(key=lambda vc: vc[0], reverse=True)
    return ranked[:n]


def counts_rows(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    counts = doc.get("counts") or {}
    return [*((s, c) for s, c in (counts.get("by_suite") or {}).items()), ("total", counts.get("total") or {})]


def device_label(doc: dict[str, Any]) -> str:
    device = doc.get("device") or {}
    index = device.get("index")
    return f"{device.get('name')} ({device.get('type')}{'' if index is None else f':{index}'})"


def title(doc: dict[str, Any]) -> str:
    return f"{doc.get('backend')} on {device_label(doc)}"


def verdict_line(doc: dict[str, Any]) -> str:
    total = (doc.get("counts") or {}).get("total") or {}
    word = "PASS" if doc.get("verdict") == "pass" else "FAIL"
    return (f"{word}: {total.get('fail', 0)} failed, {total.get('error', 0)} errors, {total.get('pass', 0)} passed, "
            f"{total.get('skip', 0)} skipped, {total.get('unsupported', 0)} unsupported of {total.get('total', 0)} "
            f"case(s) in {fmt(doc.get('wall_seconds'))} s")


# --- terminal summary --------------------------------------------------------------------------------------


def _text_table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    rows = list(rows)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), *(line(r) for r in rows)]


def summary_text(doc: dict[str, Any], *, max_failures: int = 40, worst: int = 10) -> str:
    """What ``hal conformance run`` prints at the end: counts per suite, failures, worst tol_ratio."""
    out = [f"conformance: {title(doc)}", f"  hardware verification: {doc.get('verification')}",
           f"  torch {doc.get('torch')}, python {doc.get('python')}, host {doc.get('host')}, started {doc.get('started')}", ""]
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


def metadata_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The header facts every report shows, in order."""
    selection = ", ".join(doc.get("suites") or []) + (f"; -k {','.join(doc['patterns'])}" if doc.get("patterns") else "")
    return [
        ("backend", f"{doc.get('backend')} ({doc.get('backend_reason') or 'requested'})"),
        ("device", device_label(doc)),
        ("hardware verification", str(doc.get("verification"))),
        ("torch / python", f"{doc.get('torch')} / {doc.get('python')}"),
        ("hetero-hal", str(doc.get("hal_version"))),
        ("host", f"{doc.get('host')} ({doc.get('platform')})"),
        ("started", str(doc.get("started"))),
        ("wall time", f"{fmt(doc.get('wall_seconds'))} s"),
        ("seed / world size", f"{doc.get('seed')} / {doc.get('max_world_size')}"),
        ("selection", f"{selection} ({len(doc.get('cases') or [])} of {doc.get('collected')} case(s) run)"),
    ]


def case_row(c: dict[str, Any]) -> list[str]:
    """case, status, tol_ratio, max_abs, rel_l2, seconds, reason — the all-cases tables' columns."""
    m = c.get("metrics") or {}
    return [c["name"], c["status"], fmt(m.get("tol_ratio")), fmt(m.get("max_abs")), fmt(m.get("rel_l2")),
            fmt(c.get("seconds")), c.get("reason") or ""]


CASE_COLUMNS = ["case", "status", "tol_ratio", "max_abs", "rel_l2", "seconds", "reason"]


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


def by_suite(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {s: [] for s in (doc.get("counts") or {}).get("by_suite") or {}}
    for c in doc["cases"]:
        groups.setdefault(c.get("suite", "?"), []).append(c)
    return {s: cs for s, cs in groups.items() if cs}


# --- files ----------------------------------------------------------------------------------------------------


def default_report_dir(backend: str) -> Path:
    """``runs/conformance-<backend>-<date-time>``, with a suffix if that exists already."""
    return new_run_dir(f"conformance-{backend}")


def check_report_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and prove it writable — before the run, so no run's work is lost."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--report {path}: exists and is not a directory; give a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"--report {path}: cannot write there ({exc.strerror or exc}); give a writable directory") from None
    return directory


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # "x": created here, umask honoured
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_reports(doc: dict[str, Any], directory: str | os.PathLike[str]) -> list[Path]:
    """results.json, summary.md and report.html in ``directory``; everything is rendered before any file is written."""
    from .html_report import render

    directory = check_report_dir(directory)
    texts = {"results.json": dumps(doc), "summary.md": markdown(doc), "report.html": render(doc)}
    paths = []
    for name in REPORT_FILES:
        atomic_write(directory / name, texts[name])
        paths.append(directory / name)
    return paths
