"""Training suite: the reference model trained on the backend agrees with the CPU reference, step by step.

Cases (``conformance.suites.training_run`` holds the runs, ``conformance.jobs.pipeline_check`` the parallel one):

- ``loss_curve/<precision>``: N AdamW steps on the backend against the fp32 CPU reference run (same
  seed, same corpus batches, reference operators). Metric: mean relative loss deviation over the
  steps (``mean_rel_dev``); the curves go to ``data`` for the plot.
- ``grad_agreement/<precision>``: step-1 gradient of every parameter tensor against the float64 CPU
  reference: rel_l2 and cosine per tensor; the case names the worst tensor (and its layer) and fails
  when any rel_l2 exceeds the bound. This is the symptom a loss check misses: on Ascend
  (pytorch#107) the forward loss agreed within 1% while layer-0 gradients were 50-100% apart.
- ``layer_parity/<precision>``: after N steps of the backend's own training, at the weights they reached, one more
  batch's loss and every parameter tensor's gradient against the float64 CPU reference at the same weights: cosine
  ≥ 0.99, norm within the precision's bound, the loss within the curve bound; the case names the worst tensor and its
  layer (per tensor: one weight's gradient 1 % too large moves its whole layer's norm by only 0.1 %). Why at the reached weights and not
  against a float64 training run: in bf16 two trainings drift apart
  (the embedding's gradient after 12 steps: cosine 0.9896 against the float64 run's, seed 1234), which says nothing
  about a layer; at one state the gradient is the layer's computation alone. A whole-model loss can hide one broken
  layer: with half of one layer's weight gradient dropped, the bf16 and fp16 loss curves stayed within their bounds
  while that layer's gradient cosine at the reached weights fell to 0.98; one weight's gradient × 1.01 fails the fp32
  norm bound while the fp32 loss curve passes (``tests/unit/test_layer_parity.py``).
- ``determinism/fp32``: two runs with ``backend.set_deterministic(True)`` give bitwise equal losses
  and final weights (the switch is restored afterwards).
- ``pipeline/<plan>/world<n>``: a 2-stage plan (tp2 → dp2 on 4 ranks, or 1 → 1 on 2) through the
  engine in one spawned job equals its single-device run (``pipeline_check``'s bounds).

Bounds, and why:

==============  ==============  ============  ==============================================================
precision       mean_rel_dev    grad rel_l2   why
==============  ==============  ============  ==============================================================
fp32            1e-4            1e-4          fp32 kernels differ from the CPU's only in summation order
                                              (measured on CPU ≈ 3e-7 for gradients against float64)
bf16-mixed      1.6e-2          5e-2          autocast rounds matmul inputs/outputs to bf16 (8 significant
                                              bits; the tolerance table's bf16 resolution is 1.6e-2);
                                              measured on CPU: 1.2e-4 curve, 6e-3 worst gradient (a norm
                                              weight, a sum over every token). 5e-2 still catches
                                              gradients that are 50-100% off.
fp16-mixed      1e-3            1e-2          fp16 keeps 11 bits (resolution 1e-3); with loss scaling the
                                              gradients stay normal. Measured on CPU: 3.6e-5, 7.6e-4.
==============  ==============  ============  ==============================================================

Options: ``training_steps`` (default 12), ``training_timeout_s`` (the pipeline job's deadline,
default 300 s).
"""
from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Callable

import torch

from hal.conformance.cases import CAPABILITY_KEY, Case, Context, Outcome, skip, unsupported
from hal.conformance.jobs.launch import JobFailed, run_job
from hal.conformance.jobs.pipeline_check import choose_plan, compare, moe_model, single_device_run, world_of
from hal.conformance.suites.training_run import (
    PRECISIONS,
    RunResult,
    Settings,
    grad_agreement,
    gradient_at,
    host_threads,
    layer_parity,
    plain_fp32_matmul,
    reference_curve,
    reference_gradient_at,
    reference_grads,
    train,
)

