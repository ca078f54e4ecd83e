"""Rank bodies for tests/ranks/test_moe_dispatch.py: expert-parallel dispatch and combine on real gloo ranks."""
from __future__ import annotations

from typing import Any

import torch

HIDDEN = 3


def skewed_load(rank: int, world: int, local: int) -> torch.Tensor:
    """Rows rank ``rank`` routes to each global expert: the last rank's experts get none, expert 1 of rank 0
    gets most, local expert 0 of every rank but rank 0 gets none from odd ranks."""
    load = torch.zeros(world * local, dtype=torch.long)
    for e in range(world * local):
        owner, j = divmod(e, local)
        if owner == world - 1:
            continue
        load[e] = 9 + rank if (owner, j) == (0, 1 % local) else (0 if j == 0 and owner and rank % 2 else 1 + (e + rank) % 3)
    return load


def rows_of(rank: int, load: torch.Tensor, world: int, local: int) -> torch.Tensor:
    """Rank ``rank``'s rows in dispatch order (local expert major, owner rank minor), each row naming itself:
    (source rank, global expert, index inside that expert's rows)."""
    rows = []
    for j in range(local):
        for owner in range(world):
            e = owner * local + j
            rows += [[float(rank), float(e), float(i)] for i in range(int(load[e]))]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, HIDDEN)


