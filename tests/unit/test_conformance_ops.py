"""The ops conformance suite on the CPU: the reference passes, planted wrong implementations are caught."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from hal.backend_registry import get_backend
from hal.capabilities import DtypeSupport
from hal.conformance.cases import Context
from hal.conformance.runner import CaseResult, execute, plan_from_cases
from hal.conformance.suites import inputs
from hal.conformance.suites import ops as ops_suite
from hal.ops import registry
from hal.ops.registry import REFERENCE, OpRegistry

DTYPES = ("float32", "bfloat16", "float16", "float64")


@pytest.fixture(scope="module")
def ctx() -> Context:
    backend = get_backend("cpu")
    return Context(backend=backend, device=backend.device(0), capabilities=backend.capabilities())


def run_suite(ctx: Context, op: str | None = None) -> dict[str, CaseResult]:
    """Run the ops suite (only ``op``'s cases when given) through the conformance runner."""
    cases = [c for c in ops_suite.cases(ctx) if op is None or c.name.startswith(f"{op}/")]
    result = execute(ctx, plan_from_cases(cases), progress=False)
    return {r.name: r for r in result.results}


@contextmanager
def planted(op: str, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    """A deliberately wrong implementation in the real registry, winning on cpu, removed afterwards."""
    registry.register(op, name, backends=["cpu"], priority=1000, source="test: deliberately wrong")(fn)
    try:
        yield
    finally:
        registry.unregister(op, name)


def failing(results: dict[str, CaseResult]) -> dict[str, CaseResult]:
    return {n: r for n, r in results.items() if r.status in ("fail", "error")}


@pytest.fixture(scope="module")
def baseline(ctx: Context) -> dict[str, CaseResult]:
    return run_suite(ctx)


def test_every_op_impl_dtype_class_and_direction_is_a_case(baseline: dict[str, CaseResult]) -> None:
    expected = {f"{op}/{REFERENCE}/{dt}/{cls}/{d}"
                for op in registry.names() for dt in DTYPES for cls in inputs.classes(op) for d in ("forward", "backward")}
    assert set(baseline) == expected
    assert {n.split("/")[0] for n in baseline} == set(registry.names())


def test_reference_implementations_pass_on_cpu(baseline: dict[str, CaseResult]) -> None:
    bad = {n: (r.status, r.outcome.reason) for n, r in baseline.items() if r.status != "pass"}
    assert not bad
    for name, r in baseline.items():
        for metric in ("max_abs", "max_rel", "rel_l2", "cosine", "ulp", "tol_ratio", "nonfinite_mismatch"):
            assert metric in r.outcome.metrics, (name, metric)


def test_low_precision_cases_measure_real_error(baseline: dict[str, CaseResult]) -> None:
    """bf16 results are not bit-equal to the float64 reference: the comparison is not vacuous."""
    r = baseline["matmul/reference/bfloat16/normal/forward"]
    assert 0 < r.outcome.metrics["tol_ratio"] <= 1 and r.outcome.metrics["max_abs"] > 0


def test_widened_bounds_carry_their_reason(baseline: dict[str, CaseResult]) -> None:
    plain = baseline["matmul/reference/float32/normal/forward"].outcome.tolerance
    assert "override" not in plain and plain["atol"] == pytest.approx(1e-5 * 64)
    large = baseline["matmul/reference/float32/large/forward"].outcome.tolerance
    assert "natural magnitude" in large["override"] and large["atol"] == pytest.approx(1e-5 * 64 * 1e8)
    rotary = baseline["rotary_embedding/reference/bfloat16/normal/forward"].outcome.tolerance
    assert "bfloat16 intermediates" in rotary["override"]


def test_softmax_off_by_1e_2_is_flagged_and_nothing_else(ctx: Context) -> None:
    wrong = "test_softmax_plus_1e-2"
    with planted("softmax", wrong, lambda x, dim=-1: torch.softmax(x, dim) + 1e-2):
        results = run_suite(ctx)  # the whole suite: no other op's case moves
    bad = failing(results)
    assert bad, "the wrong softmax was not caught"
    assert all(n.startswith(f"softmax/{wrong}/") and n.endswith("/forward") for n in bad), sorted(bad)
    assert all(r.outcome.failed_metric == "tol_ratio" for r in bad.values())
    for dtype in ("float32", "float64"):  # 1e-2 is far outside every full-precision bound
        for cls in inputs.classes("softmax"):
            name = f"softmax/{wrong}/{dtype}/{cls}/forward"
            assert (name in bad) == (cls != "empty"), name
    for dtype in ("bfloat16", "float16"):
        assert f"softmax/{wrong}/{dtype}/normal/forward" in bad
    # a constant shift has the reference's gradient: the backward cases of the wrong impl pass
    assert results[f"softmax/{wrong}/float32/normal/backward"].status == "pass"
    assert results["softmax/reference/float32/normal/forward"].status == "pass"


def _rms_norm_without_eps(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)) * weight.to(xf.dtype)).to(x.dtype)


def test_rms_norm_ignoring_eps_is_caught_on_tiny_rows(ctx: Context) -> None:
    wrong = "test_rms_norm_no_eps"
    with planted("rms_norm", wrong, _rms_norm_without_eps):
        results = run_suite(ctx, "rms_norm")  # the softmax test shows a planted impl touches no other op
    bad = failing(results)
    tiny = {f"rms_norm/{wrong}/{dt}/tiny/{d}" for dt in DTYPES for d in ("forward", "backward")}
    assert tiny <= set(bad)
    # Elsewhere eps changes the result by ~eps/mean(x²) ≈ 1e-6 relative: visible only at fp64's precision.
    assert all("/float64/" in name for name in set(bad) - tiny), sorted(set(bad) - tiny)
    assert all(r.outcome.failed_metric == "tol_ratio" for r in bad.values())
    assert results[f"rms_norm/{wrong}/float32/normal/forward"].status == "pass"  # eps is invisible at O(1)


