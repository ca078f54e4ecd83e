"""Verdict profiles: the same result judged by our table, torch.testing's defaults and the CANN mixed-tolerance rule
(99 % of elements within rtol/atol, the largest error within 32 ULP of its golden value), and what a report says."""
from __future__ import annotations

import torch

from hal.conformance.verdicts.profiles import CANN_TOL, judge_under, looser_than
from hal.conformance.verdicts.tolerances import tolerance_for


def _golden(n: int = 1000) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, n, dtype=torch.float64)


def test_cann_needs_99_percent_of_elements_within_its_bound_and_caps_the_largest_at_32_ulp() -> None:
    g = _golden()
    tol = tolerance_for("elementwise", torch.bfloat16)
    rtol, atol = CANN_TOL[torch.bfloat16]
    exact = g.to(torch.bfloat16)
    assert judge_under("cann", exact, g, tol, torch.bfloat16)[0].passed
    # 2 % of the elements just outside rtol/atol (each within 32 ULP): fails on the share, not on the cap
    off = g.clone()
    off[:20] += (atol + rtol * g[:20].abs()) * 1.5
    verdict, bound = judge_under("cann", off, g, tol, torch.bfloat16)
    assert not verdict.passed and verdict.failed_metric == "pass_share" and verdict.metrics["pass_share"] == 0.98
    assert bound.reason == "verdict profile cann"
    # 0.5 % outside: the share passes, and so does the cap
    off = g.clone()
    off[:5] += (atol + rtol * g[:5].abs()) * 1.5
    assert judge_under("cann", off, g, tol, torch.bfloat16)[0].passed
    # one element 40 ULP away: the share passes (99.9 %), the cap does not
    ulp = 2.0 ** (torch.floor(torch.log2(g[0])) - 7)
    off = g.clone()
    off[0] += 40 * ulp
    verdict = judge_under("cann", off, g, tol, torch.bfloat16)[0]
    assert not verdict.passed and verdict.failed_metric == "ulp_cap_ratio" and verdict.metrics["pass_share"] >= 0.99
    nan = g.clone()
    nan[3] = float("nan")
    assert judge_under("cann", nan, g, tol, torch.bfloat16)[0].failed_metric == "nonfinite_mismatch"


def test_torch_profile_uses_assert_close_defaults_and_exact_cases_stay_bitwise_under_every_profile() -> None:
    g = _golden()
    tol = tolerance_for("elementwise", torch.bfloat16)  # ours: atol 1e-4
    off = g.clone()
    off[0] = 5e-5  # near zero: within our atol 1e-4, outside torch's 1e-5
    ref = g.clone()
    ref[0] = 0.0
    assert judge_under("hal", off, ref, tol, torch.bfloat16)[0].passed
    verdict, bound = judge_under("torch", off, ref, tol, torch.bfloat16)
    assert not verdict.passed and (bound.rtol, bound.atol) == (1.6e-2, 1e-5)
    exact = tolerance_for("exact", torch.bfloat16)
    nudged = g.clone()
    nudged[0] += 1e-12
    for profile in ("hal", "torch", "cann"):
        assert not judge_under(profile, nudged, g, exact, torch.bfloat16)[0].passed
    fp64 = tolerance_for("elementwise", torch.float64)
    verdict, bound = judge_under("cann", g, g, fp64, torch.float64)  # cann has no fp64 rule: ours, said
    assert verdict.passed and "no float64 rule" in bound.reason


def test_the_report_says_where_our_default_is_looser_than_the_profile() -> None:
    assert looser_than("hal") == []
    assert [x.dtype for x in looser_than("cann")] == ["bfloat16"]
    assert "rtol 0.016 > cann's 0.0156" in looser_than("cann")[0].line("cann")
    assert {x.dtype for x in looser_than("torch")} == {"float16", "bfloat16"}  # our atol 1e-4 against torch's 1e-5



