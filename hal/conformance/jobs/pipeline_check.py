"""A heterogeneous pipelined plan must train exactly like its single-device run.

The plan runs through the real engine (``parallel.pipeline.engine.PipelineEngine`` on ``parallel.config.topology``
groups over ``collectives``) in one spawned job; the single-device run is ``full_model`` on one
device of the same backend, with the same seed, data and AdamW. They compute the gradient of the
same loss (the engine's loss convention makes every split equal the plain mean), so they agree up
to summation order: first-step loss within 1e-5 relative, every parameter's step-1 gradient
(gathered to full shape) within 1e-5 relative L2, the loss curve within 1e-4 relative — the
bounds of the engine's own equivalence tests.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from hal.parallel.config.model import ModelConfig

if TYPE_CHECKING:
    from hal.collectives import World

FIRST_LOSS_RTOL = 1e-5
CURVE_RTOL = 1e-4
GRAD_REL_L2 = 1e-5
LR = 3e-3
MICRO_BATCHES, MICRO_BATCH_SIZE = 4, 2


def plans(backend: str) -> dict[str, dict[str, Any]]:
    """Plans by name, largest first; each fits the world size its stages' devices add up to."""
    common = {"schedule": "1f1b", "micro_batches": MICRO_BATCHES, "micro_batch_size": MICRO_BATCH_SIZE}
    return {
        "2stage_tp2_to_dp2": {**common, "stages": [
            {"backend": backend, "devices": 2, "layers": 3, "tp": 2},
            {"backend": backend, "devices": 2, "layers": 1, "dp": 2}]},
        "2stage": {**common, "stages": [
            {"backend": backend, "devices": 1, "layers": 2},
            {"backend": backend, "devices": 1, "layers": 2}]},
    }


def moe_model(model: ModelConfig, plan: dict[str, Any]) -> ModelConfig:
    """``model`` with MoE layers (4 experts, top-2, balancing and z losses) in the plan's last stage, which runs
    them data-parallel when it has dp (MoE stages run at tp 1; the stages before keep dense layers)."""
    from dataclasses import replace

    last = int(plan["stages"][-1]["layers"])
    return replace(model, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=model.ffn_hidden_size // 2,
                   moe_first_dense=model.num_layers - last, moe_aux_loss_weight=0.01, moe_z_loss_weight=0.001)


def world_of(plan: dict[str, Any]) -> int:
    return sum(int(s["devices"]) for s in plan["stages"])


def choose_plan(backend: str, slots: int) -> tuple[str, dict[str, Any]] | None:
    """The largest plan that fits ``slots`` process slots (None below 2)."""
    for name, plan in plans(backend).items():
        if world_of(plan) <= slots:
            return name, plan
    return None


def tokens(seed: int, step: int, model: ModelConfig, data: str = "corpus") -> torch.Tensor:
    """Step ``step``'s (micro_batches, micro_batch_size, seq + 1) token ids: the engine's batch layout."""
    from hal.parallel.data.batches import global_batch

    return global_batch(data, seed, step, MICRO_BATCHES, MICRO_BATCH_SIZE, model.max_seq_len, model.vocab_size)


def single_device_run(model: ModelConfig, steps: int, seed: int, device: torch.device) -> dict[str, Any]:
    """The plain single-device run: losses per step and step-1 gradients (float64, host)."""
    from hal.parallel.models.layers import vocab_parallel_cross_entropy
    from hal.parallel.models.stage import full_model

    net = full_model(model, seed).to(device)
    net.configure_moe(1.0 / MICRO_BATCHES)  # MoE: each micro-batch's balancing loss, as the engine makes it
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    seq = model.max_seq_len
    for step in range(steps):
        t = tokens(seed, step, model).to(device)
        opt.zero_grad(set_to_none=True)
        if model.is_moe:  # the balancing loss is per micro-batch: run them one by one (the same mean LM loss)
            loss = sum(vocab_parallel_cross_entropy(net(t[m, :, :-1]), t[m, :, 1:], None) / MICRO_BATCHES
                       for m in range(MICRO_BATCHES))
        else:
            loss = vocab_parallel_cross_entropy(net(t[..., :-1].reshape(-1, seq)), t[..., 1:].reshape(-1, seq), None)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in net.named_parameters()}
        opt.step()
        losses.append(float(loss.detach().cpu()))
    return {"losses": losses, "grads": grads}


