"""Per-rank bodies for the ZeRO-1 tests (run through tests.dist_harness).

Each rank runs the sharded optimizer on its own gradients and, in the same process, the plain
AdamW reference on the gradients of every rank summed (they are deterministic, so the reference
needs no communication). The rank reports relative errors; the test asserts on them.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

ADAMW = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}
STEPS = 4


def tiny_model() -> torch.nn.Module:
    """39 parameters: not a multiple of 2 or 4, so the flat buffer is padded at every dp tested."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 7, bias=False))


def local_backward(model: torch.nn.Module, step: int, rank: int) -> None:
    """Accumulate the gradient of rank ``rank``'s loss at ``step`` (distinct data per rank and step)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 5, generator=g)).pow(2).sum().backward()


def summed_backward(model: torch.nn.Module, step: int, world: int) -> None:
    for r in range(world):
        local_backward(model, step, r)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def param_error(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    return max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters()))


def state_error(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Max relative error between two optimizer state dicts in the full form; inf if their structure differs."""
    if set(got["state"]) != set(want["state"]):
        return float("inf")
    groups = [{k: v for k, v in g.items()} for g in (got["param_groups"][0], want["param_groups"][0])]
    if groups[0] != groups[1] or len(got["param_groups"]) != 1:
        return float("inf")
    worst = 0.0
    for i, state in want["state"].items():
        if list(got["state"][i]) != list(state):
            return float("inf")
        for key, value in state.items():
            mine = got["state"][i][key]
            if mine.shape != value.shape:
                return float("inf")
            worst = max(worst, rel(mine, value) if value.dim() else abs(float(mine) - float(value)))
    return worst


class _Run:
    """One model copy and its optimizer, stepped one way."""

    def __init__(self, base: torch.nn.Module, make: Any) -> None:
        self.model = copy.deepcopy(base)
        self.opt = make(self.model.parameters())


def _step_all(runs: dict[str, _Run], ref: _Run, comm: Any, step: int, world: int) -> None:
    from hal.parallel.loop.zero import ZeroOne

    ref.opt.zero_grad()
    summed_backward(ref.model, step, world)
    ref.opt.step()
    for how, run in runs.items():
        run.opt.zero_grad()
        local_backward(run.model, step, comm.group_rank)
        if how.startswith("rs"):
            assert isinstance(run.opt, ZeroOne)
            run.opt.reduce_scatter_and_step()
        else:
            for p in run.model.parameters():
                comm.all_reduce(p.grad, "sum")
            run.opt.step()


def zero_vs_adamw(rank: int, world: int, comm: Any = None) -> dict[str, Any]:
    """dp = the whole world: both update paths against plain AdamW; state dict out and back in."""
    from hal.collectives import world_communicator
    from hal.parallel.loop.zero import Zero1AdamW

    comm = comm or world_communicator()
    base = tiny_model()
    ref = _Run(base, lambda ps: torch.optim.AdamW(ps, **ADAMW))
    runs = {"step": _Run(base, lambda ps: Zero1AdamW(ps, comm, **ADAMW)),
            "rs": _Run(base, lambda ps: Zero1AdamW(ps, comm, **ADAMW))}
    errors: dict[str, float] = {}
    for step in range(STEPS):
        _step_all(runs, ref, comm, step, comm.size)
        for how, run in runs.items():
            errors[how] = max(errors.get(how, 0.0), param_error(run.model, ref.model))
    full = runs["rs"].opt.state_dict()
    out = {"errors": errors, "state_error": state_error(full, ref.opt.state_dict()),
           "state_numel": runs["rs"].opt.state_numel, "total": sum(p.numel() for p in base.parameters())}
    out["resume_errors"] = _resume(runs["rs"], full, ref, comm)
    return out


def _resume(trained: _Run, full: dict[str, Any], ref: _Run, comm: Any) -> dict[str, float]:
    """Load the full state into a fresh ZeRO optimizer and a plain AdamW; both continue like the reference."""
    from hal.parallel.loop.zero import Zero1AdamW

    resumed = {"rs-loaded": _Run(trained.model, lambda ps: Zero1AdamW(ps, comm, **ADAMW)),
               "plain-loaded": _Run(trained.model, lambda ps: torch.optim.AdamW(ps, **ADAMW))}
    for run in resumed.values():
        run.opt.load_state_dict(copy.deepcopy(full))
    plain = resumed.pop("plain-loaded")
    errors: dict[str, float] = {}
    for step in range(STEPS, STEPS + 2):
        _step_all(resumed, ref, comm, step, comm.size)
        plain.opt.zero_grad()
        summed_backward(plain.model, step, comm.size)
        plain.opt.step()
        errors["rs-loaded"] = max(errors.get("rs-loaded", 0.0), param_error(resumed["rs-loaded"].model, ref.model))
        errors["plain-loaded"] = max(errors.get("plain-loaded", 0.0), param_error(plain.model, ref.model))
    return errors


