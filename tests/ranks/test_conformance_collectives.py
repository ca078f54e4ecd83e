"""The collectives conformance suite on real gloo ranks: it passes the real Communicator, flags a planted
wrong all_reduce by name, marks CCL gaps unsupported, and a hung or crashed job leaves no process behind."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hal import get_backend
from hal.conformance.cases import Context
from hal.conformance.jobs.launch import JobFailed, run_job
from hal.conformance.suites import collectives as suite
from hal.conformance.suites.collective_checks import plan_checks

from ..dist_harness import run_function_forked

PLANTED = "tests.planted_collectives:make"


def _ctx(slots: int = 4, backend: str = "cpu", **options: object) -> Context:
    cpu = get_backend("cpu")
    return Context(get_backend(backend), torch.device("cpu"), cpu.capabilities(), max_world_size=slots, options=dict(options),
                   launch=run_function_forked)


def _run_all(ctx: Context) -> dict[str, object]:
    return {case.name: case.run(ctx) for case in suite.cases(ctx)}


def _gone(pid: int) -> bool:
    proc = Path(f"/proc/{pid}/cmdline")
    try:
        return b"hal.conformance.jobs.worker" not in proc.read_bytes()
    except OSError:
        return True


@pytest.fixture(scope="module")
def clean_suite() -> tuple[Context, list]:
    """The suite's cases at world sizes 2 and 4 (the CPU runner's 4 slots): one job per world size, run once."""
    ctx = _ctx(4)
    return ctx, suite.cases(ctx)


@pytest.fixture(scope="module")
def clean_run(clean_suite: tuple[Context, list]) -> dict[str, object]:
    ctx, cases = clean_suite
    return {case.name: case.run(ctx) for case in cases}


def test_a_wrong_accumulation_declaration_is_caught_by_the_probe_and_missed_by_the_old_checks(
        clean_suite: tuple[Context, list], clean_run: dict[str, object]) -> None:
    """gloo rounds every bf16 partial sum to bf16; a backend declaring that its bf16 sums accumulate wide (fp32,
    rounded once) is the planted fault. The probe at 4 ranks fails it, naming both kinds; at 2 ranks one addition
    cannot tell them apart (pass); every tolerance-based bf16 all_reduce case passes the same library."""
    ctx, cases = clean_suite
    claims_wide = Context(ctx.backend, ctx.device, ctx.capabilities, max_world_size=ctx.max_world_size,
                          options={"ccl_accumulation": {"bfloat16": "wide"}}, launch=ctx.launch)
    probes = {case.name: case.run(claims_wide) for case in cases if case.name.startswith("reduction_probe/")}
    bf16 = probes["reduction_probe/all_reduce/bfloat16/world4"]
    assert bf16.status == "fail" and bf16.failed_metric == "matches_declared", bf16.reason
    assert "declared to accumulate bfloat16 sums in a wider accumulator" in bf16.reason
    assert "bitwise rounding every partial sum to the dtype" in bf16.reason
    assert probes["reduction_probe/all_reduce/bfloat16/world2"].status == "pass"
    assert probes["reduction_probe/all_reduce/float32/world4"].status == "pass"  # declared as gloo does: confirmed
    assert "confirmed" in probes["reduction_probe/all_reduce/float32/world4"].reason
    old = {n: o.status for n, o in clean_run.items() if n.startswith("all_reduce/") and "/bfloat16/" in n}
    assert old and set(old.values()) == {"pass"}, old


def test_every_op_and_dtype_passes_on_gloo(clean_run: dict[str, object]) -> None:
    bad = {name: (o.status, o.reason) for name, o in clean_run.items() if o.status != "pass"}
    assert not bad, bad
    names = set(clean_run)
    for n in (2, 4):
        for op in ("all_reduce/sum", "all_reduce/avg", "all_reduce/max", "all_reduce/min", "all_reduce/product"):
            for dtype in ("float32", "bfloat16", "float16"):
                assert f"{op}/{dtype}/int/world{n}" in names and f"{op}/{dtype}/random/world{n}" in names
        for op in ("all_gather", "all_gather_uneven", "reduce_scatter/sum", "all_to_all", "all_to_all_uneven", "all_to_all_skewed",
                   "broadcast", "reduce/sum", "gather", "scatter", "send_recv", "batch_p2p_ring"):
            assert any(name.startswith(f"{op}/int64") and name.endswith(f"/world{n}") for name in names), (op, n)
    exact = clean_run["all_reduce/sum/bfloat16/int/world4"]
    assert exact.metrics["mismatches"] == 0 and exact.metrics["elements"] == 4 * 1031  # every rank compared
    fp16 = clean_run["all_reduce/sum/float16/random/world4"]
    assert fp16.tolerance["override"] and fp16.tolerance["rtol"] > 1e-3  # 3 roundings exceed the table: widened, with reason
    assert fp16.metrics["tol_ratio"] <= 1.0


def test_probes_report_determinism_and_size_dependence(clean_run: dict[str, object]) -> None:
    det = clean_run["determinism/all_reduce/bfloat16/world4"]
    assert det.metrics["nondeterministic_elements"] == 0 and det.metrics["repeats"] == 5
    sweep = clean_run["size_sweep/all_reduce/bfloat16/world4"]
    assert sweep.metrics["bitwise_equal_across_sizes"] in (0.0, 1.0)
    assert len(sweep.data["sizes_elements"]) == len(sweep.data["tol_ratio"]) == 3
    assert max(sweep.data["tol_ratio"]) == sweep.metrics["tol_ratio"] <= 1.0


def test_busbw_tables_come_from_the_bench(clean_run: dict[str, object]) -> None:
    from hal.collectives.bench import OPS

    for n in (2, 4):
        for op in OPS:
            o = clean_run[f"busbw/{op}/float32/world{n}"]
            assert o.data["op"] == op and o.data["dtype"] == "float32"
            assert o.data["sizes_bytes"] == sorted(o.data["sizes_bytes"]) and len(o.data["sizes_bytes"]) >= 2
            assert len(o.data["busbw_gbs"]) == len(o.data["sizes_bytes"]) and all(b > 0 for b in o.data["busbw_gbs"])
            assert o.metrics["wrong"] == 0


def test_planted_all_reduce_fault_is_flagged_by_metric() -> None:
    """Rank 1 drops its contribution to every all_reduce: those cases fail, naming the metric; others pass."""
    outcomes = _run_all(_ctx(4, communicator_factory=PLANTED, collectives_world_sizes=[2]))
    reduce_cases = {n: o for n, o in outcomes.items() if n.startswith("all_reduce/")}
    assert reduce_cases and all(o.status == "fail" for o in reduce_cases.values()), {
        n: o.status for n, o in reduce_cases.items() if o.status != "fail"}
    assert outcomes["all_reduce/sum/float32/int/world2"].failed_metric == "mismatches"
    assert outcomes["all_reduce/sum/float32/random/world2"].failed_metric == "tol_ratio"
    assert outcomes["size_sweep/all_reduce/float32/world2"].failed_metric == "tol_ratio"
    assert outcomes["busbw/all_reduce/float32/world2"].failed_metric == "wrong"
    for untouched in ("broadcast/float32/world2", "all_gather/bfloat16/world2", "reduce_scatter/sum/float32/int/world2",
                      "send_recv/int64/world2", "busbw/broadcast/float32/world2"):
        assert outcomes[untouched].status == "pass", (untouched, outcomes[untouched].reason)


def test_unimportable_factory_is_an_error_with_the_reason() -> None:
    outcomes = _run_all(_ctx(2, communicator_factory="no_such_module:make"))
    assert {o.status for o in outcomes.values()} == {"error"}
    assert "cannot be imported" in outcomes["broadcast/float32/world2"].reason


def test_a_job_past_its_deadline_makes_its_cases_errors() -> None:
    outcomes = _run_all(_ctx(2, collectives_timeout_s=1))
    assert {o.status for o in outcomes.values()} == {"error"}
    assert "timed out after 1 s" in outcomes["all_gather/float32/world2"].reason


def test_ccl_gaps_are_unsupported_with_the_gaps_reason() -> None:
    """Ascend's declared HCCL gaps (no float64 reductions, no bf16 product) come out as unsupported cases."""
    by_name = {c.name: c for c in suite.cases(_ctx(2, backend="ascend"))}
    gap = by_name["all_reduce/sum/float64/int/world2"].run(_ctx(2, backend="ascend"))
    assert gap.status == "unsupported" and "hccl" in gap.reason.lower() and "float64" in gap.reason
    prod = by_name["all_reduce/product/bfloat16/random/world2"].run(_ctx(2, backend="ascend"))
    assert prod.status == "unsupported" and "bfloat16" in prod.reason


