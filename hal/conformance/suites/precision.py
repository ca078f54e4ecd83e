"""Precision suite: does the backend compute in the precision it claims, and switch precision honestly?

Five groups of cases (``cases(ctx)``):

* ``autocast/<dtype>/<op>``: inside ``backend.autocast(dtype)`` each op's output dtype follows
  PyTorch's autocast op lists for the device type (lists in ``conformance.suites.precision_checks``);
* ``grad_scaler/skip_backoff_growth``: ``backend.grad_scaler()`` skips steps with inf/NaN gradients,
  backs the scale off, grows it after clean steps, and clean steps equal an unscaled reference step;
* ``matmul/<dtype>/K<k>`` and ``matmul/<dtype>/exactness_probe``: low-precision ``hal.ops.matmul``
  against the fp64 product of the same rounded inputs, its result dtype, and a probe that exposes a
  matmul computed in another format than asked; ``matmul/float8_e4m3fn/K<k>`` via hal.precision.fp8;
* ``reduced_precision/...``: fp32 matmuls are IEEE fp32 with the switch off; TF32/HF32 on really
  lowers the precision to the format's level and off restores it; no format means the switch refuses;
* ``policy/<mode>/<fallback>``: ``hal.precision.resolve_precision`` obeys rules over the device's
  declared capabilities.

Every case restores the global switches it may touch (``precision_checks.preserved_switches``).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable

import torch

from hal import ops
from hal.config import PRECISIONS
from hal.conformance.cases import CAPABILITY_KEY, Case, Context, Outcome, skip, unsupported
from hal.conformance.suites import precision_checks as pc
from hal.conformance.verdicts.profiles import judge_under
from hal.conformance.verdicts.tolerances import dtype_name, judge, tolerance_for
from hal.downgrades import DowngradeWarning, recorded_downgrades
from hal.errors import UnsupportedError
from hal.precision import resolve_precision

SUITE = "precision"
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
MATMUL_K: tuple[int, ...] = (64, 1024, 4096)
MATMUL_MN = 64  # rows of A and columns of B: small, so bf16/fp16 on a CPU stays cheap
REDUCED_SHAPE = (256, 4096, 256)  # M, K, N of the fp32 matmul behind the TF32/HF32 cases: tensor-core sized
PROBE_SHAPE = (32, 64)  # rows × K of the exactness probes
FALLBACKS: tuple[str, ...] = ("allow", "warn", "error")


def cases(ctx: Context) -> list[Case]:
    """Every precision case for the backend in ``ctx`` (cheap: nothing runs until ``case.run``)."""
    return [
        *_autocast_cases(ctx),
        *_grad_scaler_cases(ctx),
        *_matmul_cases(ctx),
        *_reduced_precision_cases(ctx),
        *_policy_cases(ctx),
    ]


def _case(name: str, fn: Callable[[Context], Outcome], description: str, *tags: str) -> Case:
    """A case whose run restores the global switches however it ends."""

    @functools.wraps(fn)
    def run(ctx: Context) -> Outcome:
        with pc.preserved_switches(ctx.backend):
            return fn(ctx)

    return Case(SUITE, name, run, description, ("precision", *tags))


def _generator(ctx: Context, salt: int) -> torch.Generator:
    """A host generator per case: inputs are reproducible and the global RNG is left alone."""
    return torch.Generator().manual_seed(ctx.seed * 1000 + salt)


def _fail(metric: str, reason: str, metrics: dict[str, float], tolerance: dict[str, float] | None = None,
          data: dict[str, Any] | None = None) -> Outcome:
    return Outcome("fail", metrics, tolerance or {}, metric, reason, data or {})


# --- 1. autocast ---------------------------------------------------------------------------------


def _autocast_cases(ctx: Context) -> list[Case]:
    out: list[Case] = []
    device_type = ctx.device.type
    for dtype in LOW_PRECISION:
        name = dtype_name(dtype)
        if not ctx.dtype_supported(dtype):
            reason = f"{name} is {ctx.capabilities.support(CAPABILITY_KEY[dtype])} on {ctx.capabilities.name}: no autocast to check"
            out.append(_case(f"autocast/{name}", lambda c, r=reason: unsupported(r), reason, "autocast"))
            continue
        for exp in pc.autocast_expectations(device_type):
            desc = (
                f"{exp.op} inside backend.autocast({name}) on device type {device_type}: {exp.why}; "
                f"fed {'float32' if exp.inputs == 'fp32' else name} inputs, its output must be "
                f"{'float32' if exp.expect == 'fp32' else name}"
            )
            out.append(_case(f"autocast/{name}/{exp.op}", functools.partial(_run_autocast_op, dtype=dtype, exp=exp), desc, "autocast"))
        out.append(_case(
            f"autocast/{name}/enabled_false", functools.partial(_run_autocast_disabled, dtype=dtype),
            f"backend.autocast({name}, enabled=False) must leave linear in float32", "autocast",
        ))
    return out


def _run_autocast_op(ctx: Context, dtype: torch.dtype, exp: pc.AutocastExpectation) -> Outcome:
    expected = exp.expected_dtype(dtype)
    if expected is None:
        return skip(f"{exp.op}: {exp.why}")
    fed = torch.float32 if exp.inputs == "fp32" else dtype
    gen = _generator(ctx, 11)
    data = {"op": exp.op, "autocast_dtype": dtype_name(dtype), "expected_dtype": dtype_name(expected)}
    try:
        with ctx.backend.autocast(dtype):
            found = pc.run_autocast_op(exp.op, ctx.device, fed, gen).dtype
    except RuntimeError as exc:  # e.g. cdist has no bfloat16 kernel: autocast did not run it in float32
        first = str(exc).splitlines()[0] if str(exc) else ""
        reason = (f"{exp.op} under autocast({dtype_name(dtype)}) raised {type(exc).__name__}: {first}; "
                  f"expected a {dtype_name(expected)} result ({exp.why})")
        return _fail("output_dtype_ok", reason, {"output_dtype_ok": 0.0}, {"output_dtype_ok": 1.0}, {**data, "found_dtype": "raised"})
    # Outside autocast again, an op fed float32 must give float32 (autocast left nothing behind);
    # ops fed low precision are not rerun: several (cdist, ...) have no low-precision kernel of their own.
    after = pc.run_autocast_op(exp.op, ctx.device, fed, gen).dtype if fed == torch.float32 else fed
    metrics = {"output_dtype_ok": float(found == expected), "dtype_after_exit_ok": float(after == fed)}
    data["found_dtype"] = dtype_name(found)
    tolerance = {"output_dtype_ok": 1.0, "dtype_after_exit_ok": 1.0}
    if found != expected:
        return _fail("output_dtype_ok",
                     f"{exp.op} under autocast({dtype_name(dtype)}) returned {dtype_name(found)}, expected {dtype_name(expected)} ({exp.why})",
                     metrics, tolerance, data)
    if after != fed:
        return _fail("dtype_after_exit_ok",
                     f"{exp.op} after leaving autocast({dtype_name(dtype)}) returned {dtype_name(after)}, "
                     f"expected {dtype_name(fed)}: autocast leaked",
                     metrics, tolerance, data)
    return Outcome("pass", metrics, tolerance, data=data)


def _run_autocast_disabled(ctx: Context, dtype: torch.dtype) -> Outcome:
    with ctx.backend.autocast(dtype, enabled=False):
        found = pc.run_autocast_op("linear", ctx.device, torch.float32, _generator(ctx, 12)).dtype
    metrics = {"output_dtype_ok": float(found == torch.float32)}
    if found != torch.float32:
        return _fail("output_dtype_ok", f"linear under autocast({dtype_name(dtype)}, enabled=False) returned {dtype_name(found)}, expected float32",
                     metrics, {"output_dtype_ok": 1.0})
    return Outcome("pass", metrics, {"output_dtype_ok": 1.0})


# --- 2. GradScaler --------------------------------------------------------------------------------

SCALER_STEPS: tuple[str, ...] = ("clean", "clean", "inf", "clean", "clean", "clean", "nan", "clean", "clean")
SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL = 2.0**10, 2.0, 0.5, 2


def _grad_scaler_cases(ctx: Context) -> list[Case]:
    desc = (
        f"backend.grad_scaler(init_scale={SCALER_INIT:g}, growth_factor={SCALER_GROWTH:g}, backoff_factor={SCALER_BACKOFF:g}, "
        f"growth_interval={SCALER_INTERVAL}) on a Linear(8, 4) + SGD(momentum) model over steps {','.join(SCALER_STEPS)} "
        "(inf/nan: one gradient entry set to inf/NaN after backward): those steps must be skipped (parameters "
        "bit-identical) and back the scale off; growth_interval clean steps grow it; clean steps must equal an "
        "unscaled reference optimizer step (elementwise float32 bound)"
    )
    return [_case("grad_scaler/skip_backoff_growth", _run_grad_scaler, desc, "grad_scaler")]


def _run_grad_scaler(ctx: Context) -> Outcome:
    scaler = ctx.backend.grad_scaler(
        init_scale=SCALER_INIT, growth_factor=SCALER_GROWTH, backoff_factor=SCALER_BACKOFF,
        growth_interval=SCALER_INTERVAL, enabled=True,
    )
    if not scaler.is_enabled():
        if ctx.device.type in ("cpu", "cuda"):
            return _fail("scaler_enabled", f"grad_scaler(enabled=True) returned a disabled scaler on {ctx.device.type}, "
                         "where torch.amp.GradScaler works", {"scaler_enabled": 0.0}, {"scaler_enabled": 1.0})
        return skip(f"backend {ctx.backend_name} returned a disabled GradScaler for enabled=True "
                    "(loss scaling not needed here?): nothing to check")
    gen = _generator(ctx, 21)
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.copy_(torch.randn(4, 8, generator=gen))
        model.bias.copy_(torch.randn(4, generator=gen))
    reference = torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    model.to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in SCALER_STEPS]
    expected_scale, expected_skip = pc.expected_scales(SCALER_STEPS, SCALER_INIT, SCALER_GROWTH, SCALER_BACKOFF, SCALER_INTERVAL)
    scales: list[float] = []
    skipped: list[bool] = []
    for kind, (x, y) in zip(SCALER_STEPS, batches):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device))
        scaler.scale(loss).backward()
        if kind != "clean":
            with torch.no_grad():
                model.weight.grad[0, 0] = math.inf if kind == "inf" else math.nan
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        ctx.backend.synchronize()
        skipped.append(pc.params_equal(before, [p.detach() for p in model.parameters()]))
        scales.append(float(scaler.get_scale()))
        if kind == "clean":
            ref_opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
    first_bad = SCALER_STEPS.index("inf")
    first_growth = SCALER_INTERVAL - 1
    assert first_growth < first_bad, "the schedule must grow the scale before its first inf step"
    params = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    ref_params = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).double()
    verdict = judge(params, ref_params, tolerance_for("elementwise", torch.float32), torch.float32)
    metrics = {
        "skipped_steps_expected": float(sum(expected_skip)),
        "skipped_steps_observed": float(sum(skipped)),
        "scale_after_backoff": scales[first_bad],
        "scale_after_backoff_expected": expected_scale[first_bad],
        "scale_after_growth": scales[first_growth],
        "scale_after_growth_expected": expected_scale[first_growth],
        "final_scale": scales[-1],
        "final_scale_expected": expected_scale[-1],
        "max_param_diff_vs_reference": verdict.metrics.get("max_abs", math.inf),
        "param_tol_ratio": verdict.metrics.get("tol_ratio", math.inf),
    }
    tolerance = {"param_tol_ratio": 1.0}
    data = {"steps": list(range(len(SCALER_STEPS))), "step_kind": list(SCALER_STEPS), "scale": scales,
            "expected_scale": expected_scale, "skipped": skipped, "expected_skipped": expected_skip}
    if skipped != expected_skip:
        wrong = [f"step {i} ({kind}): {'skipped' if got else 'applied'}"
                 for i, (kind, got, want) in enumerate(zip(SCALER_STEPS, skipped, expected_skip)) if got != want]
        return _fail("skipped_steps_observed",
                     f"skipped {sum(skipped)} step(s), expected {sum(expected_skip)} (the inf/NaN steps): " + "; ".join(wrong),
                     metrics, tolerance, data)
    # In step order: the first growth (step growth_interval-1) comes before the first backoff.
    if scales[first_growth] != expected_scale[first_growth]:
        return _fail("scale_after_growth", f"scale after {SCALER_INTERVAL} clean steps is {scales[first_growth]:g}, "
                     f"expected {expected_scale[first_growth]:g} (growth {SCALER_GROWTH:g})", metrics, tolerance, data)
    if scales[first_bad] != expected_scale[first_bad]:
        return _fail("scale_after_backoff", f"scale after the inf step is {scales[first_bad]:g}, "
                     f"expected {expected_scale[first_bad]:g} (backoff {SCALER_BACKOFF:g})", metrics, tolerance, data)
    if scales != expected_scale:
        i = next(i for i, (a, b) in enumerate(zip(scales, expected_scale)) if a != b)
        return _fail("final_scale", f"scale after step {i} is {scales[i]:g}, expected {expected_scale[i]:g}", metrics, tolerance, data)
    if not verdict.passed:
        return _fail("param_tol_ratio", f"parameters after the clean steps differ from the unscaled reference: {verdict.reason}",
                     metrics, tolerance, data)
    return Outcome("pass", metrics, tolerance, data=data)


# --- 3. low-precision matmul -------------------------------------------------------------------


def _matmul_cases(ctx: Context) -> list[Case]:
    out: list[Case] = []
    for dtype in LOW_PRECISION:
        name = dtype_name(dtype)
        if not ctx.dtype_supported(dtype):
            reason = f"{name} is {ctx.capabilities.support(CAPABILITY_KEY[dtype])} on {ctx.capabilities.name}"
            out.append(_case(f"matmul/{name}", lambda c, r=reason: unsupported(r), reason, "matmul"))
            continue
        u = pc.UNIT_ROUNDOFF[dtype]
        for k in MATMUL_K:
            desc = (
                f"hal.ops.matmul of {MATMUL_MN}x{k} by {k}x{MATMUL_MN} {name} inputs (fixed seed) against the float64 product of "
                f"the same rounded inputs: result dtype must be {name}; tol_ratio <= 1 under the matmul bound of "
                f"conformance.verdicts.tolerances; rel_l2 <= {pc.REL_L2_CONSTANT:g}*sqrt(K)*u with u = 2^{int(math.log2(u))} "
                f"(probabilistic dot-product bound, Higham & Mary 2019)"
            )
            out.append(_case(f"matmul/{name}/K{k}", functools.partial(_run_matmul, dtype=dtype, k=k), desc, "matmul"))
        impostor = ("float16 (overflow/flush: values outside float16's range)" if dtype == torch.bfloat16
                    else "bfloat16 (values with more mantissa bits than bfloat16 has)")
        out.append(_case(
            f"matmul/{name}/exactness_probe", functools.partial(_run_exactness_probe, dtype=dtype),
            f"hal.ops.matmul of {name} values by a permutation matrix must be exact; values are chosen "
            f"representable in {name} but not in {impostor}, so a matmul that really computes in another "
            "format than asked changes them", "matmul",
        ))
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for k in MATMUL_K:
        desc = (
            f"hal.precision.fp8.scaled_linear (e4m3, per-tensor scale) of {MATMUL_MN}x{k} by {k}x{MATMUL_MN}; inputs are exact e4m3 "
            "values with amax 448 so the scale is 1 and quantisation exact; bfloat16 output against the float64 product: "
            "tol_ratio <= 1 under the float8_e4m3fn matmul bound; rel_l2 <= sqrt(K)*2^-8 (only accumulation and the "
            "bfloat16 output rounding remain)"
        )
        out.append(_case(f"matmul/float8_e4m3fn/K{k}", functools.partial(_run_fp8_matmul, k=k, fp8=fp8), desc, "matmul", "fp8"))
    return out


def _run_matmul(ctx: Context, dtype: torch.dtype, k: int) -> Outcome:
    gen = _generator(ctx, 31 + k)
    a = torch.randn(MATMUL_MN, k, generator=gen).to(dtype)
    b = torch.randn(k, MATMUL_MN, generator=gen).to(dtype)
    result = ops.matmul(a.to(ctx.device), b.to(ctx.device))
    ctx.backend.synchronize()
    name = dtype_name(dtype)
    if result.dtype != dtype:
        return _fail("result_dtype", f"matmul asked in {name} returned a {dtype_name(result.dtype)} tensor",
                     {"result_dtype_ok": 0.0}, {"result_dtype_ok": 1.0})
    return _judge_matmul(result, a.double() @ b.double(), dtype, dtype, k, f"sqrt(K)*u = {{bound:.3g}} for {name}, K={k}",
                         ctx.verdict)


def _judge_matmul(result: torch.Tensor, expected: torch.Tensor, input_dtype: torch.dtype, result_dtype: torch.dtype,
                  k: int, bound_text: str, profile: str = "hal") -> Outcome:
    """The matmul table's tolerance (or the verdict profile's rule), then rel_l2 <= sqrt(K) x the result dtype's
    unit roundoff."""
    verdict, tol = judge_under(profile, result, expected, tolerance_for("matmul", input_dtype, k), result_dtype)
    bound = pc.rel_l2_bound(k, pc.UNIT_ROUNDOFF[result_dtype])
    metrics = {**verdict.metrics, "result_dtype_ok": 1.0, "rel_l2_bound": bound}
    tolerance = {"tol_ratio": 1.0, "rtol": tol.rtol, "atol": tol.atol, "rel_l2": bound}
    if not verdict.passed:
        return _fail(verdict.failed_metric or "tol_ratio", verdict.reason, metrics, tolerance)
    if metrics["rel_l2"] > bound:
        return _fail("rel_l2", f"rel_l2 {metrics['rel_l2']:.3g} exceeds " + bound_text.format(bound=bound), metrics, tolerance)
    return Outcome("pass", metrics, tolerance)


def _run_exactness_probe(ctx: Context, dtype: torch.dtype) -> Outcome:
    gen = _generator(ctx, 41)
    rows, k = PROBE_SHAPE
    a = pc.probe_values(dtype, (rows, k), gen)
    p = pc.permutation_matrix(k, gen, dtype)
    result = ops.matmul(a.to(ctx.device), p.to(ctx.device))
    ctx.backend.synchronize()
    name = dtype_name(dtype)
    if result.dtype != dtype:
        return _fail("result_dtype", f"matmul asked in {name} returned a {dtype_name(result.dtype)} tensor",
                     {"result_dtype_ok": 0.0}, {"result_dtype_ok": 1.0})
    wrong = pc.inexact_count(result, a.double() @ p.double())
    metrics = {"inexact_elements": float(wrong), "elements": float(result.numel()), "result_dtype_ok": 1.0}
    if wrong:
        other = "float16" if dtype == torch.bfloat16 else "bfloat16"
        return _fail("inexact_elements",
                     f"{wrong} of {result.numel()} entries of an exact {name} product (A @ permutation) changed: "
                     f"the matmul did not compute in {name} (consistent with {other})", metrics, {"inexact_elements": 0.0})
    return Outcome("pass", metrics, {"inexact_elements": 0.0})


def _fp8_inputs(rows: int, k: int, gen: torch.Generator, fp8: torch.dtype) -> torch.Tensor:
    """Exact e4m3 values whose amax is e4m3's max (448), so a per-tensor amax scale is exactly 1."""
    t = torch.randn(rows, k, generator=gen).mul(4).to(fp8).float()
    t[0, 0] = torch.finfo(fp8).max
    return t


