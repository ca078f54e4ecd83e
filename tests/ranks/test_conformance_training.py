"""The training conformance suite on the CPU: it passes the real stack, and planted operator faults show up as
the training symptoms they cause — a wrong backward in the gradients (naming the worst layer) while the
forward loss still agrees, and a non-deterministic kernel in the determinism check."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator

import pytest
import torch

from hal import get_backend
from hal.conformance.cases import Context, Outcome
from hal.conformance.jobs.pipeline_check import compare, single_device_run
from hal.conformance.suites import training as suite
from hal.conformance.suites.training_run import MODEL
from hal.ops import _rms_norm, _swiglu, registry

from ..dist_harness import run_function_forked


def _ctx(slots: int = 4, **options: Any) -> Context:
    cpu = get_backend("cpu")
    return Context(cpu, torch.device("cpu"), cpu.capabilities(), max_world_size=slots, options=dict(options), launch=run_function_forked)


def _run(ctx: Context, *prefixes: str) -> dict[str, Outcome]:
    return {c.name: c.run(ctx) for c in suite.cases(ctx) if not prefixes or c.name.startswith(prefixes)}


class _WrongBackwardRmsNorm(torch.autograd.Function):
    """Forward is the reference rms_norm; backward returns 1.5x the true input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr, wr = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(_rms_norm(xr, wr, ctx.eps), (xr, wr), grad)
        return 1.5 * gx, gw, None


@pytest.fixture
def planted(request: pytest.FixtureRequest) -> Iterator[None]:
    """Register a faulty CPU implementation (every dtype, so the reference must bypass it) and remove it after."""
    op, fn = request.param
    registry.register(op, "planted_fault", backends=["cpu"], priority=1000, source="test")(fn)
    try:
        yield
    finally:
        registry.unregister(op, "planted_fault")


@pytest.fixture(scope="module")
def clean_run() -> dict[str, Outcome]:
    assert not torch.are_deterministic_algorithms_enabled()
    return _run(_ctx(4))


def test_every_case_passes_on_the_cpu(clean_run: dict[str, Outcome]) -> None:
    assert sorted(clean_run) == sorted([
        "loss_curve/fp32", "loss_curve/bf16-mixed", "loss_curve/fp16-mixed", "grad_agreement/fp32",
        "grad_agreement/bf16-mixed", "grad_agreement/fp16-mixed", "layer_parity/fp32", "layer_parity/bf16-mixed",
        "layer_parity/fp16-mixed", "determinism/fp32", "pipeline/2stage_tp2_to_dp2/world4",
        "pipeline_moe/2stage_tp2_to_dp2/world4"])
    bad = {n: (o.status, o.reason) for n, o in clean_run.items() if o.status != "pass"}
    assert not bad, bad
    assert not torch.are_deterministic_algorithms_enabled()  # the determinism case restored the switch


def test_curves_and_gradient_tables_are_reported(clean_run: dict[str, Outcome]) -> None:
    for precision, bound in suite.CURVE_BOUNDS.items():
        o = clean_run[f"loss_curve/{precision}"]
        assert o.data["steps"] == list(range(1, 13)) and len(o.data["loss"]) == len(o.data["reference_loss"]) == 12
        assert o.data["loss"][-1] < o.data["loss"][0]  # it trains
        assert 0 <= o.metrics["mean_rel_dev"] <= bound == o.tolerance["mean_rel_dev"]
    assert clean_run["loss_curve/fp32"].metrics["mean_rel_dev"] == 0.0  # the CPU's ops are the reference's
    assert clean_run["loss_curve/bf16-mixed"].metrics["mean_rel_dev"] > 0  # autocast really ran in bf16
    grads = clean_run["grad_agreement/bf16-mixed"]
    n_params = len(list(torch.nn.Module.parameters(__import__("hal.parallel.models.stage", fromlist=["full_model"]).full_model(MODEL, 0))))
    assert len(grads.data["params"]) == len(grads.data["rel_l2"]) == n_params
    assert grads.data["worst_param"] in grads.data["params"] and 0 < grads.metrics["rel_l2"] < suite.GRAD_BOUNDS["bf16-mixed"]
    pipe = clean_run["pipeline/2stage_tp2_to_dp2/world4"]
    assert pipe.metrics["missing_grads"] == 0 and pipe.metrics["grad_rel_l2"] <= 1e-5
    assert len(pipe.data["loss"]) == len(pipe.data["reference_loss"]) == 12