def test_one_slot_means_skip_not_silence() -> None:
    (only,) = suite.cases(_ctx(1))
    outcome = only.run(_ctx(1))
    assert outcome.status == "skip" and "1 process slot" in outcome.reason


def test_world_sizes_follow_the_slots() -> None:
    assert suite.world_sizes(_ctx(4)) == [2, 4]
    assert suite.world_sizes(_ctx(8)) == [2, 4, 8]
    assert suite.world_sizes(_ctx(3)) == [2, 3]
    with pytest.raises(ValueError, match="collectives_world_sizes"):
        suite.world_sizes(_ctx(2, collectives_world_sizes=[4]))


def test_exactness_limits_are_respected() -> None:
    """A product over 18 ranks cannot stay exact in bf16 (2^9 > 256): skipped with the reason, not run wrong."""
    from hal.conformance.suites.collective_checks import not_runnable

    check = next(c for c in plan_checks(["bfloat16"]) if c.name == "all_reduce/product/bfloat16/int")
    assert not_runnable(get_backend("cpu"), check, 18) == ("skip", "a product over 18 ranks cannot stay exact in bfloat16")
    assert not_runnable(get_backend("cpu"), check, 4) is None


def test_a_hung_job_is_killed_at_its_deadline() -> None:
    with pytest.raises(JobFailed, match="timed out after 8 s") as info:
        run_job(run_function_forked, "tests.planted_collectives:hang", {}, 2, "cpu", timeout_s=8, collective_timeout_s=120)
    assert info.value.pids and all(_gone(pid) for pid in info.value.pids)


@pytest.mark.parametrize("job", ["crash", "crash_slowly"])
def test_a_crashed_rank_is_named_and_the_rest_stopped(job: str) -> None:
    """crash_slowly: the rank that lost its peer ends first; the launcher waits for the crashing rank to end on its
    own, so the report names the crash, not its victim."""
    with pytest.raises(JobFailed, match="rank 1 failed .*planted crash on rank 1") as info:
        run_job(run_function_forked, f"tests.planted_collectives:{job}", {}, 2, "cpu", timeout_s=120,
                collective_timeout_s=120)
    assert all(_gone(pid) for pid in info.value.pids)
