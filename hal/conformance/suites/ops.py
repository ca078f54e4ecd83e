"""The ops suite: every HAL op × every implementation the backend dispatches to × dtype × input class × direction.

Each case computes one implementation of one op on ``ctx.device`` and compares it with the op's
*reference* implementation run in float64 on the CPU from the same dtype-rounded inputs (forward),
or compares the gradients of every float input, the reference's computed by autograd in float64
(backward). The verdict is ``tolerances.judge`` with the op's category (``tolerances.OP_CATEGORY``), or the
rule of the run's verdict profile (``verdicts.profiles``: ``--verdict torch|cann``).

Implementations come from the live registry, so a vendor kernel, a Triton kernel or a deliberately
wrong implementation registered by a test is tested as it is registered; an op with no input
generator (``conformance.suites.inputs``) shows up as an ``unsupported`` case, never silently. TF32-style
reduced-precision matmuls are switched off around each case so fp32 is judged as fp32.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from hal.conformance.cases import Case, Context, Outcome, skip, unsupported
from hal.conformance.suites import inputs
from hal.conformance.verdicts.profiles import CANN_PASS_SHARE, judge_under
from hal.conformance.verdicts.tolerances import Judgement, Tolerance, dtype_name, op_category, override, tolerance_for
from hal.ops.registry import REFERENCE, OpDef, OpImpl, OpRegistry

SUITE = "ops"
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DIRECTIONS: tuple[str, ...] = ("forward", "backward")

LOW_PRECISION: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16})
# forward computations whose reference materialises intermediates in the input dtype (see tolerances' overrides)
LOW_PRECISION_INTERMEDIATES: frozenset[str] = frozenset({"rotary_embedding", "scaled_dot_product_attention"})


def cases(ctx: Context) -> list[Case]:
    """The suite over the live HAL op registry."""
    from hal.ops import registry

    return cases_for(ctx, registry)


def cases_for(ctx: Context, registry: OpRegistry) -> list[Case]:
    """Every case for ``registry``'s ops on ``ctx``'s backend (tests pass their own registry)."""
    out: list[Case] = []
    for op in registry.names():
        definition = registry.definition(op)
        if not inputs.has_generator(op):
            why = f"no input generator for op {op!r}: add one to hal/conformance/suites/inputs.py (GENERATORS) to test it"
            out.append(Case(SUITE, f"{op}/no_input_generator", partial(_unsupported, why), why, (op,)))
            continue
        out.extend(_op_cases(ctx, definition))
    return out


def _op_cases(ctx: Context, definition: OpDef) -> list[Case]:
    op = definition.name
    reference = next(i for i in definition.impls if i.name == REFERENCE)
    out: list[Case] = []
    for dtype in (d for d in DTYPES if d in definition.dtypes):
        dn = dtype_name(dtype)
        if not ctx.dtype_supported(dtype):
            why = f"{ctx.backend_name} does not declare {dn}"
            out.append(Case(SUITE, f"{op}/{dn}/not_declared", partial(_skip, why), why, (op, dn)))
            continue
        for impl in definition.impls:
            if not impl.serves(ctx.backend_name, dtype):
                continue
            missing = impl.missing()
            if missing is not None:
                why = f"{impl.name} cannot run here: {missing}"
                out.append(Case(SUITE, f"{op}/{impl.name}/{dn}/unavailable", partial(_skip, why), why, (op, impl.name, dn)))
                continue
            for cls in inputs.classes(op):
                for direction in DIRECTIONS:
                    run = partial(_run, op=op, impl=impl, reference=reference, dtype=dtype, cls=cls, direction=direction)
                    desc = (f"{op} via {impl.name}{f' ({impl.source})' if impl.source else ''} in {dn}, {cls} inputs, "
                            f"{direction}: against the reference in float64 on the CPU")
                    out.append(Case(SUITE, f"{op}/{impl.name}/{dn}/{cls}/{direction}", run, desc,
                                    (op, impl.name, dn, cls, direction)))
    return out


def _unsupported(why: str, ctx: Context) -> Outcome:
    return unsupported(why)


def _skip(why: str, ctx: Context) -> Outcome:
    return skip(why)


# --- running one case -------------------------------------------------------------------------------------


def _run(ctx: Context, *, op: str, impl: OpImpl, reference: OpImpl, dtype: torch.dtype, cls: str, direction: str) -> Outcome:
    try:
        category = op_category(op)
    except ValueError as exc:
        return unsupported(str(exc))
    sample = inputs.sample(op, cls, dtype, ctx.seed)
    previous = ctx.backend.reduced_precision_matmul_enabled()
    ctx.backend.set_reduced_precision_matmul(False)
    try:
        if direction == "forward":
            outcome = _forward(ctx, op, impl, reference, sample, dtype, category)
        else:
            outcome = _backward(ctx, impl, reference, sample, dtype, inputs.seed_for(ctx.seed, op, cls + "/cotangent"))
    finally:
        ctx.backend.set_reduced_precision_matmul(previous)
    outcome.data.setdefault("input", sample.note)
    return outcome


def _on_device(leaves: inputs.Leaves, dtype: torch.dtype, device: torch.device, grads: tuple[str, ...] = ()) -> inputs.Leaves:
    """The leaves as the device sees them: floats in ``dtype`` (exact: they are already rounded to it)."""
    out: inputs.Leaves = {}
    for name, t in leaves.items():
        t = t.to(dtype) if t.is_floating_point() else t.clone()
        t = t.to(device)
        out[name] = t.requires_grad_(True) if name in grads else t
    return out


def _reference_leaves(leaves: inputs.Leaves, grads: tuple[str, ...] = ()) -> inputs.Leaves:
    return {n: t.clone().requires_grad_(n in grads) for n, t in leaves.items()}


def _call(impl: OpImpl, sample: inputs.Sample, leaves: inputs.Leaves) -> Any:
    args, kwargs = sample.build(leaves)
    return impl.fn(*args, **kwargs)


def _raised(impl: OpImpl, what: str, exc: BaseException) -> Outcome:
    lines = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return unsupported(f"{impl.name} raised on {what}: {message}")


def _out_dtype(sample: inputs.Sample, dtype: torch.dtype) -> torch.dtype:
    """The dtype the op's contract returns for ``dtype`` inputs: their own, or fp32 where it accumulates."""
    return torch.float32 if sample.fp32_out and dtype in (torch.float16, torch.bfloat16) else dtype


