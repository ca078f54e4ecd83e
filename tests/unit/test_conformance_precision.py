"""The precision suite: it passes on the CPU backend, and it flags planted faults.

Faults are planted the way a vendor backend would get them wrong — subclasses of the real CPU
backend (a GradScaler that never skips, an autocast that does nothing, a TF32 switch that does
nothing) and a wrong matmul registered in hal's op registry — never by mocking torch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from typing import Any, Iterator

import pytest
import torch
from torch.amp.grad_scaler import OptState

from hal import get_backend, ops
from hal.backends.cpu import CpuBackend
from hal.capabilities import DTYPE_KEYS, DeviceCapabilities, DtypeSupport
from hal.config import PRECISIONS
from hal.conformance.cases import Context, Outcome
from hal.conformance.suites import precision
from hal.conformance.suites import precision_checks as pc
from hal.downgrades import DowngradeWarning, recorded_downgrades
from hal.errors import UnsupportedError
from hal.precision import PrecisionPlan, resolve_precision

N, E, A = DtypeSupport.NATIVE, DtypeSupport.EMULATED, DtypeSupport.ABSENT


def _ctx(backend: CpuBackend, **support: DtypeSupport) -> Context:
    caps = backend.capabilities(0)
    if support:
        caps = dataclasses.replace(caps, dtypes={**caps.dtypes, **support})
    return Context(backend, backend.device(0), caps)


def _run(ctx: Context, prefix: str = "") -> dict[str, Outcome]:
    return {c.name: c.run(ctx) for c in precision.cases(ctx) if c.name.startswith(prefix)}


# --- planted backends -------------------------------------------------------------------------------


class NeverSkippingScaler(torch.amp.GradScaler):
    """Planted fault: unscales and steps even when the gradients hold inf/NaN."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.unscale_(optimizer)  # records found_inf, so update() still backs off
        result = optimizer.step(*args, **kwargs)
        self._per_optimizer_states[id(optimizer)]["stage"] = OptState.STEPPED
        return result


class NeverSkippingScalerBackend(CpuBackend):
    def grad_scaler(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> Any:
        return NeverSkippingScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                   backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)


class ArgumentIgnoringBackend(CpuBackend):
    """Planted fault: overrides some of the caller's scaler arguments with its own constants."""

    def __init__(self, **own: float) -> None:
        self.own = own

    def grad_scaler(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> Any:
        args = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
                "growth_interval": growth_interval, **self.own}
        return torch.amp.GradScaler("cpu", enabled=enabled, **args)


class DisabledScalerBackend(CpuBackend):
    def grad_scaler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.amp.GradScaler("cpu", enabled=False)


class NoAutocastBackend(CpuBackend):
    """Planted fault: autocast is a no-op context."""

    def autocast(self, dtype: torch.dtype, enabled: bool = True) -> Any:
        return contextlib.nullcontext()


class NoOpTf32Backend(CpuBackend):
    """Planted fault: claims TF32 and remembers the switch, but matmuls never change."""

    reduced_precision_matmul_format = "tf32"

    def __init__(self) -> None:
        self.on = False

    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        self.on = bool(enabled)

    def reduced_precision_matmul_enabled(self) -> bool:
        return self.on


@contextlib.contextmanager
def planted_matmul(fn: Any, dtype: torch.dtype) -> Iterator[None]:
    """A wrong cpu matmul for ``dtype`` in hal's op registry (the way a vendor op would be added)."""
    ops.registry.register("matmul", "planted", backends=("cpu",), dtypes=(dtype,), priority=99)(fn)
    try:
        yield
    finally:
        ops.registry.unregister("matmul", "planted")


# --- the CPU backend passes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_outcomes() -> dict[str, Outcome]:
    backend = CpuBackend()
    before = pc.save_switches(backend)
    outcomes = _run(_ctx(backend))
    assert pc.save_switches(backend) == before, "the suite left a global switch changed"
    return outcomes