def exchange(rank: int, world: int, local: int, validate: bool = True, dtype: str = "float64",
             path: str = "all_to_all", rounds: int = 1, hold: bool = False, pool_mib: int | None = None) -> dict[str, Any]:
    """Dispatch this rank's rows, scale what arrives per local expert, combine; and the backward. On the rank's
    device (gloo: cpu; NCCL: its GPU); ``validate=False`` as the engine builds its groups (NCCL: one grouped launch).
    ``path="symmetric"``: through CUDA symmetric memory (hal.collectives.symmetric_exchange), ``rounds`` times in
    a row (its staging slots alternate), each round's results checked alike; ``hold`` keeps every round's results
    alive until the last round is done (so durable slots stay taken and later rounds land in staging), and
    ``pool_mib`` sets the durable slots' budget."""
    import os

    from hal.collectives import world_communicator
    from hal.parallel.models.moe import combine, dispatch

    if pool_mib is not None:
        from hal.collectives.exchange_slots import POOL_ENV

        os.environ[POOL_ENV] = str(pool_mib)
    comm = world_communicator(validate=validate)
    load = skewed_load(rank, world, local).to(comm.device)
    results = []
    ex = None
    for _ in range(rounds):
        rows = rows_of(rank, load.cpu(), world, local).to(comm.device, getattr(torch, dtype)).requires_grad_(True)
        if path == "symmetric":
            from hal.collectives.symmetric_exchange import exchange_for

            ex = exchange_for(comm, rows.shape[0], rows.shape[1], rows.dtype, world * local)
            arrived, droute = ex.dispatch(rows, rows[:, 1].detach().long(), load)
            counts = torch.diff(droute.offsets.long(), prepend=droute.offsets.new_zeros(1).long()).tolist()
            scale = torch.cat([torch.full((n, 1), 2.0 + j, dtype=rows.dtype, device=rows.device) for j, n in enumerate(counts)]
                              + [torch.zeros((arrived.shape[0] - sum(counts), 1), dtype=rows.dtype, device=rows.device)])
            back = ex.combine(arrived * scale, droute)
            arrived = arrived[:sum(counts)]
            send = torch.bincount(rows[:, 1].detach().long() // local, minlength=world).tolist()
            recv = None  # never on the host: the rows per local expert (counts) stand for it
            grouped = False
        else:
            arrived, route = dispatch(rows, load, comm, local)
            counts, send, recv = route.counts, route.send_splits, route.recv_splits
            scale = torch.cat([torch.full((n, 1), 2.0 + j, dtype=rows.dtype, device=rows.device) for j, n in enumerate(counts)])
            back = combine(arrived * scale, route)
            grouped = comm._groups_all_to_alls(rows)
        back.sum().backward()
        results.append({"arrived": arrived.detach(), "counts": counts, "back": back.detach(), "rows": rows.detach(),
                        "grad": rows.grad, "send": send, "recv": recv, "grouped": grouped})
        if not hold:
            results[-1] = _listed(results[-1])
        del arrived, back
    results = [_listed(r) for r in results]  # held rounds are read only now, after every later round ran
    if rounds == 1:
        return results[0]
    return {"rounds": results, "copied": ex.copied if ex else None,
            "durable": len(ex.durable_rows) if ex else None}


def _listed(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double().tolist() if isinstance(v, torch.Tensor) else v for k, v in result.items()}


def uncombined_dispatch(rank: int, world: int, local: int = 1) -> str:
    """Two dispatches, then the first one's combine: one line on every rank, before anything is stored."""
    from hal.collectives import world_communicator
    from hal.collectives.symmetric_exchange import exchange_for

    comm = world_communicator(validate=False)
    load = skewed_load(rank, world, local).to(comm.device)
    rows = rows_of(rank, load.cpu(), world, local).to(comm.device, torch.bfloat16)
    ex = exchange_for(comm, rows.shape[0], rows.shape[1], rows.dtype, world * local)
    experts = rows[:, 1].long()
    first, route = ex.dispatch(rows, experts, load)
    ex.dispatch(rows, experts, load)
    try:
        ex.combine(first, route)
        said = "no error"
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        said = f"{type(e).__name__}: {e}"
    comm.all_reduce(torch.zeros(1, device=comm.device))  # no rank leaves while another still connects
    return said


def bad_blocks(rank: int, world: int) -> dict[str, str]:
    """all_to_all_blocks with malformed block tables: each one error naming the table, before anything is sent."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=False)
    x = torch.zeros(4, HIDDEN)
    tables = {
        "short row": ([[2, 2, 0]], [[2, 2]]),
        "negative": ([[5, -1]], [[2, 2]]),
        "rows do not add up": ([[1, 1]], [[2, 2]]),
        "row counts differ": ([[2, 2]], [[2, 2], [0, 0]]),
    }
    said = {}
    for name, (send, recv) in tables.items():
        try:
            comm.all_to_all_blocks(x, send, recv)
            said[name] = "no error"
        except Exception as exc:  # noqa: BLE001 — the type and text are what is checked
            said[name] = f"{type(exc).__name__}: {exc}"
    # Every refusal is local: without one collective a rank could leave while its peer still connects the host
    # group's mesh, and that peer then fails ("Connection closed by peer"): this test failed 1 run in 4 so.
    comm.all_reduce(torch.zeros(1))
    return said


def exchange_choice(rank: int, world: int, asked: str | None) -> dict[str, Any]:
    """Which exchange an MoE block's group takes (``HAL_MOE_EXCHANGE`` = ``asked``), or the one line refusing it."""
    import os

    from hal.collectives import world_communicator
    from hal.collectives.symmetric_exchange import ENV, choose

    if asked is not None:
        os.environ[ENV] = asked
    comm = world_communicator(validate=False)
    try:
        said = {"path": list(choose(comm, 64 + rank, 32, torch.bfloat16))}
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        said = {"error": f"{type(e).__name__}: {e}"}
    comm.all_reduce(torch.zeros(1, device=comm.device))  # no rank leaves while another still connects
    return said


def moe_block_paths(rank: int, world: int, tokens: int = 96, hidden: int = 256, local: int = 2) -> dict[str, Any]:
    """One MoE block (ep = world, bf16, grouped experts) run through both exchanges on the same weights and input:
    outputs, input gradients and every parameter's gradient, and which path each run took. Memory the caching
    allocator hands out is first filled with NaN, so rows past the arrived ones (never written) would show."""
    import os

    from hal.collectives import world_communicator
    from hal.collectives.symmetric_exchange import ENV
    from hal.parallel.models.moe import MoE, MoEConfig

    comm = world_communicator(validate=False)
    device = comm.device
    torch.manual_seed(0)  # the same router on every rank; each rank's experts are its own draw
    block = MoE(hidden, MoEConfig(num_experts=world * local, top_k=2, expert_ffn_size=128, shared_ffn_size=64),
                ep_group=comm).to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(10 + rank)
    logit_bias = torch.zeros(hidden)
    logit_bias[: hidden // 4] = 2.0  # a skew: some experts get far more rows than others
    x0 = (torch.randn(tokens, hidden, generator=gen) + logit_bias).to(device, torch.bfloat16)
    runs = {}
    for path in ("all_to_all", "symmetric"):
        os.environ[ENV] = path
        block._exchange_choices.clear()
        block.zero_grad(set_to_none=True)
        torch.full((64 * 2**20,), float("nan"), device=device).sum()  # NaN-filled blocks back in the cache
        x = x0.clone().requires_grad_(True)
        out, stats = block(x)
        (out.float().square().mean() + block.loss(stats)).backward()
        runs[path] = {"exchange": block.exchange, "out": out.detach().float().cpu(), "x_grad": x.grad.float().cpu(),
                      "grads": {n: p.grad.float().cpu() for n, p in block.named_parameters() if p.grad is not None}}
    a, b = runs["all_to_all"], runs["symmetric"]

    def worst(u: torch.Tensor, v: torch.Tensor) -> float:
        return float(((u - v).abs() / (v.abs().max() + 1e-12)).max())

    return {"paths": [a["exchange"], b["exchange"]], "finite": bool(all(torch.isfinite(t).all() for r in runs.values()
                                                                      for t in [r["out"], r["x_grad"], *r["grads"].values()])),
            "out": worst(b["out"], a["out"]), "x_grad": worst(b["x_grad"], a["x_grad"]),
            "grads": {n: worst(b["grads"][n], g) for n, g in a["grads"].items()},
            "same_params": sorted(a["grads"]) == sorted(b["grads"])}