def _run_fp8_matmul(ctx: Context, k: int, fp8: torch.dtype | None) -> Outcome:
    if not ctx.capabilities.is_native("fp8_e4m3"):
        return unsupported(f"fp8 e4m3 is {ctx.capabilities.support('fp8_e4m3')} on {ctx.capabilities.name}; "
                           "hal's fp8 path (torch._scaled_mm) needs native fp8")
    if fp8 is None or not hasattr(torch, "_scaled_mm"):
        return unsupported(f"torch {torch.__version__} lacks torch.float8_e4m3fn or torch._scaled_mm")
    from hal.precision.fp8 import scaled_linear

    gen = _generator(ctx, 51 + k)
    x = _fp8_inputs(MATMUL_MN, k, gen, fp8)
    w = _fp8_inputs(MATMUL_MN, k, gen, fp8)
    result = scaled_linear(x.to(ctx.device), w.to(ctx.device), fp8_dtype=fp8, out_dtype=torch.bfloat16)
    ctx.backend.synchronize()
    if result.dtype != torch.bfloat16:
        return _fail("result_dtype", f"fp8 matmul asked for a bfloat16 output returned {dtype_name(result.dtype)}",
                     {"result_dtype_ok": 0.0}, {"result_dtype_ok": 1.0})
    return _judge_matmul(result, x.double() @ w.double().t(), fp8, torch.bfloat16, k, f"sqrt(K)*2^-8 = {{bound:.3g}}, K={k}",
                         ctx.verdict)


