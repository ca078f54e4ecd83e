"""The conformance runner on the CPU with a small planted suite: counts, exit codes, filters, error capture."""
from __future__ import annotations

import io
import textwrap

import pytest
import torch

from hal.backend import NOT_VERIFIED
from hal.backend_registry import all_backends, get_backend
from hal.backends.cpu import CpuBackend
from hal.conformance import runner
from hal.conformance.cases import Case, Context, Outcome
from hal.errors import BackendUnavailable, ConfigError, HalError
from tests import conformance_planted

PLANTED = "tests.conformance_planted"


@pytest.fixture(scope="module")
def ctx() -> Context:
    return runner.build_context("cpu")[0]


@pytest.fixture(scope="module")
def planted(ctx: Context) -> runner.RunResult:
    return runner.execute(ctx, runner.plan(ctx, PLANTED), progress=False)


def _by_name(result: runner.RunResult) -> dict[str, runner.CaseResult]:
    return {r.name: r for r in result.results}


def test_counts_per_status_and_suite(planted: runner.RunResult) -> None:
    counts = planted.counts()
    assert {s: counts["total"][s] for s in runner.STATUSES} == conformance_planted.EXPECTED
    assert counts["total"]["total"] == sum(conformance_planted.EXPECTED.values())
    assert list(counts["by_suite"]) == ["ops", "training", "collectives"]
    assert counts["by_suite"]["ops"]["fail"] == 1 and counts["by_suite"]["training"]["pass"] == 1
    assert planted.meta["suites"] == ["ops", "training", "collectives"]


def test_a_failure_or_error_makes_exit_status_1_and_a_clean_run_0(ctx: Context, planted: runner.RunResult) -> None:
    assert planted.exit_code == 1
    assert {r.status for r in planted.failed} == {"fail", "error"}
    clean = runner.execute(ctx, runner.plan(ctx, PLANTED, "softmax"), progress=False)
    assert [r.status for r in clean.results] == ["pass", "pass"]
    assert clean.exit_code == 0 and clean.to_dict()["verdict"] == "pass"


def test_the_planted_failure_names_its_metric(planted: runner.RunResult) -> None:
    failed = _by_name(planted)["matmul/reference/float32/planted_error/forward"].outcome
    assert failed.status == "fail" and failed.failed_metric == "tol_ratio" and failed.metrics["tol_ratio"] > 1


def test_an_exception_is_an_error_with_its_first_line_and_the_traceback_kept(planted: runner.RunResult) -> None:
    errored = _by_name(planted)["gelu/reference/float32/raises/forward"]
    assert errored.status == "error"
    assert errored.outcome.reason == "RuntimeError: planted failure inside the case"
    assert errored.traceback and "_raises" in errored.traceback and "second line" in errored.traceback
    assert errored.to_dict()["traceback"] == errored.traceback


def test_a_case_returning_something_else_is_an_error(ctx: Context) -> None:
    cases = [Case("ops", "bad/return", lambda c: 42), Case("ops", "bad/status", lambda c: Outcome("maybe"))]  # type: ignore[arg-type, return-value]
    result = runner.execute(ctx, runner.plan_from_cases(cases), progress=False)
    assert [r.status for r in result.results] == ["error", "error"]
    assert result.results[0].outcome.reason.startswith("TypeError: the case returned int")
    assert "status 'maybe'" in result.results[1].outcome.reason


def test_every_case_is_timed(planted: runner.RunResult) -> None:
    assert all(r.outcome.seconds > 0 for r in planted.results)
    assert planted.meta["wall_seconds"] >= 0


def test_every_case_starts_from_the_seed(ctx: Context, planted: runner.RunResult) -> None:
    alone = runner.execute(ctx, runner.plan(ctx, PLANTED, "seed/probe"), progress=False)
    torch.manual_seed(ctx.seed)
    expected = float(torch.rand(1))
    assert _by_name(planted)["seed/probe"].outcome.metrics["first_draw"] == expected
    assert alone.results[0].outcome.metrics["first_draw"] == expected


@pytest.mark.parametrize("patterns, expected", [
    ("softmax", {"softmax/reference/float32/odd_shape/forward", "softmax/reference/bfloat16/odd_shape/forward"}),
    ("ops::*/float32/*", {"softmax/reference/float32/odd_shape/forward", "matmul/reference/float32/planted_error/forward",
                          "gelu/reference/float32/raises/forward"}),
    ("*/busbw", {"all_reduce/float32/busbw"}),  # a glob may match the name alone
    ("training::,seed", {"linear_fit/float32/loss_curve", "seed/probe"}),  # comma: any pattern
])
def test_k_patterns(ctx: Context, patterns: str, expected: set[str]) -> None:
    assert {c.name for c in runner.plan(ctx, PLANTED, patterns).cases} == expected