def dp1_identity(rank: int, world: int) -> dict[str, Any]:
    """A size-1 dp group: ZeroOne is the plain optimizer — bitwise equal parameters and state."""
    from hal.collectives import world_communicator
    from hal.parallel.loop.zero import Zero1AdamW

    world_comm = world_communicator()
    singles = [world_comm.subgroup([r]) for r in range(world)]  # every rank creates every group
    comm = singles[rank]
    base = tiny_model()
    ref = _Run(base, lambda ps: torch.optim.AdamW(ps, **ADAMW))
    zero = _Run(base, lambda ps: Zero1AdamW(ps, comm, **ADAMW))
    for step in range(STEPS):
        for run in (ref, zero):
            run.opt.zero_grad()
            local_backward(run.model, step, 0)
            run.opt.step()
    same = all(torch.equal(p, q) for p, q in zip(zero.model.parameters(), ref.model.parameters()))
    return {"bitwise": same, "sharded": zero.opt.sharded, "state_error": state_error(zero.opt.state_dict(), ref.opt.state_dict())}


def world2(rank: int, world: int) -> dict[str, Any]:
    """Everything one 2-process launch checks: dp=2 against AdamW, and dp=1 identity."""
    return {"dp2": zero_vs_adamw(rank, world), "dp1": dp1_identity(rank, world)}


def world4(rank: int, world: int) -> dict[str, Any]:
    """dp=4; a dp=4 checkpoint resumed at dp=2; ZeRO inside the engine (plan tp2 × dp2)."""
    from hal.collectives import world_communicator

    world_comm = world_communicator()
    out: dict[str, Any] = {"dp4": zero_vs_adamw(rank, world, world_comm)}
    halves = [world_comm.subgroup([0, 1]), world_comm.subgroup([2, 3])]
    out["dp4_to_dp2"] = _reshard_resume(world_comm, halves[rank // 2])
    out["engine"] = engine_zero(rank, world)
    return out


def _reshard_resume(dp4: Any, dp2: Any) -> float:
    """Train 2 steps at dp=4, save, resume at dp=2 on the same (world-summed) gradients: equal to AdamW."""
    from hal.parallel.loop.zero import Zero1AdamW

    base = tiny_model()
    ref = _Run(base, lambda ps: torch.optim.AdamW(ps, **ADAMW))
    first = _Run(base, lambda ps: Zero1AdamW(ps, dp4, **ADAMW))
    for step in range(2):
        _step_all({"step": first}, ref, dp4, step, dp4.size)
    second = _Run(first.model, lambda ps: Zero1AdamW(ps, dp2, **ADAMW))
    second.opt.load_state_dict(first.opt.state_dict())
    worst = 0.0
    for step in range(2, 4):
        ref.opt.zero_grad()
        summed_backward(ref.model, step, dp4.size)
        ref.opt.step()
        second.opt.zero_grad()
        summed_backward(second.model, step, dp4.size)  # the pre-summed gradient every replica holds
        second.opt.step()
        worst = max(worst, param_error(second.model, ref.model))
    return worst


ENGINE_PLAN = {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 2,
               "stages": [{"backend": "cpu", "devices": 4, "layers": 4, "tp": 2, "dp": 2}]}
ENGINE_STEPS, ENGINE_LR = 3, 3e-3


def engine_zero(rank: int, world: int) -> dict[str, list[float]]:
    """The engine with Zero1AdamW, both ways: after its dp all-reduce (step) and instead of it (reduce-scatter)."""
    from hal.collectives import current_world
    from hal.parallel.config.plan import parse_plan
    from hal.parallel.config.topology import Topology
    from hal.parallel.loop.zero import Zero1AdamW
    from hal.parallel.pipeline.build import build_engine
    from hal.parallel.pipeline.mesh import build_mesh

    from .engine_cases import MODEL, batch

    plan = parse_plan(ENGINE_PLAN)
    topology = Topology.from_plan(plan)
    joined = current_world()
    groups = build_mesh(topology, joined, validate=False)  # as hal train runs it
    out: dict[str, list[float]] = {}
    for how in ("step", "rs"):
        engine = build_engine(MODEL, plan, groups, backend=joined.backend, seed=0, device=torch.device("cpu"))
        if how == "rs":
            engine.dp_grads = "optimizer"  # the reduce-scatter sums instead
        opt = Zero1AdamW(engine.module.parameters(), groups.dp, lr=ENGINE_LR)
        losses = []
        for step in range(ENGINE_STEPS):
            tokens = batch(0, step, plan.micro_batches, plan.micro_batch_size, MODEL.max_seq_len, MODEL.vocab_size)
            opt.zero_grad()
            losses.append(engine.step(tokens))
            opt.step() if how == "step" else opt.reduce_scatter_and_step()
        out[how] = losses
    return out