@pytest.mark.parametrize("planted", [("rms_norm", lambda x, w, eps=1e-6: _WrongBackwardRmsNorm.apply(x, w, eps))], indirect=True)
def test_wrong_backward_fails_gradient_agreement_naming_the_worst_layer(planted: None) -> None:
    outcomes = _run(_ctx(1, training_steps=3), "grad_agreement/fp32", "loss_curve/fp32")
    grads = outcomes["grad_agreement/fp32"]
    assert grads.status == "fail" and grads.failed_metric == "rel_l2"
    assert grads.metrics["rel_l2"] > 0.1
    worst = grads.data["worst_param"]
    assert grads.data["worst_layer"] in ("embed", "layers.0") and worst in grads.reason
    # The forward is right: step 1's loss equals the reference bit for bit; only the gradients are off.
    curve = outcomes["loss_curve/fp32"]
    assert curve.data["loss"][0] == curve.data["reference_loss"][0]
    assert curve.status == "fail" and curve.data["loss"][1] != curve.data["reference_loss"][1]
    # The reference ran on the reference ops only, and the planted op is back in place afterwards.
    assert registry.choose("rms_norm", "cpu", torch.float32).impl.name == "planted_fault"


_calls = itertools.count()


def _drifting_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """A kernel whose result depends on hidden state (like a racy atomic reduction): never the same twice."""
    return _swiglu(x, dim) * (1 + 1e-7 * next(_calls))


@pytest.mark.parametrize("planted", [("swiglu", _drifting_swiglu)], indirect=True)
def test_a_nondeterministic_kernel_fails_the_determinism_case(planted: None) -> None:
    (outcome,) = _run(_ctx(1, training_steps=3), "determinism/fp32").values()
    assert outcome.status == "fail" and outcome.failed_metric in ("differing_loss_steps", "differing_params")
    assert outcome.metrics["differing_params"] > 0
    assert not torch.are_deterministic_algorithms_enabled()


def test_pipeline_comparison_catches_a_wrong_gradient_and_curve() -> None:
    """The pipeline verdict on real single-device runs: equal passes; a perturbed gradient or curve fails by name."""
    ref = single_device_run(MODEL, 2, 0, torch.device("cpu"))
    same = [{"coord": [1, 0, 0], "losses": list(ref["losses"]), "grads": dict(ref["grads"])}]
    assert compare(same, ref)["failed_metric"] is None
    name = "layers.0.attn.qkv.weight"
    wrong = [{**same[0], "grads": {**ref["grads"], name: ref["grads"][name] * 1.001}}]
    verdict = compare(wrong, ref)
    assert verdict["failed_metric"] == "grad_rel_l2" and name in verdict["reason"]
    drifted = [{**same[0], "losses": [ref["losses"][0], ref["losses"][1] * 1.01]}]
    assert compare(drifted, ref)["failed_metric"] == "loss_curve_max_rel"
    partial = [{**same[0], "grads": {k: v for k, v in ref["grads"].items() if k != name}}]
    assert compare(partial, ref)["failed_metric"] == "missing_grads"


def test_too_few_slots_skip_the_pipeline_case() -> None:
    (pipe,) = [c for c in suite.cases(_ctx(1)) if c.name.startswith("pipeline")]
    outcome = pipe.run(_ctx(1))
    assert outcome.status == "skip" and "needs 2" in outcome.reason
    assert [c.name for c in suite.cases(_ctx(2)) if c.name.startswith("pipeline")] == ["pipeline/2stage/world2",
                                                                                        "pipeline_moe/2stage/world2"]


def test_bad_step_option_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="training_steps 1"):
        suite.cases(_ctx(1, training_steps=1))


def test_a_skipped_update_is_left_out_of_the_reference_too() -> None:
    """Seed 8's fp16-mixed run overflows at step 7 and GradScaler skips that update: compared with a reference that
    updated there, the curve was 15x over its bound; the reference now leaves out the same update."""
    from hal.conformance.suites.training_run import Settings, reference_curve, train

    settings = Settings(steps=10, seed=8)
    fp16 = train(settings, get_backend("cpu"), torch.device("cpu"), precision="fp16-mixed")
    assert fp16.skipped == (6,)
    plain, skipping = reference_curve(settings), reference_curve(settings, fp16.skipped)
    assert plain[:7] == skipping[:7] and plain[7:] != skipping[7:]  # the skipped update shows from the next step on
    outcome = _run(dataclasses.replace(_ctx(1, training_steps=10), seed=8), "loss_curve/fp16")["loss_curve/fp16-mixed"]
    assert outcome.status == "pass", outcome.reason
    assert outcome.data["skipped_steps"] == [7] and outcome.metrics["skipped_updates"] == 1.0