def test_cpu_cases_pass_or_say_why_not(cpu_outcomes: dict[str, Outcome]) -> None:
    bad = {n: (o.status, o.failed_metric, o.reason) for n, o in cpu_outcomes.items() if o.status not in ("pass", "skip", "unsupported")}
    assert not bad
    for name, o in cpu_outcomes.items():
        if o.status != "pass":
            assert o.reason, name
    groups = {name.split("/")[0] for name in cpu_outcomes}
    assert groups == {"autocast", "grad_scaler", "matmul", "reduced_precision", "policy"}
    # what the CPU lacks is reported, not passed: no fp8, no TF32/HF32 format
    assert {n for n, o in cpu_outcomes.items() if o.status == "unsupported"} == {
        "matmul/float8_e4m3fn/K64", "matmul/float8_e4m3fn/K1024", "matmul/float8_e4m3fn/K4096", "reduced_precision/none/switch",
    }
    assert "no reduced-precision fp32 matmul format" in cpu_outcomes["reduced_precision/none/switch"].reason
    assert "native fp8" in cpu_outcomes["matmul/float8_e4m3fn/K64"].reason


def test_cpu_case_inventory(cpu_outcomes: dict[str, Outcome]) -> None:
    per_dtype = len(pc.autocast_expectations("cpu")) + 1  # + enabled_false
    assert sum(n.startswith("autocast/") for n in cpu_outcomes) == 2 * per_dtype
    assert cpu_outcomes["autocast/bfloat16/softmax"].data["expected_dtype"] == "bfloat16"  # on no CPU list
    assert cpu_outcomes["autocast/float16/mse_loss"].data["found_dtype"] == "float32"
    assert sum(n.startswith("policy/") for n in cpu_outcomes) == len(PRECISIONS) * 3
    assert len(cpu_outcomes) == 76


def test_cpu_grad_scaler_metrics(cpu_outcomes: dict[str, Outcome]) -> None:
    m = cpu_outcomes["grad_scaler/skip_backoff_growth"].metrics
    assert m["skipped_steps_observed"] == m["skipped_steps_expected"] == 2
    assert m["scale_after_growth"] == 2.0**11 and m["scale_after_backoff"] == 2.0**10
    assert m["max_param_diff_vs_reference"] <= 1e-6


def test_cpu_matmul_rel_l2_within_the_stated_bound(cpu_outcomes: dict[str, Outcome]) -> None:
    for dtype, u in (("bfloat16", 2.0**-8), ("float16", 2.0**-11)):
        for k in precision.MATMUL_K:
            o = cpu_outcomes[f"matmul/{dtype}/K{k}"]
            assert o.tolerance["rel_l2"] == pytest.approx(k**0.5 * u)
            assert 0 < o.metrics["rel_l2"] <= o.tolerance["rel_l2"] and o.metrics["tol_ratio"] <= 1


# --- planted faults are flagged ---------------------------------------------------------------------


def test_a_scaler_that_never_skips_is_flagged() -> None:
    o = _run(_ctx(NeverSkippingScalerBackend()), "grad_scaler/")["grad_scaler/skip_backoff_growth"]
    assert o.status == "fail" and o.failed_metric == "skipped_steps_observed"
    assert (o.metrics["skipped_steps_expected"], o.metrics["skipped_steps_observed"]) == (2, 0)
    assert "step 2 (inf): applied" in o.reason and "step 6 (nan): applied" in o.reason


@pytest.mark.parametrize(("own", "metric"), [
    ({"growth_interval": 2000}, "scale_after_growth"),  # never grows within the run
    ({"backoff_factor": 0.25}, "scale_after_backoff"),
])
def test_a_scaler_ignoring_its_arguments_is_flagged(own: dict[str, float], metric: str) -> None:
    o = _run(_ctx(ArgumentIgnoringBackend(**own)), "grad_scaler/")["grad_scaler/skip_backoff_growth"]
    assert o.status == "fail" and o.failed_metric == metric
    assert o.metrics[metric] != o.metrics[f"{metric}_expected"]


