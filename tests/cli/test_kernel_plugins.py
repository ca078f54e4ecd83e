"""Kernel modules arrive through the ``hal.kernels`` entry points; one that fails is reported by name.

The loader is exercised twice: in process with crafted entry points, and end to end with a throwaway
distribution (a ``.dist-info`` folder on PYTHONPATH) seen by the real ``hal ops`` command.
"""
from __future__ import annotations

import os
import textwrap
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch

from hal.ops.registry import KERNEL_ENTRY_POINT_GROUP, KernelLoadWarning, OpRegistry, kernel_entry_points

from ..conftest import REPO, run_hal

GOOD = textwrap.dedent(
    '''
    import torch

    CALLS = []


    def register(registry):
        CALLS.append(registry)
        registry.register("double", "fast_double", backends=["cpu"], dtypes=[torch.float32], source="test kernel")(
            lambda x: x + x
        )


    def explode(registry):
        raise RuntimeError("kernel toolchain 0.0 is too old")
    '''
)


def _point(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group=KERNEL_ENTRY_POINT_GROUP)


@pytest.fixture
def good_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "hal_test_kernels_good.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hal_test_kernels_good"


def test_every_kernel_module_is_declared_in_the_entry_points() -> None:
    declared = {ep.value for ep in kernel_entry_points()}
    modules = sorted(p.stem for p in (REPO / "hal" / "kernels").glob("*.py") if p.stem != "__init__")
    assert modules, "hal/kernels/ holds no kernel module"
    for stem in modules:
        assert f"hal.kernels.{stem}:register" in declared, f"hal/kernels/{stem}.py has no hal.kernels entry point"


def test_a_failing_kernel_module_is_reported_by_name_and_the_others_still_load(good_module: str) -> None:
    points = [
        _point("good", f"{good_module}:register"),
        _point("missing", "hal_test_no_such_kernel_module:register"),
        _point("exploding", f"{good_module}:explode"),
    ]
    registry = OpRegistry(kernels=lambda: points)
    registry.define("double", lambda x: 2 * x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = registry.choose("double", "cpu", torch.float32)
    assert (choice.impl.name, choice.impl.source) == ("fast_double", "test kernel")
    problems = {p.name: p for p in registry.load_problems()}
    assert sorted(problems) == ["exploding", "missing"]
    assert "ModuleNotFoundError" in problems["missing"].reason
    assert "hal_test_no_such_kernel_module" in problems["missing"].origin
    assert "kernel toolchain 0.0 is too old" in problems["exploding"].reason
    messages = [str(w.message) for w in caught if issubclass(w.category, KernelLoadWarning)]
    assert len(messages) == 2 and any(m.startswith("missing:") for m in messages), messages


def test_kernel_modules_load_once_before_the_first_listing(good_module: str) -> None:
    import importlib

    module = importlib.import_module(good_module)
    module.CALLS.clear()  # another test may have loaded it already
    registry = OpRegistry(kernels=lambda: [_point("good", f"{good_module}:register")])
    registry.define("double", lambda x: 2 * x)
    assert module.CALLS == []  # defining ops loads nothing
    assert registry.names() == ["double"]
    registry.implementations("double")
    assert module.CALLS == [registry]
    assert registry.load_problems() == ()


def test_hal_ops_names_a_broken_third_party_kernel_below_its_table(tmp_path: Path) -> None:
    dist = tmp_path / "acme_kernels-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-kernels\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[hal.kernels]\nacme = acme_kernels_missing:register\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    plain = run_hal("ops", "--backend", "ascend")
    broken = run_hal("ops", "--backend", "ascend", env=env)
    assert plain.returncode == broken.returncode == 0, broken.stderr
    assert broken.stdout.startswith(plain.stdout) and "npu_rms_norm not used" in broken.stdout
    assert "kernel module acme: failed to load: ModuleNotFoundError" in broken.stdout.removeprefix(plain.stdout)
    assert "acme: failed to load: ModuleNotFoundError" in broken.stderr
    assert "acme" not in plain.stderr
