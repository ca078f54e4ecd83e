"""Run from the repository root (as every README command and ``python3 -m pytest`` are), Python puts the root first
on ``sys.path``: a folder of ours that is a regular package there answers any library importing that name.
transformers >= 5.25 imports Hugging Face's ``kernels``, and our old top-level ``kernels/`` answered it. Every
component now lives under ``hal/``, so no top-level name but ``hal`` (and ``tests``, the suite's own package,
which no library imports) runs code of this repository. Each check also runs on a planted violation."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OWN_NAMES = {"hal", "tests"}  # ours by design: the namespace, and the suite's package (not installed)

_PROBE = r"""
import importlib.util, json, sys
root, names = sys.argv[1], json.loads(sys.argv[2])
found = {}
for name in names:
    spec = importlib.util.find_spec(name)  # what `import name` would load, without running it
    origin = spec.origin if spec is not None and spec.has_location else None
    if origin and origin.startswith(root + "/"):
        found[name] = origin  # a regular package or a module of ours; a namespace portion has no code to run
print(json.dumps(found))
"""


def folder_names(root: Path) -> list[str]:
    """Every folder name that installs under hal.* (hal/backends, hal/parallel/loop, ...) and every entry at the
    repository root: each is a top-level name some distribution could also use."""
    under_hal = {p.name for p in (root / "hal").rglob("*") if p.is_dir() and p.name != "__pycache__"}
    at_root = {p.stem for p in root.iterdir() if p.is_dir() or p.suffix == ".py"}
    return sorted(n for n in (under_hal | at_root) - OWN_NAMES if n.isidentifier())


def names_running_repo_code(root: Path, names: list[str]) -> dict[str, str]:
    """name -> the file of ``root`` that ``import name`` would run, asked from ``root`` as ``python3 -c`` runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(root), json.dumps(names)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_no_top_level_import_from_the_root_runs_our_code() -> None:
    names = folder_names(REPO)
    assert {"backends", "kernels", "parallel", "collectives", "conformance", "cli", "launch", "loop", "benchmarks"} <= set(names)
    assert names_running_repo_code(REPO, names) == {}


def test_the_check_catches_a_folder_that_is_a_package_at_the_root(tmp_path: Path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("VERSION = 'ours'\n")
    (tmp_path / "benchmarks").mkdir()  # a plain folder of scripts: a namespace portion at most, no code runs
    (tmp_path / "benchmarks" / "bench.py").write_text("raise SystemExit('ran')\n")
    (tmp_path / "setup.py").write_text("X = 1\n")
    (tmp_path / "hal" / "kernels").mkdir(parents=True)
    assert folder_names(tmp_path) == ["benchmarks", "kernels", "setup"]
    found = names_running_repo_code(tmp_path, folder_names(tmp_path))
    assert found == {"kernels": str(tmp_path / "kernels" / "__init__.py"), "setup": str(tmp_path / "setup.py")}


def _installed(distribution: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_import_kernels_from_the_root_is_hugging_faces() -> None:
    """transformers >= 5.25 depends on and imports Hugging Face's ``kernels``; from the root it must be theirs."""
    kernels = _installed("kernels")
    if kernels is None:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25 does not bring it)")
    out = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    where = Path(out.stdout.strip()).resolve()
    assert where == Path(kernels.locate_file("kernels/__init__.py")).resolve(), where