def test_a_disabled_scaler_on_cpu_fails_rather_than_passes() -> None:
    o = _run(_ctx(DisabledScalerBackend()), "grad_scaler/")["grad_scaler/skip_backoff_growth"]
    assert o.status == "fail" and o.failed_metric == "scaler_enabled"


def test_a_no_op_autocast_is_flagged_per_op() -> None:
    outcomes = _run(_ctx(NoAutocastBackend()), "autocast/")
    linear = outcomes["autocast/bfloat16/linear"]
    assert linear.status == "fail" and linear.failed_metric == "output_dtype_ok"
    assert "linear" in linear.reason and "returned float32, expected bfloat16" in linear.reason
    loss = outcomes["autocast/float16/mse_loss"]
    assert loss.status == "fail" and "returned float16, expected float32" in loss.reason
    failed = {n.split("/")[2] for n, o in outcomes.items() if o.status == "fail"}
    assert failed == set(pc.LOWER_PRECISION_OPS) | set(pc.FP32_OPS_BOTH)
    # unlisted ops run in their input dtype with or without autocast: a no-op autocast cannot fail them
    assert outcomes["autocast/bfloat16/softmax"].status == "pass"


def test_a_tf32_switch_that_does_nothing_is_flagged() -> None:
    backend = NoOpTf32Backend()
    outcomes = _run(_ctx(backend), "reduced_precision/")
    o = outcomes["reduced_precision/tf32/switch"]
    assert o.status == "fail" and o.failed_metric == "rel_l2_on"
    assert o.metrics["rel_l2_on"] < o.tolerance["rel_l2_on_min"]
    assert outcomes["reduced_precision/refused_without_format"].status == "skip"
    assert backend.on is False  # the case put the switch back


def test_a_bf16_matmul_computed_in_fp16_is_caught_by_the_probe_only() -> None:
    def fp16_inside(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.half(), b.half()).to(a.dtype)

    with planted_matmul(fp16_inside, torch.bfloat16):
        outcomes = _run(_ctx(CpuBackend()), "matmul/bfloat16/")
    probe = outcomes["matmul/bfloat16/exactness_probe"]
    assert probe.status == "fail" and probe.failed_metric == "inexact_elements" and probe.metrics["inexact_elements"] > 0
    # ordinary inputs fit fp16: fp16's smaller error passes the bf16 bounds, as it honestly should
    assert all(outcomes[f"matmul/bfloat16/K{k}"].status == "pass" for k in precision.MATMUL_K)


def test_a_fp16_matmul_computed_in_bf16_is_caught() -> None:
    def bf16_inside(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.bfloat16(), b.bfloat16()).to(a.dtype)

    with planted_matmul(bf16_inside, torch.float16):
        outcomes = _run(_ctx(CpuBackend()), "matmul/float16/")
    assert outcomes["matmul/float16/exactness_probe"].failed_metric == "inexact_elements"


def test_a_matmul_returning_another_dtype_fails() -> None:
    def returns_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.float(), b.float())

    with planted_matmul(returns_fp32, torch.bfloat16):
        outcomes = _run(_ctx(CpuBackend()), "matmul/bfloat16/")
    for name, o in outcomes.items():
        assert o.status == "fail" and o.failed_metric == "result_dtype", name
        assert "returned a float32 tensor" in o.reason


# --- the fp8 path runs where fp8 is declared native (torch._scaled_mm runs on this CPU too) -------------------


def test_fp8_matmul_cases_run_where_fp8_is_declared_native() -> None:
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("torch lacks _scaled_mm")
    outcomes = _run(_ctx(CpuBackend(), fp8_e4m3=N), "matmul/float8_e4m3fn/")
    assert {o.status for o in outcomes.values()} == {"pass"}
    assert all(o.metrics["rel_l2"] <= o.tolerance["rel_l2"] for o in outcomes.values())


