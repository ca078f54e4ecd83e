"""What a conformance result was produced by, and a digest that binds the result to it.

Every ``results.json`` (``hal conformance run``, ``survey``, ``parity``) carries ``provenance``: the project's
revision (and whether the working tree had changes), torch / Triton / Python versions, the backend's runtime
versions (CUDA and its driver, torch_npu and CANN, ...), the device's name, count and identity, whether it was a
host-backed stand-in, and how many cases ran on the host instead of the device. ``digest`` is the SHA-256 of the
whole document without it (canonical JSON), shown in report.html; ``hal conformance verify`` recomputes it. It
detects an edited file, not a forger who recomputes it: it is a checksum, not a signature.
"""
from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

DIGEST_KEY = "digest"


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def revision() -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it; else the installed distribution's version."""
    root = Path(__file__).resolve().parents[3]
    out: dict[str, Any] = {}
    try:
        out["hal_version"] = metadata.version("hetero-hal")
    except metadata.PackageNotFoundError:
        out["hal_version"] = None
    if (root / ".git").exists():
        commit = _git(["rev-parse", "HEAD"], root)
        status = _git(["status", "--porcelain", "--untracked-files=no"], root)
        if commit:
            out["commit"] = commit
            out["dirty"] = bool(status)
    return out


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def provenance(backend: Any, *, fell_back: int = 0) -> dict[str, Any]:
    """The ``provenance`` block for a result produced on ``backend`` (device 0), ``fell_back`` cases on the host."""
    count = backend.device_count()
    device = {"name": backend.device_name(0), "count": count}
    try:
        device["uuid"] = backend.device_uuid(0)
    except Exception:  # noqa: BLE001 - the identity is extra; its absence is recorded as None
        device["uuid"] = None
    try:
        runtime = backend.runtime_versions()
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal: the report still says what it could not read
        runtime = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return {
        "revision": revision(),
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "python": platform.python_version()},
        "runtime": runtime,
        "device": device,
        "standin": backend.standin,
        "host_fallbacks": fell_back,
    }


def canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def digest(doc: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(doc)).hexdigest()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its digest (the last key)."""
    sealed = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    sealed[DIGEST_KEY] = digest(sealed)
    return sealed