def test_an_impl_that_drops_nan_fails_on_nonfinite_mismatch(ctx: Context) -> None:
    wrong = "test_silu_drops_nan"
    with planted("silu", wrong, lambda x: torch.nan_to_num(torch.nn.functional.silu(x), nan=0.0)):
        results = run_suite(ctx, "silu")
    bad = failing(results)
    assert all(n.startswith(f"silu/{wrong}/") and "/nonfinite/" in n for n in bad), sorted(bad)
    for dtype in DTYPES:
        r = bad[f"silu/{wrong}/{dtype}/nonfinite/forward"]
        assert r.outcome.failed_metric == "nonfinite_mismatch"


def test_an_impl_that_refuses_an_input_class_is_unsupported_not_a_crash(ctx: Context) -> None:
    wrong = "test_gelu_contiguous_only"

    def contiguous_only(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        if not x.is_contiguous():
            raise NotImplementedError("this kernel needs a contiguous input")
        return torch.nn.functional.gelu(x, approximate=approximate)

    with planted("gelu", wrong, contiguous_only):
        results = run_suite(ctx, "gelu")
    refused = {n: r for n, r in results.items() if r.status == "unsupported"}
    assert set(refused) == {f"gelu/{wrong}/{dt}/noncontig/{d}" for dt in DTYPES for d in ("forward", "backward")}
    assert all("needs a contiguous input" in r.outcome.reason for r in refused.values())
    assert not failing(results)


def test_a_new_op_without_an_input_generator_is_reported_unsupported(ctx: Context) -> None:
    fresh = OpRegistry()  # a real registry: the standard ops (backends register theirs) plus one new op
    for name in registry.names():
        definition = registry.definition(name)
        reference = next(i for i in definition.impls if i.name == REFERENCE)
        fresh.define(name, reference.fn, dispatch_arg=definition.dispatch_arg, dtypes=definition.dtypes)
    fresh.define("frobnicate", lambda x: x * 2)
    cases = ops_suite.cases_for(ctx, fresh)
    new = [c for c in cases if c.name.startswith("frobnicate/")]
    assert [c.name for c in new] == ["frobnicate/no_input_generator"]
    outcome = new[0].run(ctx)
    assert outcome.status == "unsupported" and "no input generator" in outcome.reason


def test_dtypes_the_backend_does_not_declare_are_skipped_visibly(ctx: Context) -> None:
    caps = dataclasses.replace(ctx.capabilities, dtypes={**ctx.capabilities.dtypes, "fp64": DtypeSupport.ABSENT})
    narrow = dataclasses.replace(ctx, capabilities=caps)
    cases = ops_suite.cases(narrow)
    assert not [c for c in cases if "/float64/" in c.name and not c.name.endswith("/not_declared")]
    skipped = [c for c in cases if c.name.endswith("/float64/not_declared")]
    assert len(skipped) == len(registry.names())
    assert skipped[0].run(narrow).status == "skip"


@pytest.mark.parametrize("op", sorted(inputs.GENERATORS))
def test_input_classes_are_what_they_say(op: str) -> None:
    def tensors(sample: inputs.Sample) -> list[torch.Tensor]:
        args, kwargs = sample.build(sample.leaves)
        return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

    noncontig = tensors(inputs.sample(op, "noncontig", torch.float32, 0))
    assert any(not t.is_contiguous() for t in noncontig)
    nonfinite = inputs.sample(op, "nonfinite", torch.float32, 0)
    assert any(not torch.isfinite(t).all() for t in nonfinite.leaves.values() if t.is_floating_point())
    empty = tensors(inputs.sample(op, "empty", torch.float32, 0))
    assert any(t.numel() == 0 for t in empty)
    for dtype in (torch.float16, torch.bfloat16):  # every leaf is already a value of the dtype
        for t in inputs.sample(op, "normal", dtype, 0).leaves.values():
            if t.is_floating_point():
                assert torch.equal(t.to(dtype).double(), t)


def test_large_inputs_stay_inside_float16() -> None:
    """"large" scales each op's inputs as far as float16 allows, without overflowing the result."""
    ref = {i.op: i for name in registry.names() for i in registry.implementations(name) if i.name == REFERENCE}
    for op in inputs.GENERATORS:
        sample = inputs.sample(op, "large", torch.float16, 0)
        assert sample.scale > 1
        args, kwargs = sample.build(sample.leaves)
        result = ref[op].fn(*args, **kwargs)
        for out in result if isinstance(result, tuple) else (result,):  # add_rms_norm returns two tensors
            assert torch.isfinite(out).all() and out.abs().max() < torch.finfo(torch.float16).max, op


def test_same_seed_same_numbers() -> None:
    a = inputs.sample("linear", "normal", torch.float32, 7).leaves
    b = inputs.sample("linear", "normal", torch.float32, 7).leaves
    c = inputs.sample("linear", "normal", torch.float32, 8).leaves
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["x"], c["x"])


@pytest.mark.parametrize("seed", (0, 1, 5, 7, 10, 15))
def test_verdicts_do_not_depend_on_the_seed(ctx: Context, seed: int) -> None:
    """Every seed that once failed — 7 (layer_norm on a 1x1 input, whose true gradient is 0), 1, 5, 10 and 15
    (softmax and attention backward on large inputs, where the gradient cancels) — and 0, which never did (each
    seed runs the whole ops suite: 4-12 s on two busy cores, so not all of 0-20 every run)."""
    seeded = dataclasses.replace(ctx, seed=seed)
    bad = {n: r.outcome.reason for n, r in failing(run_suite(seeded)).items()}
    assert not bad, bad