# --- the TF32/HF32 verdict, on real reduced-precision rounding -----------------------------------------


def _round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 rounded to ``bits`` stored mantissa bits (TF32: 10, HF32: 11), nearest, ties away from zero."""
    drop = 23 - bits
    i = x.view(torch.int32)
    return ((i + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)


@pytest.mark.parametrize(("fmt", "bits"), [("tf32", 10), ("hf32", 11)])
def test_switch_verdict_on_emulated_reduced_precision(fmt: str, bits: int) -> None:
    m, k, n = precision.REDUCED_SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    ref = a.double() @ b.double()
    off = pc.rel_l2(a @ b, ref)
    on = pc.rel_l2(_round_mantissa(a, bits) @ _round_mantissa(b, bits), ref)
    good = precision.judge_reduced_switch(fmt, k, off, on, off, (False, True, False))
    assert good.status == "pass", good.reason
    assert precision.judge_reduced_switch(fmt, k, off, off, off, (False, True, False)).failed_metric == "rel_l2_on"
    assert precision.judge_reduced_switch(fmt, k, off, on, on, (False, True, False)).failed_metric == "rel_l2_restored"
    assert precision.judge_reduced_switch(fmt, k, off, on, off, (False, False, False)).failed_metric == "enabled_flag"


@pytest.mark.parametrize(("dtype", "impostor"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.float32, None)])
def test_exactness_probe_separates_the_asked_format_from_an_impostor(dtype: torch.dtype, impostor: torch.dtype | None) -> None:
    g = torch.Generator().manual_seed(3)
    a = pc.probe_values(dtype, (16, 32), g)
    p = pc.permutation_matrix(32, g, dtype)
    exact = a.double() @ p.double()
    assert pc.inexact_count(torch.matmul(a, p), exact) == 0
    if impostor is None:  # float32's impostor: TF32 rounding of the inputs
        wrong = torch.matmul(_round_mantissa(a, 10), p)
    else:
        wrong = torch.matmul(a.to(impostor), p.to(impostor)).to(dtype)
    assert pc.inexact_count(wrong, exact) > 0


# --- tables and rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_autocast_tables_match_torchs_dispatcher(device_type: str) -> None:
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device_type]
    for exp in pc.autocast_expectations(device_type):
        names = pc.aten_names(exp.op, device_type)
        assert names, exp.op
        registered = [torch._C._dispatch_has_kernel_for_dispatch_key(n, key) for n in names]
        if exp.expect in ("lower", "fp32"):
            assert all(registered), (exp.op, names, key)
        else:
            assert exp.expect == "input" and not any(registered), (exp.op, names, key)


def test_each_op_call_reaches_the_aten_ops_the_table_names() -> None:
    g = torch.Generator().manual_seed(0)
    for op in pc._CALLS:
        with torch.autograd.profiler.profile() as prof:
            pc.run_autocast_op(op, torch.device("cpu"), torch.float32, g)
        seen = {e.name for e in prof.function_events}
        for name in {*pc.aten_names(op, "cpu"), *pc.aten_names(op, "cuda")}:
            assert name.split(".")[0] in seen, (op, name)


def test_other_device_types_check_only_what_both_lists_agree_on() -> None:
    exps = {e.op: e.expect for e in pc.autocast_expectations("npu")}
    assert all(exps[o] == "lower" for o in pc.LOWER_PRECISION_OPS)
    assert all(exps[o] == "fp32" for o in pc.FP32_OPS_BOTH)
    assert all(exps[o] == "unknown" for o in pc.FP32_OPS_CUDA_ONLY)


def _caps(**support: DtypeSupport) -> DeviceCapabilities:
    dtypes = {k: N for k in DTYPE_KEYS} | support
    return DeviceCapabilities("x", "grid device", None, "x", "grid device", None, None, None, {k: None for k in DTYPE_KEYS}, dtypes, {})


def _observe(mode: str, fallback: str, backend: Any, caps: DeviceCapabilities) -> pc.PolicyObservation:
    before = tuple(recorded_downgrades())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DowngradeWarning)
        try:
            outcome: Any = resolve_precision(mode, backend, caps, fallback)  # type: ignore[arg-type]
        except Exception as exc:
            outcome = exc
    return pc.PolicyObservation(mode, fallback, outcome, before, tuple(recorded_downgrades()), tuple(str(w.message) for w in caught))


def test_policy_rules_agree_with_resolve_precision_over_a_capability_grid() -> None:
    backends = {None: get_backend("cpu"), "tf32": get_backend("cuda"), "hf32": get_backend("ascend")}
    checked = 0
    with pc.preserved_switches(CpuBackend()):
        for tf32, bf16, fp16, fp8, fmt in itertools.product((N, A), (N, E, A), (N, E, A), (N, E), backends):
            caps = _caps(tf32=tf32, bf16=bf16, fp16=fp16, fp8_e4m3=fp8)
            for mode, fallback in itertools.product(PRECISIONS, ("allow", "warn", "error")):
                obs = _observe(mode, fallback, backends[fmt], caps)
                assert pc.policy_violations(obs, caps, fmt) == [], (mode, fallback, fmt, pc.describe_support(caps), obs.outcome)
                checked += 1
    assert checked == 2 * (3 * 3 * 2) * 3 * len(PRECISIONS) * 3  # every tf32 x bf16 x fp16 x fp8 x format combination


def test_policy_rules_flag_wrong_plans() -> None:
    no_bf16 = _caps(bf16=A, fp16=N)
    silent = PrecisionPlan("bf16-mixed", "bf16-mixed", torch.bfloat16, False, None, None)
    rules = {r for r, _ in pc.policy_violations(pc.PolicyObservation("bf16-mixed", "allow", silent), no_bf16, None)}
    assert {"dtype_usable", "downgrade_recorded"} <= rules
    fake_fp8 = PrecisionPlan("fp8-mixed", "fp8-mixed", torch.bfloat16, False, None, getattr(torch, "float8_e4m3fn", None))
    rules = {r for r, _ in pc.policy_violations(pc.PolicyObservation("fp8-mixed", "allow", fake_fp8), _caps(fp8_e4m3=E), None)}
    assert {"fp8_refused", "fp8_only_native"} <= rules
    refused = pc.PolicyObservation("tf32", "allow", UnsupportedError("no"))
    assert [r for r, _ in pc.policy_violations(refused, _caps(tf32=A), None)] == ["refusal_allowed"]
    # a downgrade accepted under warn without a warning
    with pc.preserved_switches(CpuBackend()):
        obs = _observe("bf16-mixed", "warn", get_backend("cpu"), no_bf16)
    assert pc.policy_violations(obs, no_bf16, None) == []
    quiet = dataclasses.replace(obs, warnings=())
    assert [r for r, _ in pc.policy_violations(quiet, no_bf16, None)] == ["warned"]


def test_policy_cases_pass_on_other_capabilities() -> None:
    outcomes = _run(_ctx(CpuBackend(), bf16=A, fp16=N), "policy/")
    assert {o.status for o in outcomes.values()} == {"pass"}, {n: o.reason for n, o in outcomes.items() if o.status != "pass"}
    assert outcomes["policy/bf16-mixed/allow"].reason.startswith("fp16-mixed")
    assert outcomes["policy/bf16-mixed/error"].data["result"].startswith("FallbackRefused")


def test_preserved_switches_restores_after_an_exception() -> None:
    backend = CpuBackend()
    before = pc.save_switches(backend)
    with pytest.raises(RuntimeError):
        with pc.preserved_switches(backend):
            torch.set_default_dtype(torch.float64)
            backend.set_deterministic(True)
            raise RuntimeError("inside a case")
    assert pc.save_switches(backend) == before
