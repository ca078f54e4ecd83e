"""Per-rank bodies for the multi-process collective tests (run through tests.dist_harness).

Inputs are small integers derived from (rank, index), so every sum, max, min and product is
exact in fp32, bf16 and int64 whatever the reduction order: results are compared bitwise with
a reference each rank computes locally from every rank's known inputs.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
N = 6  # elements per rank (divisible by 2 and 3; reduce_scatter pads to the world below)


def host_value(rank: int, n: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Small integers 1..3: sums ≤ 12 and products ≤ 81 stay exact in bf16."""
    return ((torch.arange(n) + rank + offset) % 3 + 1).to(dtype)


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.double() for t in tensors])
    result = {"sum": stacked.sum(0), "max": stacked.max(0).values, "min": stacked.min(0).values,
              "product": stacked.prod(0), "avg": stacked.sum(0)}[op]
    out = result.to(tensors[0].dtype)
    return out / len(tensors) if op == "avg" else out


def op_matrix(rank: int, world: int, dtypes: tuple[str, ...] = tuple(DTYPES)) -> list[tuple[str, bool, str]]:
    """Every collective in every dtype against its local reference; returns (case, ok, detail)."""
    from hal.collectives import P2P, world_communicator

    comm = world_communicator()
    dev = comm.device
    results: list[tuple[str, bool, str]] = []

    def case(name: str, got: Any, expected: Any) -> None:
        """Compare on the host; every result must also live on this rank's device."""
        if isinstance(expected, list):
            ok = isinstance(got, list) and len(got) == len(expected) and all(
                g.device == dev and torch.equal(g.cpu(), e.cpu()) for g, e in zip(got, expected))
        else:
            ok = isinstance(got, torch.Tensor) and got.device == dev and got.dtype == expected.dtype and torch.equal(got.cpu(), expected.cpu())
        results.append((name, ok, "" if ok else f"got {got} expected {expected}"))

    def value(rank: int, n: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return host_value(rank, n, dtype, offset).to(dev)

    for dname in dtypes:
        dt = DTYPES[dname]
        everyone = [value(r, N, dt) for r in range(world)]
        for op in ("sum", "max", "min", "product") + (("avg",) if dt.is_floating_point else ()):
            case(f"{dname} all_reduce {op}", comm.all_reduce(value(rank, N, dt), op), _reduce(everyone, op))
        case(f"{dname} all_gather", comm.all_gather(value(rank, N, dt)), torch.cat(everyone))
        uneven = [value(r, r + 1, dt, 5) for r in range(world)]
        case(f"{dname} all_gather uneven", comm.all_gather(uneven[rank]), torch.cat(uneven))
        case(f"{dname} all_gather_list uneven", comm.all_gather_list(uneven[rank]), uneven)
        rows = [value(r, 2 * world, dt) for r in range(world)]
        for op in ("sum", "max"):
            case(f"{dname} reduce_scatter {op}", comm.reduce_scatter(rows[rank].clone(), op),
                 _reduce(rows, op).view(world, 2)[rank])
        # all_to_all: rank r sends block j (2 elements) to rank j.
        blocks = [value(r, 2 * world, dt, 7) for r in range(world)]
        case(f"{dname} all_to_all", comm.all_to_all(blocks[rank].clone()),
             torch.cat([blocks[r].view(world, 2)[rank] for r in range(world)]))
        # uneven: rank r sends (j + 1) elements to rank j.
        splits = [j + 1 for j in range(world)]
        sources = [value(r, sum(splits), dt, 11) for r in range(world)]
        case(f"{dname} all_to_all uneven", comm.all_to_all(sources[rank].clone(), input_splits=splits),
             torch.cat([sources[r].split(splits)[rank] for r in range(world)]))
        src = world - 1
        case(f"{dname} broadcast", comm.broadcast(value(rank, N, dt, 3), src=src), value(src, N, dt, 3))
        reduced = comm.reduce(value(rank, N, dt), dst=0, op="sum")
        if rank == 0:
            case(f"{dname} reduce", reduced, _reduce(everyone, "sum"))
        gathered = comm.gather(value(rank, N, dt), dst=src)
        if rank == src:
            case(f"{dname} gather", gathered, everyone)
        chunks = [value(r, N, dt, 13) for r in range(world)] if rank == 0 else None
        case(f"{dname} scatter", comm.scatter(torch.zeros(N, dtype=dt, device=dev), chunks, src=0), value(rank, N, dt, 13))
        right, left = (rank + 1) % world, (rank - 1) % world
        got = comm.batch_p2p([P2P("send", value(rank, N, dt, 17), right), P2P("recv", torch.zeros(N, dtype=dt, device=dev), left)])
        case(f"{dname} batch_p2p ring", got, [value(left, N, dt, 17)])
        if rank == 0:
            comm.send(value(0, N, dt, 19), dst=1)
        elif rank == 1:
            case(f"{dname} send/recv", comm.recv(torch.zeros(N, dtype=dt, device=dev), src=0), [value(0, N, dt, 19)])
        into = torch.zeros(world * N, dtype=dt, device=dev)
        gathered_into = comm.all_gather(value(rank, N, dt), out=into)
        case(f"{dname} all_gather out=", gathered_into, torch.cat(everyone))
        results.append((f"{dname} all_gather out= is out", gathered_into.data_ptr() == into.data_ptr(), ""))
        slot = torch.zeros(2, dtype=dt, device=dev)
        case(f"{dname} reduce_scatter out=", comm.reduce_scatter(rows[rank].clone(), "sum", out=slot),
             _reduce(rows, "sum").view(world, 2)[rank])
        inbox = torch.zeros(2 * world, dtype=dt, device=dev)
        case(f"{dname} all_to_all out=", comm.all_to_all(blocks[rank].clone(), out=inbox),
             torch.cat([blocks[r].view(world, 2)[rank] for r in range(world)]))
        handle = comm.all_reduce(value(rank, N, dt), "sum", async_op=True)
        case(f"{dname} async all_reduce", handle.wait(), _reduce(everyone, "sum"))
    # A sub-group: every rank creates it (torch's rule); only members may call it.
    members = [0, world - 1]
    sub = comm.subgroup(members)
    if rank in members:
        case("subgroup all_reduce", sub.all_reduce(value(rank, N, torch.int64)),
             _reduce([value(r, N, torch.int64) for r in members], "sum"))
        case("subgroup all_gather", sub.all_gather(value(rank, 2, torch.int64)), torch.cat([value(r, 2, torch.int64) for r in members]))
    else:
        refused = _error_of(lambda: sub.all_reduce(value(rank, N, torch.int64)))
        results.append(("subgroup refuses non-members", "is not in this group" in refused, refused))
    comm.barrier()
    return results


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each scenario returns this rank's error; the test checks every rank saw the same one."""
    from hal.collectives import P2P, world_communicator

    comm = world_communicator()
    dev = comm.device
    ones = lambda *shape, dtype=torch.float32: torch.ones(*shape, dtype=dtype, device=dev)  # noqa: E731
    ok = ones(4)
    errors = {
        "shape": _error_of(lambda: comm.all_reduce(ones(4 if rank else 5))),
        "dtype": _error_of(lambda: comm.all_reduce(ones(4, dtype=torch.float64 if rank == 1 else torch.float32))),
        "device": _error_of(lambda: comm.all_reduce(torch.empty(4, device="meta") if rank == 1 else ok.clone())),
        "op order": _error_of(lambda: comm.broadcast(ok.clone(), src=0) if rank == 0 else comm.all_reduce(ok.clone())),
        "reduce op": _error_of(lambda: comm.all_reduce(ok.clone(), "max" if rank == 2 else "sum")),
        "indivisible": _error_of(lambda: comm.reduce_scatter(ones(world + 1))),
        "int avg": _error_of(lambda: comm.all_reduce(ones(4, dtype=torch.int64), "avg")),
        "trailing": _error_of(lambda: comm.all_gather(ones(2, 3 if rank else 4))),
        "out shape": _error_of(lambda: comm.all_gather(ones(2), out=ones(2 * world + 1))),
    }
    if rank in (0, 1):
        peer = 1 - rank
        kind = "send" if rank == 0 else "recv"
        errors["p2p shape"] = _error_of(lambda: comm.batch_p2p([P2P(kind, ones(3 if rank == 0 else 4), peer)]))
    # The group is still usable after every refused call.
    errors["after"] = str(comm.all_reduce(ones(2)).tolist())
    return errors


def late_rank(rank: int, world: int, late: int, timeout_s: float, sleep_s: float) -> dict[str, Any]:
    """Rank ``late`` arrives long after the others' timeout: they must fail fast with a clear error."""
    from hal.collectives import world_communicator

    comm = world_communicator()
    if rank == late:
        time.sleep(sleep_s)
    start = time.monotonic()
    error = _error_of(lambda: comm.all_reduce(torch.ones(2, device=comm.device), timeout=datetime.timedelta(seconds=timeout_s)))
    return {"error": error, "seconds": time.monotonic() - start}


def declared_gaps(rank: int, world: int) -> dict[str, Any]:
    """Declare CCL gaps on the cpu backend (capability data) and check both handlings really run."""
    from hal.backend import CclGap
    from hal.backends.cpu import CpuBackend
    from hal.collectives import world_communicator
    from hal.downgrades import fallback_policy, recorded_downgrades

    CpuBackend.ccl_gaps = (
        CclGap("float64", "all_reduce", "host", "test: pretend gloo lacks float64 sums"),
        CclGap("int16", None, "refuse", "test: pretend gloo lacks int16"),
    )
    comm = world_communicator()
    with fallback_policy("allow"):
        staged = comm.all_reduce(torch.full((3,), float(rank + 1), dtype=torch.float64)).tolist()
    refused = _error_of(lambda: comm.all_reduce(torch.ones(2, dtype=torch.int16)))
    with fallback_policy("error"):
        strict = _error_of(lambda: comm.all_reduce(torch.ones(2, dtype=torch.float64)))
    return {"staged": staged, "refused": refused, "strict": strict,
            "downgrades": [d.describe() for d in recorded_downgrades() if d.kind == "ccl"]}


def async_bridged_p2p(rank: int, world: int, gate: str) -> list[float]:
    """Two islands of one rank: rank 0 posts an asynchronous receive over the bridge and only then opens the gate
    rank 1 waits at before it sends. A post that waited for its peer (a bridged call completing inside itself)
    would never open the gate: the run would hang past its deadline. Also: a synchronous call queued behind it runs
    after it (posting order), and the received values are the sent ones."""
    import torch.distributed as dist

    from hal.collectives import P2P, world_communicator

    comm = world_communicator(validate=False)
    store = dist.FileStore(gate, world)
    if rank == 0:
        first, second = torch.zeros(4), torch.zeros(4)
        handle = comm.batch_p2p([P2P("recv", first, 1)], async_op=True)
        store.set("posted", "1")
        comm.batch_p2p([P2P("recv", second, 1)])  # behind the first: it cannot complete before it
        assert handle.is_completed()
        (got,) = handle.wait()
        return got.tolist() + second.tolist()
    store.wait(["posted"], datetime.timedelta(seconds=60))
    comm.batch_p2p([P2P("send", torch.arange(4, dtype=torch.float32), 0)])
    comm.batch_p2p([P2P("send", torch.arange(4, dtype=torch.float32) + 10, 0)])
    return []
