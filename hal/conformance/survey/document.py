"""One survey as a document: assembled from the cohort and findings, sealed, written, read back and checked."""
from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch

from hal.conformance.reports.provenance import provenance, seal
from hal.conformance.reports.results import dumps, json_safe
from hal.errors import HalError

from . import tables
from .cohort import Cohort

FILES = ("results.json", "summary.md", "report.html")


def assemble(backend: Any, cohort: Cohort, findings: list[dict[str, Any]], *, jobs: int, wall_s: float,
             started: datetime.datetime) -> dict[str, Any]:
    graded = tables.grades(findings)
    fell_back = sum(1 for f in findings if f["status"] == "fallback")
    doc = {
        "schema": tables.SCHEMA, "kind": tables.KIND,
        "backend": backend.name, "device": str(backend.device(0)), "standin": backend.standin,
        "verification": backend.verification,
        "started": started.isoformat(timespec="seconds"), "wall_s": round(wall_s, 1), "jobs": jobs,
        "cohort": {"digest": cohort.digest, "torch": torch.__version__.split("+")[0], "dtypes": list(cohort.dtypes),
                   "absent": cohort.absent, "settings": dict(cohort.settings.__dict__), "ops": len(cohort.ops()),
                   "pairs": len(cohort.pairs)},
        "rates": tables.rates(graded),
        "findings": findings,
        "provenance": provenance(backend, fell_back=fell_back),
    }
    return seal(json_safe(doc))


def write(doc: dict[str, Any], directory: Path) -> list[Path]:
    from hal.conformance.reports.report import write_files

    return write_files(directory, {"results.json": dumps(doc), "summary.md": tables.markdown(doc), "report.html": tables.render_html(doc)})


def check(doc: Any, origin: str | os.PathLike[str]) -> dict[str, Any]:
    """``doc`` if it is a survey this version reads, else a HalError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("kind") != tables.KIND:
        raise HalError(f"{origin}: not an operator survey (its kind is {doc.get('kind') if isinstance(doc, dict) else None!r}); "
                       "give the results.json of `hal conformance survey`")
    if doc.get("schema") != tables.SCHEMA:
        raise HalError(f"{origin}: survey schema {doc.get('schema')!r}, this hal reads {tables.SCHEMA}; rerun the survey")
    findings = doc.get("findings")
    if not isinstance(findings, list) or not all(isinstance(f, dict) and {"op", "dtype", "status", "family"} <= f.keys()
                                                 and f["status"] in tables.STATUSES for f in findings):
        raise HalError(f"{origin}: its findings are not a list of (op, dtype, status, family) entries; rerun the survey")
    for key in ("cohort", "backend", "rates"):
        if key not in doc:
            raise HalError(f"{origin}: has no {key!r}; rerun the survey")
    return doc
