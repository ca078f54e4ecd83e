"""``hal conformance run`` and ``hal conformance compare`` as a user runs them (subprocesses of the real CLI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hal.backend_registry import all_backends
from hal.conformance import runner
from hal.conformance.reports import report
from tests.conftest import REPO, run_hal

PLANTED = "tests.conformance_planted"
MATMUL = "ops::matmul/reference/float32/planted_error/forward"


def _one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hal: error: ") and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_run_writes_reports_prints_the_summary_and_exits_1_on_failure(tmp_path: Path) -> None:
    out = run_hal("conformance", "run", "--suite", PLANTED, "--report", str(tmp_path / "rep"))
    assert out.returncode == 1, out.stderr
    assert "[1/9] pass" in out.stderr and "[9/9] pass" in out.stderr  # progress on stderr, a line per case
    assert "suite" in out.stdout and f"fail  {MATMUL} tol_ratio" in out.stdout
    assert "verdict: FAIL: 1 failed, 1 errors" in out.stdout
    assert f"reports: {tmp_path / 'rep' / 'results.json'}" in out.stdout
    doc = report.load_results(tmp_path / "rep" / "results.json")
    assert doc["counts"]["total"]["total"] == 9 and doc["verdict"] == "fail"
    assert "<html" in (tmp_path / "rep" / "report.html").read_text()


def test_json_goes_to_stdout_and_a_clean_selection_exits_0(tmp_path: Path) -> None:
    out = run_hal("conformance", "run", "--suite", PLANTED, "-k", "softmax,busbw", "--json", "--report", str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["kind"] == "hal-conformance-run" and doc["verdict"] == "pass" and len(doc["cases"]) == 3
    assert doc["patterns"] == ["softmax", "busbw"] and "verdict: PASS" in out.stderr


def test_list_prints_ids_and_runs_nothing(tmp_path: Path) -> None:
    out = run_hal("conformance", "run", "--suite", PLANTED, "-k", "ops::*/float32/*", "--list", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ops::softmax/reference/float32/odd_shape/forward", MATMUL,
                                       "ops::gelu/reference/float32/raises/forward"]
    assert "total        3 case(s) of 9" in out.stderr and not (tmp_path / "runs").exists()


def test_default_report_dir_is_under_runs(tmp_path: Path) -> None:
    out = run_hal("conformance", "run", "--suite", PLANTED, "-k", "softmax", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    written = list((tmp_path / "runs").glob("conformance-*/results.json"))  # named after the auto-selected backend
    assert len(written) == 1 and f"reports: {Path('runs') / written[0].parent.name / 'results.json'}" in out.stdout


def _bad_inputs() -> list[tuple[list[str], str]]:
    cases = [
        (["--suite", "opps"], "unknown suite 'opps'"),
        (["--backend", "nosuch"], "'nosuch' is not allowed"),
        (["--suite", PLANTED, "-k", "nothing_matches_this"], "matches none of the 9 case(s)"),
        (["--suite", PLANTED, "-k", "softmax,,gelu"], "empty pattern"),
        (["--suite", PLANTED, "--world-size", "0"], "--world-size 0"),
        (["--suite", PLANTED, "--world-size", "100000"], "--world-size 100000 is above the limit"),  # was accepted
        (["--suite", PLANTED, "--seed", str(2**70)], "give a whole number from 0 to"),  # was a ValueError traceback
        (["--suite", PLANTED, "--seed", "-1"], "give a whole number from 0 to"),
        (["--suite", PLANTED, "--report", "{blocker}/sub"], "cannot write there"),
        (["--suite", "tests.no_such_module"], "cannot be loaded: no such module"),
    ]
    unavailable = [name for name, b in all_backends().items() if not b.is_available()]
    if unavailable:
        cases.append((["--backend", unavailable[0]], f"backend '{unavailable[0]}' is not available: "))
    return cases


@pytest.mark.parametrize("args, needle", _bad_inputs())
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str], args: list[str],
                                                               needle: str) -> None:
    """hal's own main in this process (the subprocess test below proves the same for the installed command)."""
    from hal.cli import main

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be")
    monkeypatch.chdir(tmp_path)
    for var in ("HAL_BACKEND", "HAL_PRECISION", "HAL_FALLBACK"):
        monkeypatch.delenv(var, raising=False)
    code = main(["conformance", "run", *(a.format(blocker=blocker) for a in args)])
    captured = capsys.readouterr()
    _one_line_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]  # no runs/ directory, no report


