"""The layout's two promises, checked mechanically: one installed top-level name (``hal``), and
imports that never run back up a floor (contracts → vendors/kernels → collectives → parallel →
conformance → commands). Each checker is also run on a planted violation, so the test can fail."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# package -> floor. Every component is a folder under hal/ (the path on disk is the import name); a module's floor
# is its deepest package's here. Lower floors never import higher ones.
FLOORS: dict[str, int] = {
    "hal": 0,
    "hal.backends": 1,
    "hal.kernels": 1,
    "hal.collectives": 2,
    "hal.parallel": 3,
    "hal.conformance": 4,
    "hal.cli": 5,
    "hal.launch": 1,  # imports only hal/'s contracts: a library the loop uses for its ranks' environments
}
# module -> imported package it may reach although higher, and why. Keep this empty or explained.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("hal/__main__.py", "hal.cli"): "`python -m hal` must live in the hal package; it is the command, the top floor",
}


def _package_of(module: str) -> str | None:
    """The FLOORS package an absolute module name belongs to (the longest that contains it); None outside hal.*."""
    owners = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    return max(owners, key=len) if owners else None


def _module_of(path: Path, root: Path) -> str:
    """``hal/backends/cuda.py`` -> ``hal.backends.cuda`` (a package's ``__init__`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(root: Path) -> list[Path]:
    base = root / "hal"
    return sorted(base.rglob("*.py")) if base.is_dir() else []


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every absolute import in a module, function-level ones included (they run just the same)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from hal import cli` reaches hal.cli
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def upward_imports(root: Path) -> list[str]:
    """'file:line imports X (floor a -> b)' for each import from a lower floor to a higher one."""
    problems = []
    for path in _sources(root):
        rel = path.relative_to(root).as_posix()
        owner = _package_of(_module_of(path, root))
        floor = FLOORS[owner] if owner else 0
        reported: set[int] = set()
        for lineno, module in _imports(ast.parse(path.read_text(encoding="utf-8"), rel)):
            reached = _package_of(module)
            if reached is None or FLOORS[reached] <= floor or lineno in reported:
                continue
            if (rel, reached) not in ALLOWED_UPWARD:
                reported.add(lineno)
                problems.append(f"{rel}:{lineno} imports {module} (floor {floor} -> {FLOORS[reached]})")
    return sorted(problems)


# hal/parallel/'s rooms -> floor. A room imports only rooms on a lower floor (two rooms on one floor never import
# each other); the flat modules of hal/parallel/ itself are none but its __init__.
ROOMS: dict[str, int] = {
    "schedules": 0, "data": 0, "families": 0,
    "config": 1,
    "models": 2, "observe": 2, "emit": 2,
    "state": 3,
    "pipeline": 4,
    "replicas": 5,
    "loop": 6,
    "planner": 7,
}
MAX_FLAT_MODULES = 15  # a folder with more modules than this side by side wants rooms


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["hal", "parallel"] and parts[2] in ROOMS else None


def room_violations(root: Path) -> list[str]:
    """'file:line imports X (room a, floor f -> room b, floor g)' for each import into a room not below."""
    problems = []
    base = root / "hal" / "parallel"
    for path in sorted(base.rglob("*.py")) if base.is_dir() else []:
        rel = path.relative_to(root)
        if len(rel.parts) < 4:
            if path.name != "__init__.py":
                problems.append(f"{rel.as_posix()} sits flat in hal/parallel/: give it a room")
            continue
        room = rel.parts[2]
        if room not in ROOMS:
            problems.append(f"{rel.as_posix()} is in hal/parallel/{room}/, a room tests/cli/test_layout.py does not know")
            continue
        reported: set[int] = set()
        for lineno, module in _imports(ast.parse(path.read_text(encoding="utf-8"), rel.as_posix())):
            target = _room_of(module)
            if target is None or target == room or ROOMS[target] < ROOMS[room] or lineno in reported:
                continue
            reported.add(lineno)
            problems.append(f"{rel.as_posix()}:{lineno} imports {module} "
                            f"(room {room}, floor {ROOMS[room]} -> room {target}, floor {ROOMS[target]})")
    return sorted(set(problems))


def crowded_folders(root: Path) -> list[str]:
    """'folder: N modules' for every source folder holding more than MAX_FLAT_MODULES modules side by side."""
    crowded = []
    for directory in sorted({path.parent for path in _sources(root)}):
        modules = [p for p in directory.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_FLAT_MODULES:
            crowded.append(f"{directory.relative_to(root).as_posix()}: {len(modules)} modules")
    return crowded


def bare_top_level_imports(root: Path) -> list[str]:
    """Imports of a component by its bare, generic name (``import kernels``) anywhere in the repo."""
    bare = {p.removeprefix("hal.") for p in FLOORS if p != "hal"}
    problems = []
    for path in sorted(root.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        for lineno, module in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if module.split(".")[0] in bare:
                problems.append(f"{path.relative_to(root)}:{lineno} imports {module}; use hal.{module}")
    return problems


def private_imports_across_packages(root: Path) -> list[str]:
    """'file:line imports NAME from MODULE' for each private name (``_x``) taken from a module of another package:
    a private name is its package's own; what another package needs is a public name (the ops' references are
    ``registry.reference(op)``, not ``hal.ops._rms_norm``)."""
    problems = []
    for path in _sources(root):
        rel = path.relative_to(root).as_posix()
        own = _module_of(path, root)
        package = own if path.name == "__init__.py" else own.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            source_package = node.module.rpartition(".")[0] if (root / (node.module.replace(".", "/") + ".py")).is_file() \
                else node.module
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and source_package != package:
                    problems.append(f"{rel}:{node.lineno} imports {alias.name} from {node.module}")
    return sorted(problems)


def test_no_import_runs_back_up_a_floor() -> None:
    assert upward_imports(REPO) == []


def test_no_private_name_crosses_a_package() -> None:
    assert private_imports_across_packages(REPO) == []


def test_nothing_imports_a_folder_by_its_generic_name() -> None:
    assert bare_top_level_imports(REPO) == []


def test_the_checkers_catch_planted_violations(tmp_path: Path) -> None:
    (tmp_path / "hal" / "collectives").mkdir(parents=True)
    (tmp_path / "hal" / "precision.py").write_text("def f():\n    from hal.parallel.pipeline.engine import PipelineEngine\n")
    (tmp_path / "hal" / "collectives" / "x.py").write_text("from hal import cli\nimport hal.backends.cpu\nimport kernels\n")
    assert upward_imports(tmp_path) == [
        "hal/collectives/x.py:1 imports hal.cli (floor 2 -> 5)",
        "hal/precision.py:2 imports hal.parallel.pipeline.engine (floor 0 -> 3)",
    ]
    assert bare_top_level_imports(tmp_path) == ["hal/collectives/x.py:3 imports kernels; use hal.kernels"]
    (tmp_path / "hal" / "ops").mkdir()
    (tmp_path / "hal" / "ops" / "__init__.py").write_text("def _rms_norm(): ...\n")
    (tmp_path / "hal" / "ops" / "registry.py").write_text("from hal.ops import _rms_norm\n")  # its own package: fine
    (tmp_path / "hal" / "collectives" / "y.py").write_text("from hal.ops import _rms_norm\nfrom hal.collectives.x import _z\n")
    assert private_imports_across_packages(tmp_path) == ["hal/collectives/y.py:1 imports _rms_norm from hal.ops"]


def test_parallel_rooms_import_only_rooms_below() -> None:
    assert room_violations(REPO) == []


def test_no_folder_holds_more_than_fifteen_modules_flat() -> None:
    assert crowded_folders(REPO) == []


def test_the_room_checkers_catch_planted_violations(tmp_path: Path) -> None:
    parallel = tmp_path / "hal" / "parallel"
    (parallel / "config").mkdir(parents=True)
    (parallel / "models").mkdir()
    (parallel / "observe").mkdir()
    (parallel / "config" / "plan.py").write_text(
        "from hal.parallel.schedules import get_schedule\n"
        "def f():\n    from hal.parallel.loop.trainer import main\n")
    (parallel / "models" / "decoder.py").write_text("import hal.parallel.observe.timeline\n")
    (parallel / "stray.py").write_text("")
    for i in range(MAX_FLAT_MODULES + 1):
        (parallel / "observe" / f"m{i}.py").write_text("")
    assert room_violations(tmp_path) == [
        "hal/parallel/config/plan.py:3 imports hal.parallel.loop.trainer (room config, floor 1 -> room loop, floor 6)",
        "hal/parallel/models/decoder.py:1 imports hal.parallel.observe.timeline (room models, floor 2 -> room observe, floor 2)",
        "hal/parallel/stray.py sits flat in hal/parallel/: give it a room",
    ]
    assert crowded_folders(tmp_path) == [f"hal/parallel/observe: {MAX_FLAT_MODULES + 1} modules"]


# --- what the distribution installs ----------------------------------------------------------------


def _build_wheel(out: Path) -> Path:
    """Build from a copy, so setuptools' build/ and egg-info never land in the checkout."""
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "runs", "__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out), str(source)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = out.glob("hetero_hal-*.whl")
    return wheel


def top_level_names(wheel: Path) -> set[str]:
    """Importable top-level names a wheel installs (its dist-info aside)."""
    with zipfile.ZipFile(wheel) as archive:
        names = {n.split("/")[0] for n in archive.namelist()}
    return {n.removesuffix(".py") for n in names if not n.endswith((".dist-info", ".data"))}


def installed_sources(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n for n in archive.namelist() if n.endswith(".py")}


def expected_sources(root: Path) -> set[str]:
    """Every .py under hal/, at the same path in the wheel (the path is the import name)."""
    return {path.relative_to(root).as_posix() for path in _sources(root)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_only_hal_and_every_source_file(wheel: Path) -> None:
    assert top_level_names(wheel) == {"hal"}
    missing = expected_sources(REPO) - installed_sources(wheel)
    assert not missing, f"source files the wheel leaves out (add their package to pyproject.toml): {sorted(missing)}"


def test_the_checker_catches_a_second_top_level_name(tmp_path: Path) -> None:
    planted = tmp_path / "planted-0-py3-none-any.whl"
    with zipfile.ZipFile(planted, "w") as archive:
        for name in ("hal/__init__.py", "kernels/__init__.py", "planted-0.dist-info/METADATA"):
            archive.writestr(name, "")
    assert top_level_names(planted) == {"hal", "kernels"}


def test_a_regular_install_imports_hal_star_and_no_generic_name(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel (not editable): hal.kernels works, and no generic name resolves into the install
    (``kernels`` may still be importable: Hugging Face's, which transformers >= 5.25 brings)."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--disable-pip-version-check",
                    "--target", str(target), str(wheel)], check=True, timeout=300, capture_output=True)
    generic = sorted(p.removeprefix("hal.") for p in FLOORS if p != "hal")
    code = (
        "import importlib.util, hal, hal.kernels, hal.parallel, hal.backends, hal.cli\n"
        "print(hal.kernels.__file__)\n"
        "print(hal.backend_names())\n"
        f"specs = [(n, importlib.util.find_spec(n)) for n in {generic!r}]\n"
        f"print([n for n, s in specs if s and any(str(p).startswith({str(target)!r}) "
        "for p in [s.origin or '', *(s.submodule_search_locations or [])])])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    kernels_file, backends, ours = out.stdout.splitlines()
    assert kernels_file.startswith(str(target)), kernels_file
    assert backends == "['cpu', 'cuda', 'rocm', 'ascend', 'cambricon']"
    assert ours == "[]"


# --- what a command loads ----------------------------------------------------------------------------


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_help_loads_no_torch() -> None:
    """`hal --help` and `hal <cmd> --help` answer without importing torch (that import alone is 1-3 s)."""
    for argv in ([], ["train"], ["conformance", "run"]):
        loaded = _loaded_after(
            f"from hal.cli import main\ntry:\n    main([*{argv!r}, '--help'])\nexcept SystemExit:\n    pass")
        assert "torch" not in loaded, argv


def test_hal_devices_loads_neither_the_engine_nor_conformance() -> None:
    loaded = _loaded_after("import io, contextlib\nfrom hal.cli import main\n"
                           "with contextlib.redirect_stdout(io.StringIO()):\n    main(['devices'])")
    heavy = sorted(m for m in loaded if m.startswith(("hal.parallel", "hal.conformance.", "hal.collectives")))
    assert heavy == ["hal.conformance.suite_names"]


# --- the fast lane -------------------------------------------------------------------------------------

pytest_plugins = ["pytester"]


def test_the_fast_lane_refuses_a_test_that_starts_a_process(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_sneaky="""
        import subprocess, sys
        def test_starts_one():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        def test_stays_in_process():
            assert sum(range(4)) == 6
    """)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_starts_one starts a process: move its module to tests/ranks or tests/cli*"])
