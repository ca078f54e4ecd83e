"""The results document (results.json) and the ways every report reads it.

results.json (``"kind": "hal-conformance-run"``, ``"schema": 1``) holds the metadata (backend,
backend_reason, device {type, index, name}, verification, verified_on_hardware, standin (the stand-in's note, or
null), capabilities, torch,
python, hal_version, host, platform, started, wall_seconds, seed, max_world_size, suites, patterns,
collected), ``verdict`` (pass | fail), ``counts`` ({by_suite: {suite: {pass, fail, error, skip,
unsupported, total, seconds}}, total: {...}}) and ``cases``: one object per case with id, suite, name,
description, tags, status, metrics, tolerance, failed_metric, reason, data, seconds and, for errors,
traceback. JSON has no inf/NaN: non-finite numbers are the strings "inf", "-inf" and "nan"
(``as_float`` reads them back). Readers must ignore keys they do not know; a change that breaks
readers bumps ``schema``.

Every view reads the document through this module, so the imports run one way: ``report`` (text,
markdown, files) → ``html_report`` → ``plots`` → ``results``, and ``compare`` → ``report``, ``results``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from hal.errors import ConfigError

KIND = "hal-conformance-run"
SCHEMA_VERSION = 1
STATUSES: tuple[str, ...] = ("pass", "fail", "error", "skip", "unsupported")
ERROR_METRICS: tuple[str, ...] = ("tol_ratio", "rel_l2", "max_rel", "max_abs", "ulp")  # headline order
# A run of every suite writes about 2 MiB; parsed, a document takes ~8x its size in memory. A results file above this is
# not one hal wrote, and reading it whole would hold its memory hostage.
MAX_RESULTS_BYTES = 32 << 20


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


_LARGEST_FLOAT = int(sys.float_info.max)  # a JSON integer above this has no float


def as_float(value: Any) -> float | None:
    """A number from results.json (including "inf"/"-inf"/"nan"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int):
        return float(value) if abs(value) <= _LARGEST_FLOAT else None
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
    _check_metadata(doc, origin)
    cases = doc.get("cases")
    if not isinstance(cases, list) or any(not isinstance(c, dict) or not isinstance(c.get("id"), str)
                                          or c.get("status") not in STATUSES for c in cases):
        raise ConfigError(f"{origin}: \"cases\" must be a list of objects with an id and a status; the file is damaged")
    seen: set[str] = set()
    for case in cases:
        if case["id"] in seen:  # compare and the reports key cases by id: a second one would silently replace the first
            raise ConfigError(f"{origin}: case {case['id']!r} appears twice; the file is damaged")
        seen.add(case["id"])
        for field in ("metrics", "tolerance"):
            for name, value in (case.get(field) or {}).items() if isinstance(case.get(field), dict) else ():
                _check_number(value, f"{origin}: case {case['id']!r}: {field}.{name}")
        metrics = case.get("metrics")
        if metrics is None:
            continue
        if not isinstance(metrics, dict):
            raise ConfigError(f"{origin}: case {case['id']!r}: \"metrics\" is not an object; the file is damaged")
        for name in ERROR_METRICS:
            value = metrics.get(name)
            number = as_float(value)
            if value is not None and (number is None or number < 0):  # an error is a number >= 0 (inf and nan kept)
                raise ConfigError(f"{origin}: case {case['id']!r}: {name} = {value!r} is not an error (a number >= 0); "
                                  "the file is damaged")
    return doc