def test_bad_input_from_the_real_command_is_one_line_and_exit_2(tmp_path: Path) -> None:
    _one_line_error(run_hal("conformance", "run", "--suite", "ops,opps", cwd=tmp_path), "unknown suite 'opps'")
    _one_line_error(run_hal("conformance", "run", "--suite", PLANTED, "--report", str(REPO / "README.md" / "x")),
                    "cannot write there")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_run_leaves_no_report_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from hal.cli import main

    (tmp_path / "stopsuite").mkdir()
    (tmp_path / "stopsuite" / "__init__.py").write_text("")
    (tmp_path / "stopsuite" / "ctrl_c.py").write_text(
        "from hal.conformance.cases import Case\n"
        "def _stop(ctx):\n    raise KeyboardInterrupt\n"
        "def cases(ctx):\n    return [Case('stop', 'ctrl_c', _stop)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["conformance", "run", "--suite", "stopsuite.ctrl_c", "--report", str(tmp_path / "rep")]) == 130
    assert "hal: interrupted" in capsys.readouterr().err and not (tmp_path / "rep").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Results files of the planted suite with different planted errors (A ~0.3 of the bound, B ~0.9, C ~0.45)."""
    base = tmp_path_factory.mktemp("runs")
    paths = {}
    for label, ratio, patterns in (("a", 0.3, None), ("b", 0.9, None), ("c", 0.45, "ops::")):
        ctx = runner.build_context("cpu", options={"planted_ratio": ratio})[0]
        doc = runner.execute(ctx, runner.plan(ctx, PLANTED, patterns), progress=False).to_dict()
        paths[label] = report.write_reports(doc, base / label)[0]
    return paths


def test_compare_exits_1_when_b_is_more_than_factor_worse(runs: dict[str, Path], tmp_path: Path) -> None:
    out = run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--report", str(tmp_path))
    assert out.returncode == 1, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith(MATMUL))
    assert "tol_ratio" in row and "worse (B " in row
    assert "verdict: WORSE: 1 worse" in out.stdout
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["verdict"] == "worse" and saved["counts"]["worse"] == 1
    assert (tmp_path / "compare.txt").read_text().startswith("A: ")


def test_compare_within_factor_exits_0_and_lists_unmatched_cases(runs: dict[str, Path]) -> None:
    out = run_hal("conformance", "compare", str(runs["a"]), str(runs["c"]), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "ok" and doc["only_in_a"] == ["training::linear_fit/float32/loss_curve",
                                                           "collectives::all_reduce/float32/busbw"]
    loose = run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--factor", "4")
    assert loose.returncode == 0, loose.stdout


def test_compare_shows_the_verdict_first_and_only_worse_cases_unless_all(runs: dict[str, Path], tmp_path: Path) -> None:
    from hal.cli import main

    short = run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]))
    lines = short.stdout.splitlines()
    assert lines[3].startswith("verdict: WORSE: 1 worse"), lines[:5]
    assert not any("  ok" in line for line in lines) and "not listed; --all lists them" in short.stdout
    every = run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--all")
    assert sum(line.rstrip().endswith("  ok") for line in every.stdout.splitlines()) >= 2
    assert "not listed" not in every.stdout
    main(["conformance", "compare", str(runs["a"]), str(runs["b"]), "--report", str(tmp_path)])
    assert (tmp_path / "compare.txt").read_text().count("  ok") >= 2  # the file keeps every case


def test_compare_warns_when_the_runs_differ_in_seed_or_selection(runs: dict[str, Path], tmp_path: Path) -> None:
    doc = json.loads(runs["a"].read_text())
    doc["seed"] = 7
    reseeded = tmp_path / "results.json"
    reseeded.write_text(json.dumps(doc))
    out = run_hal("conformance", "compare", str(runs["a"]), str(reseeded))
    assert "hal: warning: A and B ran with different settings (seed 1234 vs 7)" in out.stderr
    assert "warning: A and B ran with different settings (seed 1234 vs 7)" in out.stdout
    selection = json.loads(run_hal("conformance", "compare", str(runs["a"]), str(runs["c"]), "--json").stdout)
    assert selection["setting_differences"] == ["patterns [] vs ['ops::']"]
    same = json.loads(run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--json").stdout)
    assert same["setting_differences"] == []


def test_a_report_directory_holding_a_report_is_refused_unless_overwrite(runs: dict[str, Path], tmp_path: Path) -> None:
    earlier = runs["a"].parent
    before = (earlier / "results.json").read_bytes()
    _one_line_error(run_hal("conformance", "run", "--suite", PLANTED, "--report", str(earlier)),
                    "already holds a report (results.json, summary.md, report.html)")
    assert (earlier / "results.json").read_bytes() == before
    run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--report", str(tmp_path))
    _one_line_error(run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--report", str(tmp_path)),
                    "already holds a report (compare.json, compare.txt, compare.html)")
    again = run_hal("conformance", "compare", str(runs["a"]), str(runs["b"]), "--report", str(tmp_path), "--overwrite")
    assert again.returncode == 1 and "written:" in again.stdout


def test_compare_bad_files_exit_2(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hal.cli import main

    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2")
    _one_line_error(run_hal("conformance", "compare", str(runs["a"]), str(tmp_path / "missing.json")), "cannot read")
    for args, needle in (([str(junk), str(runs["a"])], "not JSON"), ([str(runs["a"]), str(runs["b"]), "--factor", "0"], "--factor 0"),
                         ([str(runs["a"]), str(runs["b"]), "--report", str(junk / "x")], "cannot write there")):
        code = main(["conformance", "compare", *args])
        captured = capsys.readouterr()
        _one_line_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), needle)


def test_compare_refuses_a_fifo_and_deeply_nested_json_in_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    fifo = tmp_path / "ff"
    os.mkfifo(fifo)  # reading it would block forever: refused before it is opened
    _one_line_error(run_hal("conformance", "compare", str(runs["a"]), str(fifo), timeout=60), "not a regular file")
    _one_line_error(run_hal("conformance", "compare", str(runs["a"]), str(tmp_path)), "not a regular file")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    _one_line_error(run_hal("conformance", "compare", str(runs["a"]), str(deep)), "nested too deeply")


def test_hal_lists_conformance_but_does_not_import_it_until_used() -> None:
    out = run_hal("--help")
    assert "conformance" in out.stdout
    code = ("import sys, hal, hal.cli; print(any(m.startswith('hal.conformance.') for m in sys.modules "
            "if m != 'hal.conformance.suite_names'))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.stdout.strip() == "False", probe.stderr


def test_hal_conformance_run_records_the_profile_and_judges_by_it(tmp_path: Path) -> None:
    result = run_hal("conformance", "run", "--backend", "cpu", "--suite", "ops", "-k", "ops::swiglu/*/bfloat16/*",
                     "--verdict", "cann", "--report", str(tmp_path / "r"), "--json", timeout=300)
    assert result.returncode in (0, 1), result.stderr
    doc = json.loads(result.stdout)
    assert doc["verdict_profile"] == "cann" and doc["verdict_profile_looser"]
    assert "verdict profile: cann (where our default is looser: bfloat16" in result.stderr
    cases = [c for c in doc["cases"] if c["status"] in ("pass", "fail")]
    assert cases and all("pass_share" in c["metrics"] for c in cases)
    assert all(c["tolerance"]["override"] == "verdict profile cann" for c in cases)


def test_compare_grades_every_common_case_and_draws_the_level_matrix(tmp_path: Path) -> None:
    """B planted from a real cpu run of softmax: its bf16 forward errors 3x A's (L1), its fp16 backward 20x (fail) —
    A's counted at least at the dtype floor, as the levels count them; the rest L2. compare prints the matrix, says
    what differs below L2, and writes it to compare.json and compare.html."""
    from hal.conformance.reports import levels as levels_module

    out = run_hal("conformance", "run", "--backend", "cpu", "--suite", "ops", "-k", "ops::softmax/reference/*",
                  "--report", str(tmp_path / "a"), timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "a" / "results.json").read_text())
    for case in doc["cases"]:
        m = case["metrics"]
        if "/bfloat16/" in case["id"] and case["id"].endswith("forward"):  # 3x A's mean error, A counted at its floor
            m["mean_rel"] = 3.0 * max(m["mean_rel"], levels_module.DTYPE_FLOOR["mean_rel"] * 2.0 ** -8)
        if "/float16/" in case["id"] and case["id"].endswith("backward"):
            for name in ("mean_rel", "max_rel", "max_rel_sv", "rmse"):
                m[name] = 20.0 * max(m[name], levels_module.DTYPE_FLOOR.get(name, 8.0) * 2.0 ** -11 * (
                    m["golden_rms"] if name == "rmse" else 1.0))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    cmp = run_hal("conformance", "compare", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                  "--report", str(tmp_path / "c"))
    assert cmp.returncode == 0, cmp.stderr
    assert "cross-device levels of B against A" in cmp.stdout and "below L2, what differs" in cmp.stdout
    assert "likely:" in cmp.stdout
    levels = json.loads((tmp_path / "c" / "compare.json").read_text())["levels"]
    assert levels["matrix"]["ops::softmax"] == {"float64": "L2", "float32": "L2", "bfloat16": "L1", "float16": "fail"}
    assert levels["counts"]["fail"] > 0 and levels["counts"]["L1"] > 0
    page = (tmp_path / "c" / "compare.html").read_text()
    assert "ops::softmax" in page and ">fail<" in page and "<script" not in page


def _with(doc: dict, change: Any) -> dict:
    changed = json.loads(json.dumps(doc))
    change(changed)
    return changed


ODD_FILES = {
    "a device given as a string": (lambda d: d.update(device="cuda:0"), "\"device\" = 'cuda:0' is not an object"),
    "a 400-digit metric": (lambda d: d["cases"][0].setdefault("metrics", {}).update(max_abs=10 ** 400),
                           "metrics.max_abs is a 401-digit integer, beyond any float"),
    "a 400-digit tolerance": (lambda d: d["cases"][0].update(tolerance={"atol": -(10 ** 400)}),
                              "tolerance.atol is a 401-digit integer"),
    "counts as a list": (lambda d: d.update(counts=[1]), "\"counts\" is not {by_suite"),
    "counts by suite as a list": (lambda d: d["counts"].update(by_suite=[1]), "\"counts\" is not {by_suite"),
    "a 400-digit count": (lambda d: d["counts"]["total"].update(fail=10 ** 400), "counts fail is a 401-digit integer"),
    "wall_seconds past a float": (lambda d: d.update(wall_seconds=10 ** 400), "wall_seconds is a 401-digit integer"),
}


@pytest.mark.parametrize("case", list(ODD_FILES))
def test_compare_reads_odd_but_loadable_files_as_one_line(case: str, runs: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Every field a report reads is checked as the file loads: a malformed one is one line and exit 2 (these were
    tracebacks: a "device" of "cuda:0", a metric written as a 400-digit integer)."""
    from hal.cli import main

    change, needle = ODD_FILES[case]
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(_with(json.loads(runs["a"].read_text()), change)))
    for args in ([str(runs["a"]), str(odd)], [str(odd), str(runs["a"])]):
        code = main(["conformance", "compare", *args])
        captured = capsys.readouterr()
        _one_line_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), needle)


def test_compare_refuses_a_results_file_too_large_to_be_one_before_reading_it(runs: dict[str, Path], tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A 200 MiB results.json once peaked at 1.7 GiB (480 MiB: a MemoryError traceback): memory is bounded by a size
    limit said in one line, checked before a byte is read (the file here is sparse: it takes no disk)."""
    from hal.cli import main
    from hal.conformance.reports.results import MAX_RESULTS_BYTES

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as fh:
        fh.truncate(MAX_RESULTS_BYTES + 1)
    code = main(["conformance", "compare", str(runs["a"]), str(huge)])
    captured = capsys.readouterr()
    _one_line_error(subprocess.CompletedProcess([], code, captured.out, captured.err), "above the 32 MiB a results file holds")