def run_rank(world: World, spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of the plan through the engine: last-stage losses, full step-1 gradients (one TP rank)."""
    from hal.parallel.config.plan import parse_plan, validate_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.models.shards import gather_full_grads
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    model = ModelConfig(**spec["model"])
    plan = parse_plan(spec["plan"], origin="conformance pipeline plan")
    validate_plan(plan, model, world_size=world.size, check_backends=False, origin="conformance pipeline plan")
    topology = Topology.from_plan(plan)
    groups = build_mesh(topology, world)
    engine = build_engine(model, plan, groups, backend=world.backend, seed=spec["seed"], device=world.device)
    opt = torch.optim.AdamW(engine.module.parameters(), lr=LR)
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(int(spec["steps"])):
        opt.zero_grad(set_to_none=True)
        loss = engine.step(tokens(spec["seed"], step, model))
        if step == 0:
            full = gather_full_grads(engine.module)  # collective over the TP group
            if groups.coord.dp == 0 and groups.coord.tp == 0:
                grads = {n: g.to("cpu", torch.float64) for n, g in full.items()}
        opt.step()
        if loss is not None:
            losses.append(loss)
    return {"coord": list(groups.coord), "losses": losses, "grads": grads}


def compare(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, Any]:
    """Metrics, the first broken bound and the curves of the engine run against the single-device run."""
    last = max(r["coord"][0] for r in ranks)
    curves = [r["losses"] for r in ranks if r["coord"][0] == last]
    ref = reference["losses"]
    curve = curves[0]
    first_rel = max(abs(c[0] - ref[0]) / abs(ref[0]) for c in curves)
    curve_rel = max(abs(a - b) / abs(b) for c in curves for a, b in zip(c, ref))
    replicas_differ = any(c != curve for c in curves)
    worst_param, worst_rel = "", 0.0
    seen: set[str] = set()
    for r in ranks:
        for name, got in r["grads"].items():
            want = reference["grads"][name]
            norm = float(want.norm())
            rel = float((got - want).norm()) / norm if norm > 0 else float((got - want).norm())
            if not math.isfinite(rel) or rel >= worst_rel:
                worst_param, worst_rel = name, rel if math.isfinite(rel) else float("inf")
            seen.add(name)
    missing = sorted(set(reference["grads"]) - seen)
    metrics = {"first_loss_rel": first_rel, "loss_curve_max_rel": curve_rel, "grad_rel_l2": worst_rel,
               "missing_grads": float(len(missing))}
    tolerance = {"first_loss_rel": FIRST_LOSS_RTOL, "loss_curve_max_rel": CURVE_RTOL, "grad_rel_l2": GRAD_REL_L2, "missing_grads": 0.0}
    failed, reason = None, ""
    if missing:
        failed, reason = "missing_grads", f"no rank returned the gradient of {', '.join(missing[:3])}"
    elif len(curve) != len(ref) or replicas_differ:
        failed = "loss_curve_max_rel"
        reason = ("the last stage's replicas report different loss curves" if replicas_differ
                  else "the engine returned a loss curve of the wrong length")
    elif first_rel > FIRST_LOSS_RTOL:
        failed, reason = "first_loss_rel", f"first-step loss {curve[0]:.8g} vs single-device {ref[0]:.8g} (rel {first_rel:.3g} > {FIRST_LOSS_RTOL:g})"
    elif worst_rel > GRAD_REL_L2:
        failed, reason = "grad_rel_l2", f"step-1 gradient of {worst_param} differs by rel L2 {worst_rel:.3g} > {GRAD_REL_L2:g}"
    elif curve_rel > CURVE_RTOL:
        failed, reason = "loss_curve_max_rel", f"loss curves part by up to {curve_rel:.3g} relative (> {CURVE_RTOL:g})"
    data = {"steps": list(range(1, len(curve) + 1)), "loss": curve, "reference_loss": ref, "worst_param": worst_param}
    return {"metrics": metrics, "tolerance": tolerance, "failed_metric": failed, "reason": reason, "data": data}