def _check_number(value: Any, where: str) -> None:
    """A whole number a float cannot hold (JSON allows 400 digits) is not a measurement: one line."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _LARGEST_FLOAT:
        raise ConfigError(f"{where} is a {len(str(abs(value)))}-digit integer, beyond any float; the file is damaged")


def _check_metadata(doc: dict[str, Any], origin: str) -> None:
    """The run's fields every report reads — device, counts, wall_seconds — have the shapes hal writes: one line each."""
    device = doc.get("device")
    if device is not None:
        index = device.get("index") if isinstance(device, dict) else None
        if not (isinstance(device, dict) and all(isinstance(device.get(k), (str, type(None))) for k in ("type", "name"))
                and (index is None or (isinstance(index, int) and not isinstance(index, bool)))):
            raise ConfigError(f"{origin}: \"device\" = {str(device)[:60]!r} is not an object {{type, index, name}}; "
                              "the file is damaged")
    counts = doc.get("counts")
    by_suite = counts.get("by_suite") or {} if isinstance(counts, dict) else {}
    rows = [counts.get("total"), *by_suite.values()] if isinstance(counts, dict) and isinstance(by_suite, dict) else []
    if counts is not None and not (rows and all(isinstance(r, (dict, type(None))) for r in rows)):
        raise ConfigError(f"{origin}: \"counts\" is not {{by_suite: {{suite: counts}}, total: counts}}; the file is damaged")
    for row in rows:
        for name, value in (row or {}).items():
            _check_number(value, f"{origin}: counts {name}")
    for key in ("wall_seconds", "seed", "max_world_size"):
        _check_number(doc.get(key), f"{origin}: {key}")


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a results.json of 'hal conformance run'; unreadable, oversized or invalid files raise a one-line
    ConfigError. Memory is bounded by ``MAX_RESULTS_BYTES`` whatever the file."""
    return validate(read_document(path), str(path))


def read_document(path: str | os.PathLike[str], what: str = "the results.json of 'hal conformance run'") -> Any:
    """The JSON in ``path``, read within ``MAX_RESULTS_BYTES``; a one-line ConfigError ending "give WHAT" otherwise."""
    if Path(path).exists() and not Path(path).is_file():  # a FIFO would block the read forever, a directory fails
        raise ConfigError(f"{path}: not a regular file (a directory, pipe or device); give {what}")
    try:
        size = Path(path).stat().st_size
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if size > MAX_RESULTS_BYTES:
        raise ConfigError(f"{path}: {size / 2**20:.0f} MiB is above the {MAX_RESULTS_BYTES >> 20} MiB a results file "
                          f"holds (a run of every suite writes about 2 MiB); give {what}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; give {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); give {what}") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to be a results file; give {what}") from None
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise ConfigError(f"{path}: not a results file ({str(exc).splitlines()[0][:120]}); give {what}") from None


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
    standin = f" — {doc['standin']}" if doc.get("standin") else ""
    return f"{doc.get('backend')} on {device_label(doc)}{standin}"


def verdict_line(doc: dict[str, Any]) -> str:
    total = (doc.get("counts") or {}).get("total") or {}
    word = "PASS" if doc.get("verdict") == "pass" else "FAIL"
    return (f"{word}: {total.get('fail', 0)} failed, {total.get('error', 0)} errors, {total.get('pass', 0)} passed, "
            f"{total.get('skip', 0)} skipped, {total.get('unsupported', 0)} unsupported of {total.get('total', 0)} "
            f"case(s) in {fmt(doc.get('wall_seconds'))} s")


def verdict_profile_text(doc: dict[str, Any]) -> str:
    """The rule the cases were judged by, and where our default table is looser than it (reports from before
    profiles existed: hal)."""
    profile = doc.get("verdict_profile") or "hal"
    looser = doc.get("verdict_profile_looser") or []
    return profile + (f" (where our default is looser: {'; '.join(looser)})" if looser else "")


def metadata_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The header facts every report shows, in order."""
    selection = ", ".join(doc.get("suites") or []) + (f"; -k {','.join(doc['patterns'])}" if doc.get("patterns") else "")
    return [
        ("backend", f"{doc.get('backend')} ({doc.get('backend_reason') or 'requested'})"),
        ("device", device_label(doc)),
        ("hardware verification", str(doc.get("verification"))),
        *([("stand-in", str(doc["standin"]))] if doc.get("standin") else []),
        ("torch / python", f"{doc.get('torch')} / {doc.get('python')}"),
        ("hetero-hal", str(doc.get("hal_version"))),
        ("host", f"{doc.get('host')} ({doc.get('platform')})"),
        ("started", str(doc.get("started"))),
        ("wall time", f"{fmt(doc.get('wall_seconds'))} s"),
        ("seed / world size", f"{doc.get('seed')} / {doc.get('max_world_size')}"),
        ("verdict profile", verdict_profile_text(doc)),
        ("selection", f"{selection} ({len(doc.get('cases') or [])} of {doc.get('collected')} case(s) run)"),
        *provenance_rows(doc),
    ]


def provenance_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """What the run was bound to (``reports/provenance.py``): revision, runtime versions, device identity, host
    fallbacks, and the digest ``hal conformance verify`` recomputes. Empty for runs written before 2026-12-08."""
    prov = doc.get("provenance")
    if not isinstance(prov, dict):
        return []
    rev = prov.get("revision") or {}
    dirty = " (with uncommitted changes)" if rev.get("dirty") else ""
    commit = f"{str(rev.get('commit'))[:12]}{dirty}" if rev.get("commit") else "not a git checkout"
    device = prov.get("device") or {}
    runtime = ", ".join(f"{k} {v}" for k, v in (prov.get("runtime") or {}).items()) or "none beside torch"
    versions = prov.get("versions") or {}
    return [("revision", f"{commit}; hetero-hal {rev.get('hal_version')}"),
            ("runtime", f"{runtime}; triton {versions.get('triton')}"),
            ("device identity", f"{device.get('count')} x {device.get('name')}; uuid {device.get('uuid')}"),
            ("host fallbacks", f"{prov.get('host_fallbacks')} case(s) the runtime said ran on the CPU"),
            ("digest", str(doc.get("digest", "not recorded")))]


def case_row(c: dict[str, Any]) -> list[str]:
    """case, status, tol_ratio, max_abs, rel_l2, seconds, reason — the all-cases tables' columns."""
    m = c.get("metrics") or {}
    return [c["name"], c["status"], fmt(m.get("tol_ratio")), fmt(m.get("max_abs")), fmt(m.get("rel_l2")),
            fmt(c.get("seconds")), c.get("reason") or ""]


CASE_COLUMNS = ["case", "status", "tol_ratio", "max_abs", "rel_l2", "seconds", "reason"]


def by_suite(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {s: [] for s in (doc.get("counts") or {}).get("by_suite") or {}}
    for c in doc["cases"]:
        groups.setdefault(c.get("suite", "?"), []).append(c)
    return {s: cs for s, cs in groups.items() if cs}