# --- 4. reduced-precision fp32 matmul (TF32 / HF32) ------------------------------------------------------


def _reduced_precision_cases(ctx: Context) -> list[Case]:
    fmt = ctx.backend.reduced_precision_matmul_format
    m, k, n = REDUCED_SHAPE
    u32 = pc.UNIT_ROUNDOFF[torch.float32]
    fp32_bound = pc.rel_l2_bound(k, u32, pc.REDUCED_OFF_CONSTANT)
    out = [_case(
        "reduced_precision/off_is_ieee_fp32", _run_fp32_is_ieee,
        f"with the backend's reduced-precision switch off, hal.ops.matmul in float32 ({m}x{k}x{n}) is IEEE fp32: "
        f"rel_l2 vs float64 <= 2*sqrt(K)*2^-24 = {fp32_bound:.3g}, and a float32 exactness probe (24-bit mantissas "
        "times a permutation) stays exact — TF32/HF32/bf16 rounding of the inputs would change it", "reduced_precision",
    )]
    label = fmt or "none"
    if fmt is None:
        switch_desc = f"{ctx.backend_name} declares no reduced-precision fp32 matmul format: nothing to switch"
    else:
        u = pc.REDUCED_FORMAT_ROUNDOFF.get(fmt, math.nan)
        switch_desc = (
            f"set_reduced_precision_matmul(True) ({fmt.upper()}) must lower a {m}x{k}x{n} float32 matmul's accuracy to "
            f"the format's level: rel_l2 in [u/16, 2*sqrt(K)*u] with u = {u:.3g}; off again must restore "
            f"rel_l2 <= {fp32_bound:.3g}; reduced_precision_matmul_enabled() must report the state"
        )
    out.append(_case(f"reduced_precision/{label}/switch", _run_reduced_switch, switch_desc, "reduced_precision"))
    out.append(_case(
        "reduced_precision/refused_without_format", _run_refused_without_format,
        "a backend without a reduced-precision format must refuse set_reduced_precision_matmul(True) with "
        "UnsupportedError instead of silently doing nothing", "reduced_precision",
    ))
    return out


