"""The parity verdict: four checks of the candidate's runs against the reference band, each with its numbers.

1. loss band — after warm-up, every step's loss of every candidate run within the band (mean ± the larger of 1 % and
   3 σ of the reference seeds: MLPerf's "within the reference's own spread", Megatron's 1 % golden-value margin);
2. gradient norm — after warm-up, every step's total gradient norm within the reference's: mean ± the larger of 10 %
   (MindSpeed-LLM's CI margin) and 3 σ of the seeds (grad norms spike, and not at the same step on every seed);
3. per-layer gradients — at the chosen steps' weights, every parameter's gradient with cosine ≥ 0.99 and its norm
   within the precision's bound (``training.LAYER_NORM_BOUNDS``) of the float64 CPU gradient at the same weights
   (msprobe's layer compare; ``training_run.layer_parity``);
4. steps to the target loss — the first step whose loss (mean of a 10-step window) reaches the reference's mean loss
   at 80 % of the run; Welch's one-sided t-test of the candidate's steps against the reference's at p = 0.05, in
   each direction: converging faster is as suspect as converging slower (MLPerf's reference convergence points).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import stats
from .band import Band
from .runs import Curve, ParityConfig

GRAD_NORM_TOLERANCE = 0.10
COSINE_FLOOR = 0.99
P_VALUE = 0.05
TARGET_AT = 0.8
WINDOW = 10


@dataclass
class Check:
    name: str
    passed: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "summary": self.summary, "numbers": self.numbers}


def _window_mean(losses: list[float], step: int) -> float:
    lo = max(0, step - WINDOW + 1)
    return stats.mean(losses[lo:step + 1])


def steps_to(losses: list[float], target: float) -> int | None:
    """The first step whose window-mean loss is at or below ``target``; None when the run never gets there."""
    return next((t for t in range(len(losses)) if _window_mean(losses, t) <= target), None)


def loss_band(band: Band, candidates: list[Curve], warmup: int) -> Check:
    worst = (0.0, -1, -1)
    outside = 0
    steps = len(band.curves[0].losses)
    for c in candidates:
        for t in range(warmup, steps):
            loss = c.losses[t]
            ratio = abs(loss - band.mean(t)) / band.width(t) if math.isfinite(loss) else math.inf
            outside += ratio > 1.0
            if ratio > worst[0]:
                worst = (ratio, c.seed, t)
    ratio, seed, t = worst
    where = (f"seed {seed}, step {t}: {candidates[[c.seed for c in candidates].index(seed)].losses[t]:.4f} against "
             f"{band.mean(t):.4f} ± {band.width(t):.4f}") if seed >= 0 else "no step"
    return Check("loss band", outside == 0,
                 f"{outside} step(s) outside the band; the farthest {ratio:.2f} of its half width ({where})",
                 {"outside": outside, "worst_ratio": ratio, "worst_seed": seed, "worst_step": t, "warmup": warmup})


def grad_norms(band: Band, candidates: list[Curve], warmup: int) -> Check:
    worst = (0.0, -1, -1, 0.0, 0.0)
    outside = 0
    for c in candidates:
        for t in range(warmup, len(c.grad_norms)):
            ref = [r.grad_norms[t] for r in band.curves]
            mean, width = stats.mean(ref), max(GRAD_NORM_TOLERANCE * stats.mean(ref), 3 * stats.std(ref))
            got = c.grad_norms[t]
            ratio = abs(got - mean) / width if width > 0 and math.isfinite(got) else (0.0 if got == mean else math.inf)
            outside += ratio > 1.0
            if ratio > worst[0]:
                worst = (ratio, c.seed, t, got, mean)
    ratio, seed, t, got, mean = worst
    return Check("gradient norm", outside == 0,
                 f"{outside} step(s) outside the reference's gradient norm (mean ± max({GRAD_NORM_TOLERANCE:.0%}, 3 σ)); the "
                 f"farthest {ratio:.2f} of its half width (seed {seed}, step {t}: {got:.4g} against {mean:.4g})",
                 {"outside": outside, "worst_ratio": ratio, "worst_seed": seed, "worst_step": t})


def layers(candidates: list[Curve], precision: str) -> Check:
    from hal.conformance.suites.training import LAYER_NORM_BOUNDS

    bound = LAYER_NORM_BOUNDS[precision]
    rows = [(c.seed, step, row) for c in candidates for step, found in c.layers.items() for row in found]
    if not rows:
        return Check("per-layer gradients", True, "not run", {})
    off = lambda row: row["cosine"] < COSINE_FLOOR or not abs(row["norm_ratio"] - 1.0) <= bound  # noqa: E731
    bad = [r for r in rows if off(r[2])]
    seed, step, worst = bad[0] if bad else min(rows, key=lambda r: r[2]["cosine"])
    return Check("per-layer gradients", not bad,
                 f"{len(bad)} parameter gradient(s) below cosine {COSINE_FLOOR} or with a norm more than {bound:.1%} off "
                 f"the float64 gradient at the same weights; {'the first' if bad else 'the lowest cosine'}: "
                 f"{worst['param']} cosine {worst['cosine']:.5f}, norm ratio {worst['norm_ratio']:.4f} (seed {seed}, step {step})",
                 {"off": len(bad), "worst_cosine": min(r[2]["cosine"] for r in rows), "param": worst["param"],
                  "norm_bound": bound, "seed": seed, "step": step, "steps": sorted({s for _, s, _ in rows})})


def convergence(band: Band, candidates: list[Curve], steps: int) -> Check:
    at = min(steps - 1, int(TARGET_AT * steps))
    target = stats.mean([_window_mean(c.losses, at) for c in band.curves])
    ref = [steps_to(c.losses, target) for c in band.curves]
    got = [steps_to(c.losses, target) for c in candidates]
    reached_ref = [float(s) for s in ref if s is not None]
    if any(s is None for s in got):
        return Check("steps to target", False, f"a candidate run never reached the target loss {target:.4f}",
                     {"target": target, "reference_steps": ref, "candidate_steps": got})
    if len(reached_ref) < 2:
        return Check("steps to target", True, "the reference runs did not reach their own target; not judged",
                     {"target": target, "reference_steps": ref, "candidate_steps": got})
    test = stats.welch([float(s) for s in got if s is not None], reached_ref)
    slower, faster = test.p_greater < P_VALUE, test.p_less < P_VALUE
    verdict = "slower" if slower else "faster" if faster else "the same"
    return Check("steps to target", not (slower or faster),
                 f"candidate {stats.mean([float(s) for s in got if s is not None]):.1f} steps, reference "
                 f"{stats.mean(reached_ref):.1f} to loss {target:.4f}: {verdict} (Welch t = {test.t:.2f}, "
                 f"p slower {test.p_greater:.3f}, p faster {test.p_less:.3f})",
                 {"target": target, "target_step": at, "reference_steps": ref, "candidate_steps": got, "t": test.t,
                  "df": test.df, "p_slower": test.p_greater, "p_faster": test.p_less})


def judge(config: ParityConfig, band: Band, candidates: list[Curve]) -> list[Check]:
    return [loss_band(band, candidates, config.warmup), grad_norms(band, candidates, config.warmup),
            layers(candidates, config.precision), convergence(band, candidates, config.steps)]
