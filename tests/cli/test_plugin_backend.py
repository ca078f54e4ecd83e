"""A third-party vendor adds a backend through the ``hal.backends`` entry-point group.

The test builds and installs a real throwaway distribution (pip, into a temporary folder) and
runs the real ``hal`` command against it — no change to this repository.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import run_hal

PLUGIN = textwrap.dedent(
    '''
    """A pretend vendor: runs on the host CPU but is a separate, third-party backend."""
    from hal.backend import Availability
    from hal.backends.cpu import CpuBackend


    class AcmeBackend(CpuBackend):
        name = "acme"
        vendor = "Acme Accelerators"
        hardware_verification = None

        def availability(self):
            return Availability(True, "acme simulator on the host CPU")


    class BrokenBackend(CpuBackend):
        name = "broken"

        def __init__(self):
            raise RuntimeError("acme driver 0.0 is too old")
    '''
)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("acme_src")
    (src / "acme_hal").mkdir()
    (src / "acme_hal" / "__init__.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(textwrap.dedent(
        """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "acme-hal"
        version = "0.1"

        [project.entry-points."hal.backends"]
        acme = "acme_hal:AcmeBackend"
        broken = "acme_hal:BrokenBackend"
        cuda = "acme_hal:AcmeBackend"
        """
    ))
    site = tmp_path_factory.mktemp("acme_site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0:
        pytest.fail(f"could not build the throwaway plug-in distribution: {result.stderr[-2000:]}")
    return site


def _env(site: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])])}


def test_plugin_backend_is_listed_and_selectable(plugin_site: Path) -> None:
    result = run_hal("devices", "--json", env=_env(plugin_site))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    acme = next(b for b in report["backends"] if b["name"] == "acme")
    assert acme["available"] and acme["vendor"] == "Acme Accelerators"
    assert acme["verification"] == "not verified on hardware"
    problems = {p["name"]: p["reason"] for p in report["load_problems"]}
    assert "acme driver 0.0 is too old" in problems["broken"]
    assert "built-in backend name" in problems["cuda"]
    chosen = run_hal("config", "--backend", "acme", "--json", env=_env(plugin_site))
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout)["backend"] == "acme"


def test_plugin_backend_absent_without_its_distribution() -> None:
    result = run_hal("config", "--backend", "acme")
    assert result.returncode == 2 and "'acme' is not allowed" in result.stderr