SUITE = "training"
CURVE_BOUNDS = {"fp32": 1e-4, "bf16-mixed": 1.6e-2, "fp16-mixed": 1e-3}
GRAD_BOUNDS = {"fp32": 1e-4, "bf16-mixed": 5e-2, "fp16-mixed": 1e-2}
LAYER_COSINE = 0.99  # every layer's gradient at the state N steps reached: its direction
LAYER_NORM_BOUNDS = {"fp32": 1e-3, "bf16-mixed": 5e-2, "fp16-mixed": 2e-2}  # |norm ratio - 1|
WHY = {
    "fp32": "fp32 kernels differ from the CPU's only in summation order",
    "bf16-mixed": "autocast rounds matmuls to bf16 (8 significant bits; table resolution 1.6e-2)",
    "fp16-mixed": "autocast rounds matmuls to fp16 (11 significant bits; table resolution 1e-3), loss-scaled",
}
DEFAULT_TIMEOUT_S = 300.0


class _Runs:
    """Every run the cases share, computed once on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}

    def _get(self, key: str, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = make()
            return self._cache[key]

    def reference_curve(self, skip_steps: tuple[int, ...] = ()) -> list[float]:
        return self._get(f"reference_curve/{skip_steps}", lambda: reference_curve(self.settings, skip_steps))

    def reference_grads(self) -> dict[str, torch.Tensor]:
        return self._get("reference_grads", lambda: reference_grads(self.settings))

    def backend_run(self, ctx: Context, precision: str) -> RunResult:
        """The backend's run in ``precision``, with its final weights (the layer parity starts from them)."""
        return self._get(f"run/{precision}", lambda: train(self.settings, ctx.backend, ctx.device, precision=precision,
                                                           keep_params=True))


def _precision_blocked(ctx: Context, precision: str) -> str | None:
    dtype = PRECISIONS[precision]
    if dtype is not None and not ctx.dtype_supported(dtype):
        name = str(dtype).replace("torch.", "")
        return f"{ctx.capabilities.name} has no {name} (capabilities: {ctx.capabilities.support(CAPABILITY_KEY[dtype])})"
    return None


def _loss_curve(runs: _Runs, precision: str) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        blocked = _precision_blocked(ctx, precision)
        if blocked:
            return unsupported(blocked)
        result = runs.backend_run(ctx, precision)
        got, ref = result.losses, runs.reference_curve(result.skipped)
        devs = [abs(a - b) / abs(b) for a, b in zip(got, ref)]
        mean_dev, max_dev = sum(devs) / len(devs), max(devs)
        bound = CURVE_BOUNDS[precision]
        finite = all(torch.isfinite(torch.tensor(got)).tolist())
        metrics = {"mean_rel_dev": mean_dev if finite else float("inf"), "max_rel_dev": max_dev if finite else float("inf"),
                   "final_loss": got[-1], "reference_final_loss": ref[-1], "skipped_updates": float(len(result.skipped))}
        data = {"steps": list(range(1, len(got) + 1)), "loss": got, "reference_loss": ref,
                "skipped_steps": [k + 1 for k in result.skipped]}
        tolerance = {"mean_rel_dev": bound}
        if not finite or mean_dev > bound:
            worst = max(range(len(devs)), key=devs.__getitem__)
            return Outcome("fail", metrics, tolerance, "mean_rel_dev",
                           f"{precision} loss curve deviates from the fp32 CPU reference by {metrics['mean_rel_dev']:.3g} on average "
                           f"(bound {bound:g}; worst step {worst + 1}: {got[worst]:.6g} vs {ref[worst]:.6g})", data)
        return Outcome("pass", metrics, tolerance, None, "", data)

    return run


def _grad_case(runs: _Runs, precision: str) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        blocked = _precision_blocked(ctx, precision)
        if blocked:
            return unsupported(blocked)
        rows = grad_agreement(runs.backend_run(ctx, precision).grads, runs.reference_grads())
        worst = max(rows, key=lambda r: r["rel_l2"])
        bound = GRAD_BOUNDS[precision]
        metrics = {"rel_l2": worst["rel_l2"], "cosine": min(r["cosine"] for r in rows),
                   "cosine_of_worst": worst["cosine"], "params_over_bound": float(sum(r["rel_l2"] > bound for r in rows))}
        data = {"worst_param": worst["param"], "worst_layer": worst["layer"],
                "params": [r["param"] for r in rows], "rel_l2": [r["rel_l2"] for r in rows], "cosine": [r["cosine"] for r in rows]}
        tolerance = {"rel_l2": bound}
        if worst["rel_l2"] > bound:
            what = "is missing" if worst["missing"] else f"is off by rel L2 {worst['rel_l2']:.3g} (cosine {worst['cosine']:.4f})"
            return Outcome("fail", metrics, tolerance, "rel_l2",
                           f"{worst['layer']}: gradient of {worst['param']} {what}; bound {bound:g}, "
                           f"{int(metrics['params_over_bound'])} of {len(rows)} tensors over it", data)
        return Outcome("pass", metrics, tolerance, None, f"worst: {worst['param']} ({worst['layer']})", data)

    return run