def _bad_result(result: Any, dtype: torch.dtype, count: int, inputs_dtype: torch.dtype | None = None) -> Outcome | None:
    """A result that is not ``count`` tensors of ``dtype`` (one tensor for a single-output op)."""
    results = tuple(result) if isinstance(result, (tuple, list)) and count > 1 else (result,)
    if len(results) != count:
        return Outcome("fail", failed_metric="type", reason=f"returned {len(results)} results, not {count}")
    for r in results:
        if not isinstance(r, torch.Tensor):
            return Outcome("fail", failed_metric="type", reason=f"returned {type(r).__name__}, not a tensor")
        if r.dtype != dtype:
            return Outcome("fail", failed_metric="dtype", reason=f"returned {dtype_name(r.dtype)} for {dtype_name(inputs_dtype or dtype)} "
                           f"inputs, not {dtype_name(dtype)}")
    return None


def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple of tensors (a multi-output op, e.g. add_rms_norm, returns several)."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _output_specs(sample: inputs.Sample, category: str) -> tuple[inputs.OutputSpec, ...]:
    """How each output is judged: the sample's own specs, else one output with the op's category."""
    return sample.outputs or (inputs.OutputSpec("output", category, sample.k, sample.magnitude),)


def _worst(judged: list[tuple[str, Judgement, Tolerance]], key: str, label: Callable[[str], str]) -> Outcome:
    """The verdict of the worst of several judged tensors (a failing one first, else the highest tol_ratio),
    with every one's metrics under ``data[key]``; ``label(name)`` prefixes the reason."""
    name, j, tol = max(judged, key=lambda x: (not x[1].passed, x[1].metrics.get("tol_ratio", 0.0)))
    outcome = _outcome(j, tol, prefix=label(name))
    outcome.data[key] = {n: jj.metrics for n, jj, _ in judged}
    return outcome


def _forward(ctx: Context, op: str, impl: OpImpl, reference: OpImpl, sample: inputs.Sample, dtype: torch.dtype, category: str) -> Outcome:
    specs = _output_specs(sample, category)
    expected = _outputs(_call(reference, sample, _reference_leaves(sample.leaves)))
    try:
        actual = _call(impl, sample, _on_device(sample.leaves, dtype, ctx.device))
        ctx.backend.synchronize()
    except Exception as exc:  # the implementation does not take this input: reported, not a crash
        return _raised(impl, "this input", exc)
    bad = _bad_result(actual, _out_dtype(sample, dtype), len(specs), dtype)
    if bad is not None:
        return bad
    normwise = dtype in LOW_PRECISION and op in LOW_PRECISION_INTERMEDIATES
    judged: list[tuple[str, Judgement, Tolerance]] = []
    for spec, a, e in zip(specs, _outputs(actual), expected):
        tol = _bound(tolerance_for(spec.category, dtype, spec.k), sample, spec.magnitude, e, normwise)
        verdict, applied = judge_under(ctx.verdict, a, e, tol, dtype)
        judged.append((spec.name, verdict, applied))
    if len(judged) == 1:
        return _outcome(judged[0][1], judged[0][2])
    return _worst(judged, "outputs", lambda name: f"output {name}: ")