def _fp32_problem(ctx: Context) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-seed float32 A, B on the device and their float64 product on the host."""
    m, k, n = REDUCED_SHAPE
    gen = _generator(ctx, 61)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen)
    return a.to(ctx.device), b.to(ctx.device), a.double() @ b.double()


def _fp32_matmul_error(ctx: Context, problem: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    a, b, expected = problem
    result = ops.matmul(a, b)
    ctx.backend.synchronize()
    return pc.rel_l2(result, expected)


def _torch_fp32_matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # raised when the legacy and per-backend precision APIs were mixed
        return "unknown (per-backend fp32_precision settings in use)"


def _run_fp32_is_ieee(ctx: Context) -> Outcome:
    if ctx.backend.reduced_precision_matmul_enabled():
        ctx.backend.set_reduced_precision_matmul(False)
    k = REDUCED_SHAPE[1]
    bound = pc.rel_l2_bound(k, pc.UNIT_ROUNDOFF[torch.float32], pc.REDUCED_OFF_CONSTANT)
    err = _fp32_matmul_error(ctx, _fp32_problem(ctx))
    gen = _generator(ctx, 62)
    rows, pk = PROBE_SHAPE
    a = pc.probe_values(torch.float32, (rows, pk), gen)
    p = pc.permutation_matrix(pk, gen, torch.float32)
    probe = ops.matmul(a.to(ctx.device), p.to(ctx.device))
    ctx.backend.synchronize()
    wrong = pc.inexact_count(probe, a.double() @ p.double())
    metrics = {"rel_l2": err, "rel_l2_bound": bound, "inexact_elements": float(wrong)}
    tolerance = {"rel_l2": bound, "inexact_elements": 0.0}
    setting = f"torch float32_matmul_precision={_torch_fp32_matmul_precision()}"
    if err > bound:
        return _fail("rel_l2", f"float32 matmul rel_l2 {err:.3g} exceeds the fp32 bound {bound:.3g} with the switch off ({setting})",
                     metrics, tolerance)
    if wrong:
        return _fail("inexact_elements", f"{wrong} entries of an exact float32 product changed: inputs were rounded below fp32 ({setting})",
                     metrics, tolerance)
    return Outcome("pass", metrics, tolerance, reason=f"IEEE fp32 ({setting})")


def _run_reduced_switch(ctx: Context) -> Outcome:
    backend = ctx.backend
    fmt = backend.reduced_precision_matmul_format
    if fmt is None:
        return unsupported(
            f"{ctx.backend_name} declares no reduced-precision fp32 matmul format (TF32/HF32); fp32 matmuls stay "
            f"IEEE (see reduced_precision/off_is_ieee_fp32; torch float32_matmul_precision={_torch_fp32_matmul_precision()})"
        )
    u = pc.REDUCED_FORMAT_ROUNDOFF.get(fmt)
    if u is None:
        return unsupported(f"{ctx.backend_name} declares reduced-precision format {fmt!r}, whose precision this suite does not know")
    if backend.standin:  # the switch is there, the kernels that would round to it are not
        return unsupported(f"{ctx.backend_name} runs on a stand-in ({backend.standin}): its matmuls are the host's, so "
                           f"{fmt.upper()} rounding cannot show; not verified on hardware")
    problem = _fp32_problem(ctx)
    try:
        backend.set_reduced_precision_matmul(False)
        off = _fp32_matmul_error(ctx, problem)
        off_flag = backend.reduced_precision_matmul_enabled()
        try:
            backend.set_reduced_precision_matmul(True)
        except UnsupportedError as exc:
            return unsupported(f"{fmt.upper()} cannot be enabled here: {exc}")
        on_flag = backend.reduced_precision_matmul_enabled()
        on = _fp32_matmul_error(ctx, problem)
    finally:
        backend.set_reduced_precision_matmul(False)
    restored = _fp32_matmul_error(ctx, problem)
    restored_flag = backend.reduced_precision_matmul_enabled()
    return judge_reduced_switch(fmt, REDUCED_SHAPE[1], off, on, restored, (off_flag, on_flag, restored_flag))


def judge_reduced_switch(fmt: str, k: int, off: float, on: float, restored: float, flags: tuple[bool, bool, bool]) -> Outcome:
    """The verdict on a TF32/HF32 switch from the rel_l2 of the same fp32 matmul off, on and off again."""
    u = pc.REDUCED_FORMAT_ROUNDOFF[fmt]
    fp32_bound = pc.rel_l2_bound(k, pc.UNIT_ROUNDOFF[torch.float32], pc.REDUCED_OFF_CONSTANT)
    floor, ceiling = u * pc.REDUCED_ON_FLOOR, pc.rel_l2_bound(k, u, pc.REDUCED_ON_CONSTANT)
    metrics = {
        "rel_l2_off": off, "rel_l2_on": on, "rel_l2_restored": restored, "on_over_off": on / off if off > 0 else math.inf,
        "flag_off": float(flags[0]), "flag_on": float(flags[1]), "flag_restored": float(flags[2]),
    }
    tolerance = {"rel_l2_off": fp32_bound, "rel_l2_restored": fp32_bound, "rel_l2_on_min": floor, "rel_l2_on_max": ceiling}
    name = fmt.upper()
    if flags != (False, True, False):
        return _fail("enabled_flag", f"reduced_precision_matmul_enabled() reported {flags} for off/on/off", metrics, tolerance)
    if off > fp32_bound:
        return _fail("rel_l2_off", f"with {name} off, rel_l2 {off:.3g} exceeds the fp32 bound {fp32_bound:.3g}", metrics, tolerance)
    if on < floor:
        return _fail("rel_l2_on", f"{name} on did not lower precision: rel_l2 {on:.3g} (off {off:.3g}) is below the {name} level {floor:.3g}",
                     metrics, tolerance)
    if on > ceiling:
        return _fail("rel_l2_on", f"{name} on gave rel_l2 {on:.3g}, worse than {name}'s bound {ceiling:.3g}", metrics, tolerance)
    if restored > fp32_bound:
        return _fail("rel_l2_restored", f"turning {name} off did not restore fp32: rel_l2 {restored:.3g} > {fp32_bound:.3g}", metrics, tolerance)
    return Outcome("pass", metrics, tolerance)


def _run_refused_without_format(ctx: Context) -> Outcome:
    backend = ctx.backend
    if backend.reduced_precision_matmul_format is not None:
        return skip(f"{ctx.backend_name} declares {backend.reduced_precision_matmul_format.upper()}; see reduced_precision/<format>/switch")
    try:
        backend.set_reduced_precision_matmul(True)
    except UnsupportedError as exc:
        return Outcome("pass", {"refused": 1.0}, {"refused": 1.0}, reason=f"refused: {exc}")
    flag = backend.reduced_precision_matmul_enabled()
    return _fail("refused", f"set_reduced_precision_matmul(True) on a backend without a format did not raise (enabled() now {flag})",
                 {"refused": 0.0}, {"refused": 1.0})


# --- 5. precision policy -------------------------------------------------------------------------------


def _policy_cases(ctx: Context) -> list[Case]:
    support = pc.describe_support(ctx.capabilities)
    fmt = ctx.backend.reduced_precision_matmul_format
    out = []
    for mode in PRECISIONS:
        for fallback in FALLBACKS:
            desc = (
                f"resolve_precision({mode!r}, fallback={fallback!r}) on {ctx.capabilities.name} ({support}; reduced-precision "
                f"format {fmt}): a mode the device has natively resolves to itself with no downgrade; anything else is a "
                "recorded precision downgrade (refused under fallback=error, warned under warn) or, where nothing "
                "acceptable exists, UnsupportedError (always for fp8 without native fp8); the autocast dtype matches the "
                "mode, loss scaling is on exactly for fp16, only usable dtypes and the backend's own format are used, and "
                "plan.grad_scaler/plan.apply follow the plan"
            )
            out.append(_case(f"policy/{mode}/{fallback}", functools.partial(_run_policy, mode=mode, fallback=fallback), desc, "policy"))
    return out


def _run_policy(ctx: Context, mode: str, fallback: str) -> Outcome:
    backend, caps = ctx.backend, ctx.capabilities
    before = tuple(recorded_downgrades())
    outcome: Any
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DowngradeWarning)
        try:
            outcome = resolve_precision(mode, backend, caps, fallback)  # type: ignore[arg-type]
        except Exception as exc:  # the rules judge which exceptions are allowed
            outcome = exc
    obs = pc.PolicyObservation(
        mode, fallback, outcome, before, tuple(recorded_downgrades()),
        tuple(str(w.message) for w in caught if issubclass(w.category, DowngradeWarning)),
    )
    if not isinstance(outcome, BaseException):
        scaler_on = bool(outcome.grad_scaler(backend).is_enabled())
        if scaler_on != outcome.loss_scaling:
            obs.extra_violations.append(
                ("grad_scaler_follows_plan", f"plan.grad_scaler() enabled={scaler_on}, plan.loss_scaling={outcome.loss_scaling}"))
        outcome.apply(backend)  # the switches are restored by the case wrapper
        rpm_on = backend.reduced_precision_matmul_enabled()
        if rpm_on != (outcome.reduced_precision_matmul is not None):
            obs.extra_violations.append(
                ("apply_sets_switch", f"after plan.apply the reduced-precision switch is {rpm_on}, plan says {outcome.reduced_precision_matmul}"))
    broken = pc.policy_violations(obs, caps, backend.reduced_precision_matmul_format)
    result = outcome.describe() if not isinstance(outcome, BaseException) else f"{type(outcome).__name__}: {outcome}"
    metrics = {"rules_broken": float(len(broken)), "downgrades": float(len(getattr(outcome, "downgrades", ())))}
    data = {"result": result, "broken": [f"{r}: {why}" for r, why in broken]}
    if broken:
        rule, why = broken[0]
        more = f" (+{len(broken) - 1} more)" if len(broken) > 1 else ""
        return _fail("rules_broken", f"rule {rule}: {why}{more}", metrics, {"rules_broken": 0.0}, data)
    return Outcome("pass", metrics, {"rules_broken": 0.0}, reason=result, data=data)