def _layer_case(runs: _Runs, precision: str) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        blocked = _precision_blocked(ctx, precision)
        if blocked:
            return unsupported(blocked)
        reached = runs.backend_run(ctx, precision).params
        got = gradient_at(runs.settings, ctx.backend, ctx.device, reached, precision=precision)
        return judge_layers(got, reference_gradient_at(runs.settings, reached), precision, runs.settings.steps)

    return run


def judge_layers(got: tuple[float, dict[str, torch.Tensor]], ref: tuple[float, dict[str, torch.Tensor]], precision: str,
                 steps: int) -> Outcome:
    """The per-layer parity verdict: (loss, gradients) of the backend against the float64 reference's, both at the
    weights ``steps`` steps of training reached."""
    rows = layer_parity(got[1], ref[1])
    worst = min(rows, key=lambda r: r["cosine"])
    off = max(rows, key=lambda r: abs(r["norm_ratio"] - 1.0))
    loss_dev = abs(got[0] - ref[0]) / abs(ref[0]) if ref[0] else abs(got[0])
    metrics = {"cosine_deficit": 1.0 - worst["cosine"], "norm_dev": abs(off["norm_ratio"] - 1.0), "loss_rel_dev": loss_dev,
               "worst_cosine": worst["cosine"]}
    tolerance = {"cosine_deficit": 1.0 - LAYER_COSINE, "norm_dev": LAYER_NORM_BOUNDS[precision],
                 "loss_rel_dev": CURVE_BOUNDS[precision]}
    data = {"params": [r["param"] for r in rows], "layers": [r["layer"] for r in rows], "cosine": [r["cosine"] for r in rows],
            "norm_ratio": [r["norm_ratio"] for r in rows], "worst_layer": worst["layer"], "worst_param": worst["param"]}
    for name, why in (("cosine_deficit", f"{worst['param']}: gradient cosine {worst['cosine']:.4f} after {steps} steps "
                                         f"(bound >= {LAYER_COSINE})"),
                      ("norm_dev", f"{off['param']}: gradient norm {off['norm_ratio']:.4g}x the reference's after {steps} "
                                   f"steps (bound ±{LAYER_NORM_BOUNDS[precision]:g})"),
                      ("loss_rel_dev", f"loss after {steps} steps {got[0]:.6g} against {ref[0]:.6g} (relative "
                                       f"{loss_dev:.3g}, bound {CURVE_BOUNDS[precision]:g})")):
        if not metrics[name] <= tolerance[name]:  # NaN fails too
            return Outcome("fail", metrics, tolerance, name, why, data)
    return Outcome("pass", metrics, tolerance, None, f"worst: {worst['param']} (cosine {worst['cosine']:.4f})", data)


def _determinism(runs: _Runs) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        previous = torch.are_deterministic_algorithms_enabled()
        ctx.backend.set_deterministic(True)
        try:
            # the process's own thread count: a multi-threaded kernel's nondeterminism is what this looks for
            a = train(runs.settings, ctx.backend, ctx.device, keep_params=True, threads=None)
            b = train(runs.settings, ctx.backend, ctx.device, keep_params=True, threads=None)
        finally:
            ctx.backend.set_deterministic(previous)
        loss_steps = sum(x != y for x, y in zip(a.losses, b.losses))
        differing = [n for n in a.params if not torch.equal(a.params[n], b.params[n])]
        max_diff = max((float((a.params[n].double() - b.params[n].double()).abs().max()) for n in differing), default=0.0)
        metrics = {"differing_loss_steps": float(loss_steps), "differing_params": float(len(differing)), "max_abs_diff": max_diff}
        data = {"steps": list(range(1, len(a.losses) + 1)), "loss": b.losses, "reference_loss": a.losses}
        tolerance = {"differing_loss_steps": 0.0, "differing_params": 0.0}
        if loss_steps or differing:
            failed = "differing_loss_steps" if loss_steps else "differing_params"
            return Outcome("fail", metrics, tolerance, failed,
                           f"two deterministic runs differ: {loss_steps} loss step(s), {len(differing)} parameter tensor(s) "
                           f"(first {differing[0] if differing else '-'}, max |diff| {max_diff:.3g})", data)
        return Outcome("pass", metrics, tolerance, None, "", data)

    return run


