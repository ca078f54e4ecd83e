"""Conformance reports: results.json schema and round trip, summary.md, the self-contained HTML page, files
written atomically, the page without matplotlib, and compare's verdicts."""
from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hal.backends.cpu import CpuBackend
from hal.conformance import runner
from hal.conformance.cases import Context
from hal.conformance.reports import compare, report
from hal.conformance.reports.html_report import render
from hal.errors import ConfigError
from tests.conftest import REPO

PLANTED = "tests.conformance_planted"
MATMUL = "ops::matmul/reference/float32/planted_error/forward"


def _run(**options: float) -> dict:
    ctx = runner.build_context("cpu", options=options)[0]
    return runner.execute(ctx, runner.plan(ctx, PLANTED), progress=False).to_dict()


@pytest.fixture(scope="module")
def doc() -> dict:
    return _run()


def _strict_json(text: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_json_safe_and_back() -> None:
    import torch

    safe = report.json_safe({"a": float("inf"), "b": float("-inf"), "c": float("nan"), "t": torch.tensor(0.5),
                             "d": torch.bfloat16, "v": torch.tensor([1.0, 2.0]), "k": (1, 2)})
    assert safe == {"a": "inf", "b": "-inf", "c": "nan", "t": 0.5, "d": "bfloat16", "v": [1.0, 2.0], "k": [1, 2]}
    assert report.as_float("inf") == float("inf") and report.as_float(3) == 3.0
    assert report.as_float("text") is None and report.as_float(True) is None


def test_results_json_is_strict_json_and_round_trips(doc: dict, tmp_path: Path) -> None:
    doc = copy.deepcopy(doc)
    doc["cases"][0]["metrics"]["tol_ratio"] = "inf"  # as a non-finite metric is stored
    paths = report.write_reports(doc, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "summary.md", "report.html"]
    loaded = _strict_json((tmp_path / "out" / "results.json").read_text())
    assert loaded.pop("digest").startswith("sha256:")  # sealed as it is written (hal conformance verify)
    assert loaded == doc and {k: v for k, v in report.load_results(tmp_path / "out" / "results.json").items()
                              if k != "digest"} == doc
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.html", "results.json", "summary.md"]  # no temp files
    case = next(c for c in loaded["cases"] if c["id"] == MATMUL)
    assert set(case) >= {"id", "suite", "name", "description", "tags", "status", "metrics", "tolerance",
                         "failed_metric", "reason", "data", "seconds"}


def test_nothing_is_written_when_rendering_fails(doc: dict, tmp_path: Path) -> None:
    broken = copy.deepcopy(doc)
    del broken["cases"][0]["name"]
    with pytest.raises(KeyError):
        report.write_reports(broken, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_report_dir_must_be_writable(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        report.check_report_dir(blocker)
    with pytest.raises(ConfigError, match="cannot write there"):
        report.check_report_dir(blocker / "sub")
    assert report.check_report_dir(tmp_path / "new" / "dir").is_dir()


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not JSON"),
    ('{"kind": "something-else", "schema": 1, "cases": []}', "not a hal conformance results file"),
    ('{"kind": "hal-conformance-run", "schema": 99, "cases": []}', "schema 99 is not one this hal reads"),
    ('{"kind": "hal-conformance-run", "schema": 1, "cases": [{"id": "x"}]}', "the file is damaged"),
    ('{"kind": "hal-conformance-run", "schema": 1, "cases": [{"id": "x", "status": "pass"}, {"id": "x", "status": "fail"}]}',
     "case 'x' appears twice; the file is damaged"),
    ('{"kind": "hal-conformance-run", "schema": 1, "cases": [{"id": "x", "status": "pass", "metrics": {"tol_ratio": "x"}}]}',
     r"case 'x': tol_ratio = 'x' is not an error \(a number >= 0\)"),
    ('{"kind": "hal-conformance-run", "schema": 1, "cases": [{"id": "x", "status": "pass", "metrics": {"rel_l2": -5}}]}',
     "case 'x': rel_l2 = -5 is not an error"),
    ('{"kind": "hal-conformance-run", "schema": 1, "cases": [{"id": "x", "status": "pass", "metrics": [1]}]}',
     "case 'x': \"metrics\" is not an object"),
])
def test_bad_results_files_are_one_line_errors(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        report.load_results(path)
    assert "\n" not in str(info.value)


def test_summary_text_and_markdown(doc: dict) -> None:
    text = report.summary_text(doc)
    assert re.search(r"^ops\s+3\s+1\s+1\s+1\s+1\s+7", text, re.M)
    assert re.search(r"^total\s+5\s+1\s+1\s+1\s+1\s+9", text, re.M)
    assert f"fail  {MATMUL} tol_ratio" in text and "(bound 1): max error" in text
    assert "error ops::gelu/reference/float32/raises/forward: RuntimeError: planted failure inside the case" in text
    worst = text.split("worst cases by tol_ratio")[1].splitlines()[1]
    assert MATMUL in worst  # the planted error is the worst
    assert "verdict: FAIL: 1 failed, 1 errors" in text
    md = report.markdown(doc)
    assert md.startswith("# Conformance: cpu on ") and "— FAIL" in md.splitlines()[0]
    assert "| ops | 3 | 1 | 1 | 1 | 1 | 7 |" in md and "## Failures (2)" in md
    assert f"| {MATMUL} | fail | tol_ratio |" in md and "### training (1)" in md


def _external_refs(page: str) -> list[str]:
    return re.findall(r"""(?:src|href|xlink:href)\s*=\s*["']?\s*(?:https?:|//)[^"' >]*""", page, re.I) + \
        re.findall(r"url\(\s*['\"]?(?:https?:|//)", page, re.I) + re.findall(r"@import", page)


def test_html_is_one_self_contained_page_with_three_plots(doc: dict) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the 'report' extra")
    page = render(doc)
    assert not _external_refs(page)
    assert "<script" not in page.lower() and "<link" not in page.lower() and "<img" not in page.lower()
    assert page.count("<svg") == 3  # tol_ratio, loss curves, busbw
    for anchor in ('id="plot-tol_ratio"', 'id="plot-loss"', 'id="plot-busbw"'):
        assert anchor in page
    assert '<span class="verdict fail">FAIL</span>' in page
    assert MATMUL in page and "RuntimeError: planted failure inside the case" in page
    assert "<summary>traceback</summary>" in page and doc["verification"] in page
    assert page.count("<details") >= 3  # one per suite
    assert ">linear_fit/float32/loss_curve<" in page  # the loss panel's title is text in the SVG


def test_html_marks_an_unverified_backend() -> None:
    class UnverifiedCpu(CpuBackend):
        hardware_verification = None

    backend = UnverifiedCpu()
    ctx = Context(backend, backend.device(0), backend.capabilities(0), max_world_size=1)
    page = render(runner.execute(ctx, runner.plan(ctx, PLANTED, "softmax"), progress=False).to_dict())
    assert '<span class="unverified">not verified on hardware</span>' in page
    assert '<span class="verdict pass">PASS</span>' in page


def test_html_without_matplotlib_says_what_is_missing(doc: dict, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(report.dumps(doc))
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from hal.conformance.reports.report import load_results; from hal.conformance.reports.html_report import render\n"
            f"print(render(load_results({str(results)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    page = out.stdout
    assert "<svg" not in page and page.count("Plot missing: matplotlib is not installed") == 3
    assert "pip install &#x27;hetero-hal[report]&#x27;" in page and MATMUL in page


def test_plots_with_no_data_say_so(doc: dict) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the 'report' extra")
    only_ops = {**doc, "cases": [c for c in doc["cases"] if c["suite"] == "ops"]}
    page = render(only_ops)
    assert page.count("<svg") == 1 and "Nothing to plot: no case in this run carries a loss curve" in page


def test_compare_flags_a_case_more_than_factor_worse(doc: dict) -> None:
    a = _run(planted_ratio=0.3)  # matmul tol_ratio ~0.3: passes
    b = _run(planted_ratio=0.9)  # ~0.9: still passes, but ~3x A's error
    c = _run(planted_ratio=0.45)  # ~0.45: within 2x
    worse = compare.compare(a, b)
    assert [r.id for r in worse.worse] == [MATMUL] and worse.exit_code == 1
    row = worse.worse[0]
    assert row.metric == "tol_ratio" and row.status_a == row.status_b == "pass" and 2.5 < row.ratio < 3.5
    assert compare.compare(a, c).exit_code == 0
    assert compare.compare(a, b, factor=4).exit_code == 0
    regressed = compare.compare(a, doc)  # B failed where A passed
    assert [r.id for r in regressed.worse] == [MATMUL]


def test_compare_floor_status_and_unmatched_cases(doc: dict) -> None:
    a, b = copy.deepcopy(doc), copy.deepcopy(doc)
    softmax = "ops::softmax/reference/float32/odd_shape/forward"
    pick = lambda d: next(c for c in d["cases"] if c["id"] == softmax)  # noqa: E731
    pick(a)["metrics"]["tol_ratio"], pick(b)["metrics"]["tol_ratio"] = 0.0, 0.015  # under 2 x floor 0.01
    assert softmax not in [r.id for r in compare.compare(a, b).worse]
    pick(b)["metrics"]["tol_ratio"] = 0.03
    assert softmax in [r.id for r in compare.compare(a, b).worse]
    assert softmax not in [r.id for r in compare.compare(a, b, floors={"tol_ratio": 0.02}).worse]
    pick(b)["metrics"]["tol_ratio"] = "nan"
    assert softmax in [r.id for r in compare.compare(a, b).worse]
    b["cases"] = [c for c in b["cases"] if "seed" not in c["id"]] + [{**b["cases"][0], "id": "ops::only/in_b"}]
    cmp = compare.compare(a, b)
    assert cmp.only_a == ["ops::seed/probe"] and cmp.only_b == ["ops::only/in_b"]
    text = compare.format_text(cmp)
    assert "only in A (1):\n  ops::seed/probe" in text and "only in B (1):\n  ops::only/in_b" in text
    skipped = next(r for r in cmp.rows if "skipped" in r.id)
    assert skipped.verdict == "not compared"
    json.dumps(cmp.to_dict(), allow_nan=False)


def test_compare_falls_back_to_a_bounded_metric(doc: dict) -> None:
    """A training-style case with no standard error metric is compared as metric / bound."""
    a, b = copy.deepcopy(doc), copy.deepcopy(doc)
    for d, dev in ((a, 1e-6), (b, 1.5e-6)):
        case = next(c for c in d["cases"] if c["id"] == "ops::seed/probe")
        case["metrics"], case["tolerance"] = {"final_loss": 3.0, "mean_rel_dev": dev}, {"mean_rel_dev": 1e-4}
    row = next(r for r in compare.compare(a, b).rows if r.id == "ops::seed/probe")
    assert row.metric == "mean_rel_dev/bound" and row.verdict == "ok"  # 0.015 <= 2 x max(0.01, floor 0.01)
    next(c for c in b["cases"] if c["id"] == "ops::seed/probe")["metrics"]["mean_rel_dev"] = 3e-6
    assert next(r for r in compare.compare(a, b).rows if r.id == "ops::seed/probe").verdict == "worse"


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless chromium is not installed")
def test_the_page_renders_in_headless_chromium(doc: dict, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render(doc), encoding="utf-8")
    shot = tmp_path / "shot.png"
    profile = tmp_path / "profile"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()]
    subprocess.run(cmd, capture_output=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 20_000  # a blank page compresses to a few KiB