@pytest.mark.parametrize("patterns, message", [
    ("no_such_case", "'no_such_case' matches none of the 9 case(s)"),
    ("softmax,", "empty pattern"),
    ("", "empty pattern"),
])
def test_bad_k_is_a_config_error(ctx: Context, patterns: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.plan(ctx, PLANTED, patterns)


def test_unknown_suite_and_missing_module_are_one_line_errors(ctx: Context) -> None:
    with pytest.raises(ConfigError, match="unknown suite 'opps'; use one or more of ops, precision"):
        runner.plan(ctx, "ops,opps")
    with pytest.raises(HalError, match="suite 'tests.no_such_suite' cannot be loaded: no such module"):
        runner.plan(ctx, "tests.no_such_suite")
    with pytest.raises(ConfigError, match="empty suite name"):
        runner.parse_suites("ops,,training")
    assert runner.parse_suites(None) == ["ops", "precision", "collectives", "training", "onnx", "contract"]


def test_a_broken_suite_is_recorded_and_the_others_still_run(ctx: Context, tmp_path, monkeypatch) -> None:
    package = tmp_path / "brokensuites"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "raising.py").write_text(textwrap.dedent("""
        def cases(ctx):
            raise ValueError("cannot build my cases")
    """))
    (package / "unimportable.py").write_text("import no_such_dependency_xyz\n")
    (package / "nocases.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    the_plan = runner.plan(ctx, f"brokensuites.raising,brokensuites.unimportable,{PLANTED}", "softmax")
    result = runner.execute(ctx, the_plan, progress=False)
    problems = {r.id: r for r in result.results if r.name == runner.COLLECT}
    assert set(problems) == {"raising::(collect)", "unimportable::(collect)"}
    assert "ValueError: cannot build my cases" in problems["raising::(collect)"].outcome.reason
    assert "no_such_dependency_xyz" in problems["unimportable::(collect)"].outcome.reason
    assert sum(r.status == "pass" for r in result.results) == 2 and result.exit_code == 1
    with pytest.raises(HalError, match=r"has no cases\(ctx\) function"):
        runner.plan(ctx, "brokensuites.nocases")
    with pytest.raises(ConfigError, match="matches none of the 0 case.*raising: .*cannot build my cases"):
        runner.plan(ctx, "brokensuites.raising", "softmax")  # -k finding nothing says why there was nothing


def test_duplicate_case_ids_are_a_collect_error(ctx: Context, tmp_path, monkeypatch) -> None:
    (tmp_path / "dupsuites").mkdir()
    (tmp_path / "dupsuites" / "__init__.py").write_text("")
    (tmp_path / "dupsuites" / "dup.py").write_text(textwrap.dedent("""
        from hal.conformance.cases import Case, Outcome
        def cases(ctx):
            return [Case("x", "same", lambda c: Outcome("pass")), Case("x", "same", lambda c: Outcome("pass"))]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    the_plan = runner.plan(ctx, "dupsuites.dup")
    assert the_plan.cases == [] and "1 duplicate case id(s), e.g. x::same" in the_plan.problems[0].outcome.reason


def test_context_world_size_and_device(ctx: Context) -> None:
    assert ctx.backend.name == "cpu" and ctx.device == torch.device("cpu") and ctx.max_world_size == runner.CPU_WORLD_SIZE
    assert runner.build_context("cpu", world_size=2)[0].max_world_size == 2
    with pytest.raises(ConfigError, match="--world-size 0"):
        runner.build_context("cpu", world_size=0)


def test_unknown_and_unavailable_backends_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="'nosuch' is not allowed; use one of auto, cpu"):
        runner.build_context("nosuch")
    unavailable = [name for name, b in all_backends().items() if not b.is_available()]
    if not unavailable:
        pytest.skip("every backend is available here")
    with pytest.raises(BackendUnavailable, match=f"backend '{unavailable[0]}' is not available: "):
        runner.build_context(unavailable[0])


def test_metadata(planted: runner.RunResult) -> None:
    meta = planted.to_dict()
    assert meta["kind"] == "hal-conformance-run" and meta["schema"] == 1
    assert meta["backend"] == "cpu" and meta["device"]["type"] == "cpu" and meta["device"]["name"]
    assert meta["verification"] == get_backend("cpu").verification and meta["verified_on_hardware"] is True
    assert meta["torch"] == torch.__version__ and meta["python"] and meta["host"] is not None and meta["started"]
    assert meta["counts"]["total"]["total"] == len(meta["cases"]) == 9 and meta["collected"] == 9
    assert meta["verdict"] == "fail"


class _UnverifiedCpu(CpuBackend):
    """The host CPU declared as never verified, as rocm/ascend/cambricon are: the report must say so."""

    hardware_verification = None


def test_an_unverified_backend_says_so(ctx: Context) -> None:
    for name in ("rocm", "ascend", "cambricon"):
        assert get_backend(name).verification == NOT_VERIFIED == "not verified on hardware"
    backend = _UnverifiedCpu()
    unverified = Context(backend, backend.device(0), backend.capabilities(0), max_world_size=1)
    result = runner.execute(unverified, runner.plan(unverified, PLANTED, "softmax"), progress=False)
    assert result.meta["verification"] == "not verified on hardware" and result.meta["verified_on_hardware"] is False


def test_progress_is_a_line_per_case_off_a_terminal(ctx: Context) -> None:
    stream = io.StringIO()
    runner.execute(ctx, runner.plan(ctx, PLANTED, "softmax,raises"), stream=stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[0].startswith("[1/3] pass") and "ops::softmax/reference/float32" in lines[0]
    assert lines[2].startswith("[3/3] error") and "RuntimeError: planted failure inside the case" in lines[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_one_line_on_a_terminal(ctx: Context) -> None:
    stream = _Terminal()
    runner.execute(ctx, runner.plan(ctx, PLANTED, "softmax,raises"), stream=stream)
    text = stream.getvalue()
    assert text.count("\r") == 5  # three redraws, the error's line, the final clear
    assert "[3/3] pass 2 fail 0 error 0" in text and "ops::gelu/reference/float32/raises/forward" in text
    lines = text.split("\n")
    assert len(lines) == 2 and lines[0].endswith(  # the error stays on screen; the progress line does not
        "error ops::gelu/reference/float32/raises/forward: RuntimeError: planted failure inside the case")


def test_a_selection_runs_only_its_part_of_the_shared_world_job() -> None:
    """``-k`` of two collectives cases: the world-2 job is handed those checks and no bandwidth sweep (it ran every
    check and the sweep, which on a stand-in took most of a selected run's time); a busbw case brings the sweep back."""
    from hal.backend_registry import get_backend
    from hal.conformance.cases import SELECTED_OPTION, Context
    from hal.conformance.suites.collective_checks import plan_checks
    from hal.conformance.suites.collectives import _Job

    backend = get_backend("cpu")
    checks = [c for c in plan_checks(["float32"]) if c.op in ("all_reduce", "gather")][:3]
    assert len(checks) == 3
    ctx = Context(backend, backend.device(0), backend.capabilities(0), max_world_size=2)
    job = _Job(ctx, 2, checks)
    assert [c["name"] for c in job._selected(ctx)["checks"]] == [c.name for c in checks]  # no selection said: all
    chosen = {f"collectives::{checks[1].name}/world2", f"collectives::{checks[2].name}/world4"}
    spec = job._selected(Context(backend, backend.device(0), backend.capabilities(0), options={SELECTED_OPTION: chosen}))
    assert [c["name"] for c in spec["checks"]] == [checks[1].name] and spec["bench_sizes"] == []
    chosen.add("collectives::busbw/all_reduce/float32/world2")
    spec = job._selected(Context(backend, backend.device(0), backend.capabilities(0), options={SELECTED_OPTION: chosen}))
    assert spec["bench_sizes"] == job.spec["bench_sizes"] != []


def test_a_selection_naming_its_suites_collects_only_those(ctx: Context) -> None:
    """``-k contract::*`` builds no other suite's cases (the ops suite's cost seconds: it loads the kernels); the
    suites it skipped keep their place in the plan; a pattern that may match any suite collects every one."""
    every = runner.plan(ctx, "precision,contract")
    contract = [c for c in every.cases if c.suite == "contract"]
    named = runner.plan(ctx, "precision,contract", "contract::*")
    assert [c.id for c in named.cases] == [c.id for c in contract] and named.collected == len(contract) < every.collected
    assert named.suites == ["precision", "contract"]
    both = runner.plan(ctx, "precision,contract", "contract::*,precision::*")
    assert both.collected == every.collected
    anywhere = runner.plan(ctx, "precision,contract", "*::*")  # a glob over the suite's name: every suite collected
    assert anywhere.collected == every.collected