def _pipeline(settings: Settings, name: str, plan: dict[str, Any], timeout_s: float) -> Callable[[Context], Outcome]:
    def run(ctx: Context) -> Outcome:
        spec = {"plan": plan, "model": settings.model.to_dict(), "steps": settings.steps, "seed": settings.seed}
        try:
            job = run_job(ctx.launch, "pipeline", spec, world_of(plan), ctx.backend.name, timeout_s=timeout_s)
        except JobFailed as exc:
            return Outcome("error", reason=str(exc))
        with plain_fp32_matmul(ctx.backend), host_threads(1):
            reference = single_device_run(settings.model, settings.steps, settings.seed, ctx.device)
        v = compare(job.values, reference)
        status = "fail" if v["failed_metric"] else "pass"
        return Outcome(status, v["metrics"], v["tolerance"], v["failed_metric"], v["reason"], v["data"])

    return run


def settings_for(ctx: Context) -> Settings:
    steps = int(ctx.options.get("training_steps", Settings.steps))
    if steps < 2:
        raise ValueError(f"training_steps {steps}: give at least 2 steps (a curve)")
    return Settings(steps=steps, seed=ctx.seed)


def cases(ctx: Context) -> list[Case]:
    settings = settings_for(ctx)
    runs = _Runs(settings)
    out: list[Case] = []
    for precision in PRECISIONS:
        out.append(Case(SUITE, f"loss_curve/{precision}", _loss_curve(runs, precision),
                        f"{settings.steps} AdamW steps in {precision} against the fp32 CPU reference run (which leaves out "
                        "the updates the loss scaler skipped, so both are the same training); mean relative "
                        f"deviation <= {CURVE_BOUNDS[precision]:g} ({WHY[precision]})", ("curve",)))
    for precision in PRECISIONS:
        out.append(Case(SUITE, f"grad_agreement/{precision}", _grad_case(runs, precision),
                        f"step-1 gradient of every parameter tensor in {precision} against the float64 CPU reference; "
                        f"rel_l2 <= {GRAD_BOUNDS[precision]:g} per tensor ({WHY[precision]})"))
    for precision in PRECISIONS:
        out.append(Case(SUITE, f"layer_parity/{precision}", _layer_case(runs, precision),
                        f"after {settings.steps} steps in {precision}, every parameter's gradient against the float64 CPU "
                        f"run's: cosine >= {LAYER_COSINE}, norm within ±{LAYER_NORM_BOUNDS[precision]:g}, the loss within "
                        f"{CURVE_BOUNDS[precision]:g} (a broken layer the whole-model loss hides)"))
    out.append(Case(SUITE, "determinism/fp32", _determinism(runs),
                    "two runs with set_deterministic(True) are bitwise equal (losses and final weights)"))
    chosen = choose_plan(ctx.backend.name, ctx.max_world_size)
    if chosen is None:
        why = f"{ctx.max_world_size} process slot(s) on backend {ctx.backend_name}: a pipelined plan needs 2"
        out.append(Case(SUITE, "pipeline", lambda c: skip(why), "a pipelined plan equals its single-device run"))
    else:
        name, plan = chosen
        timeout = float(ctx.options.get("training_timeout_s", DEFAULT_TIMEOUT_S))
        out.append(Case(SUITE, f"pipeline/{name}/world{world_of(plan)}", _pipeline(settings, name, plan, timeout),
                        "the plan through the pipeline engine equals its single-device run (loss, step-1 gradients, curve)",
                        ("multi-process",)))
        moe = replace(settings, model=moe_model(settings.model, plan))
        layers = ", ".join(map(str, moe.model.moe_layers()))
        out.append(Case(SUITE, f"pipeline_moe/{name}/world{world_of(plan)}", _pipeline(moe, name, plan, timeout),
                        f"the same plan with MoE layers ({layers}: 4 experts, top-2, balancing and z losses) equals its "
                        "single-device run (loss, step-1 gradients, curve)", ("multi-process",)))
    return out