def test_cross_device_levels_grade_b_by_the_three_ratios_of_its_error_to_a_s() -> None:
    from hal.conformance.reports import levels

    a = {"metrics": {"mean_rel": 1e-3, "max_rel": 1e-2, "rmse": 1e-4}}

    def b(mean: float, most: float, rms: float) -> dict:
        return {"metrics": {"mean_rel": 1e-3 * mean, "max_rel": 1e-2 * most, "rmse": 1e-4 * rms}}

    assert levels.grade(levels.ratios(a, b(1, 1, 1))) == "L2"
    assert levels.grade(levels.ratios(a, b(2, 1.2, 1.2))) == "L2"
    assert levels.grade(levels.ratios(a, b(3, 1.2, 1.2))) == "L1"  # mean_rel over L2's 2
    assert levels.grade(levels.ratios(a, b(1, 1.8, 1))) == "L0"  # max_rel over L1's 1.5
    assert levels.grade(levels.ratios(a, b(11, 1, 1))) == "fail"
    exact = {"metrics": {"mean_rel": 0.0, "max_rel": 0.0, "rmse": 0.0}}
    assert levels.grade(levels.ratios(exact, {"metrics": {"mean_rel": 5e-7, "max_rel": 5e-7, "rmse": 0.0}})) == "L2"  # floors
    assert levels.ratios(a, {"metrics": {"max_rel": 1.0}}) is None  # ungraded
    # the rmse floor scales with the golden: float32 noise on values of magnitude ~100 is not a 100x ratio
    big = {"metrics": {"mean_rel": 1e-7, "max_rel": 1e-7, "rmse": 1e-11, "golden_rms": 100.0}}
    noisy = {"metrics": {"mean_rel": 1e-7, "max_rel": 1e-7, "rmse": 3e-5, "golden_rms": 100.0}}
    assert levels.grade(levels.ratios(big, noisy)) == "L2"
    assert levels.grade(levels.ratios(big, {"metrics": {**noisy["metrics"], "rmse": 3e-4}})) == "fail"  # 3x the floor
    # a golden that is 0 in exact arithmetic: a 1e-17 error is a relative error of 1, but B is at the floor
    zero = {"metrics": {"mean_rel": 0.0, "max_rel": 0.0, "rmse": 0.0, "golden_rms": 1e-17}}
    assert levels.grade(levels.ratios(zero, {"metrics": {"mean_rel": 1.0, "max_rel": 1.0, "rmse": 1e-17}})) == "L2"
    assert levels.op_and_dtype("ops::softmax/reference/bfloat16/normal/forward") == ("ops::softmax", "bfloat16")
    assert levels.matrix([("ops::softmax/r/bfloat16/x/forward", "L2"), ("ops::softmax/r/bfloat16/y/backward", "L0")]) == \
        {"ops::softmax": {"bfloat16": "L0"}}


def test_the_reduction_probe_names_how_a_library_sums() -> None:
    """Simulated libraries (a ring rounding every hop in bf16; a wide accumulator rounding once) are told apart on the
    probe's inputs at 4 ranks; at 2 ranks one addition cannot tell any of them apart, and the line says so."""
    from hal.conformance.suites.collective_checks import Check, classify, describe, probe_inputs, reduction_models

    check = Check("reduction_probe/all_reduce/bfloat16", "reduction_probe", "bfloat16", "sum", "probe")
    xs = [probe_inputs(check, r, 4, 1234) for r in range(4)]
    for library in ("ring-3", "wide_once", "rank_order"):
        models, shares = classify(reduction_models(xs)[library], xs)
        assert models == [library], (library, shares)
    assert "in ring order" in describe(["ring-3"], {}) and "rounds once" in describe(["wide_once"], {})
    two = xs[:2]
    models, shares = classify(reduction_models(two)["wide_once"], two)
    assert len(models) == len(shares) and "not told apart" in describe(models, shares)
    noisy = reduction_models(xs)["wide_once"].clone()
    noisy[0] = noisy[0] * 2 + 1
    models, shares = classify(noisy, xs)
    assert models == [] and "matches none" in describe(models, shares)


def test_compare_says_whether_two_libraries_can_agree_bitwise() -> None:
    """A ring rounding every hop against a wide accumulator: cannot agree; the same ring on both: can; a library
    matching no model: cannot tell. Each from the models each run's probe recorded."""
    from hal.conformance.reports.compare import compare

    def run(models: dict[str, list[str] | None]) -> dict:
        cases = [{"id": f"collectives::reduction_probe/all_reduce/{dtype}/world4", "status": "pass",
                  "metrics": {"bound_ratio": 0.1}, "tolerance": {"bound_ratio": 1.0}, "reason": "",
                  "data": {} if found is None else {"models": found}} for dtype, found in models.items()]
        return {"cases": cases}

    a = run({"bfloat16": ["ring-3"], "float32": ["ring-3"], "float16": ["wide_once"], "int8": ["ring-3"]})
    b = run({"bfloat16": ["wide_once"], "float32": ["ring-3", "ring+1"], "float16": [], "int8": None})
    lines = {r["case"].split("/")[2]: r for r in compare(a, b).reductions}
    assert set(lines) == {"bfloat16", "float32", "float16"}  # int8: B did not run the probe
    assert lines["bfloat16"]["agree_bitwise"] is False and "A sums as ring-3, B as wide_once" in lines["bfloat16"]["line"]
    assert lines["float32"]["agree_bitwise"] is True and "both sum as ring-3" in lines["float32"]["line"]
    assert lines["float16"]["agree_bitwise"] is None and "B's sum matches none" in lines["float16"]["line"]