def _backward(ctx: Context, impl: OpImpl, reference: OpImpl, sample: inputs.Sample, dtype: torch.dtype, seed: int) -> Outcome:
    names = tuple(sample.grads)
    ref_leaves = _reference_leaves(sample.leaves, names)
    expected_out = _outputs(_call(reference, sample, ref_leaves))
    gen = torch.Generator().manual_seed(seed)
    cotangents = tuple(torch.randn(e.shape, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64)
                       for e in expected_out)
    torch.autograd.backward(expected_out, cotangents)
    leaves = _on_device(sample.leaves, dtype, ctx.device, names)
    try:
        out = _call(impl, sample, leaves)
    except Exception as exc:
        return _raised(impl, "this input", exc)
    out_dtype = _out_dtype(sample, dtype)
    bad = _bad_result(out, out_dtype, len(expected_out), dtype)
    if bad is not None:
        return bad
    try:
        torch.autograd.backward(_outputs(out), tuple(c.to(out_dtype).to(ctx.device) for c in cotangents))
        ctx.backend.synchronize()
    except Exception as exc:  # e.g. a forward-only fused kernel
        return _raised(impl, "backward", exc)
    judged: list[tuple[str, Judgement, Tolerance]] = []
    cotangent = cotangents[0] if len(cotangents) == 1 else cotangents
    scales = (sample.grad_scale({n: t.detach() for n, t in ref_leaves.items()}, cotangent)
              if sample.grad_scale is not None and dtype in LOW_PRECISION else {})
    for name, spec in sample.grads.items():
        grad, expected = leaves[name].grad, ref_leaves[name].grad
        assert expected is not None, f"the reference gives no gradient for {name}"
        if grad is None:
            return Outcome("fail", failed_metric="grad_missing", reason=f"no gradient reached input {name!r}")
        tol = _bound(tolerance_for(spec.category, dtype, spec.k), sample, spec.magnitude, expected, dtype in LOW_PRECISION,
                     scales.get(name))
        verdict, applied = judge_under(ctx.verdict, grad, expected, tol, dtype)
        judged.append((name, verdict, applied))
    return _worst(judged, "grads", lambda name: f"grad of {name}: ")


def _bound(tol: Tolerance, sample: inputs.Sample, magnitude: float, expected: torch.Tensor, normwise: bool,
           componentwise: float | None = None) -> Tolerance:
    """The table's bound, adjusted by the documented overrides (tolerances' docstring says why). A
    ``componentwise`` scale (``inputs.GradScale``) replaces max|reference| in the normwise one."""
    if tol.atol == 0.0:
        return tol
    atol, reasons = tol.atol, []
    if magnitude != 1.0:
        atol *= magnitude
        scaled = f" (inputs scaled by {sample.scale:g})" if sample.scale != 1.0 else ""
        reasons.append(f"atol x {magnitude:.3g}, the result's natural magnitude{scaled}")
    if normwise:
        finite = expected.detach()[torch.isfinite(expected.detach())]
        peak = float(finite.abs().max()) if finite.numel() else 0.0
        of = "max|reference|"
        if componentwise is not None and componentwise > peak:
            peak, of = componentwise, "max componentwise scale (every term in absolute value)"
        if tol.rtol * peak > atol:
            atol = tol.rtol * peak
            reasons.append(f"{tol.dtype} intermediates: atol = rtol x {of} ({peak:.3g})")
    return override(tol, "; ".join(reasons), atol=atol) if reasons else tol


def _outcome(j: Judgement, tol: Tolerance, prefix: str = "") -> Outcome:
    tolerance: dict[str, Any] = dict(tol.to_dict())
    if "pass_share" in j.metrics:  # the cann profile's two case-level bounds (verdicts.profiles)
        tolerance.update(pass_share=CANN_PASS_SHARE, ulp_cap_ratio=1.0)
    if j.passed:
        return Outcome("pass", metrics=j.metrics, tolerance=tolerance)
    return Outcome("fail", metrics=j.metrics, tolerance=tolerance, failed_metric=j.failed_metric, reason=prefix + j.reason)
