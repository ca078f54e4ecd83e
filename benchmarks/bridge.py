"""Bridge point-to-point bandwidth on one GPU machine: 1 CUDA rank + N CPU ranks.

Rank 0 runs ``cuda``, the others ``cpu``, so the world has two islands and every call between
them goes through ``collectives.bridge``. The run first checks correctness (bridged all_reduce,
all_gather and P2P in both directions, sizes that are not a multiple of the chunk), then measures
bridge P2P rank 0 (GPU) → rank 1 (CPU) for 1 MiB .. 1 GiB against, in the same run:

* ``d2h`` / ``h2d`` — a pinned host↔device copy of the same size on rank 0 (device events);
* ``wire`` — a plain gloo send of the same bytes from rank 0's host memory (no device at all).

A bridge that overlaps its copies with the network runs close to ``wire`` (it cannot beat the
slower of the two); one that does not would take about wire + d2h. ``--cpu-only`` runs the same
thing with two declared CPU islands and staging forced on (for machines without a GPU).

    python benchmarks/bridge.py [--cpu-ranks 1] [--sizes-mib 1,4,16,64,256,1024] [--iters 5]
                                [--chunk-mib 4] [--cpu-only] [--json] [--timeout 900]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.spawn import failures, launch_ranks  # noqa: E402

MIB = 1 << 20
GPU_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
CPU_SIZES_MIB = (1, 4, 16, 64)


# --- what every rank runs ----------------------------------------------------------------------------
def _rank_body(rank: int, world_size: int, store: str, opts: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(2)
    from hal.collectives import init_distributed, shutdown, world_communicator

    if opts["chunk_bytes"]:
        os.environ["HAL_BRIDGE_CHUNK_BYTES"] = str(opts["chunk_bytes"])
    if opts["cpu_only"]:
        os.environ["HAL_BRIDGE_STAGE"] = "always"  # run the staging path even without a device
    backend = "cpu" if opts["cpu_only"] or rank != 0 else "cuda"
    islands = [0] + [1] * (world_size - 1) if opts["cpu_only"] else None
    timeout = datetime.timedelta(seconds=opts["op_timeout_s"])
    world = init_distributed(backend, init_method=f"file://{store}", rank=rank, world_size=world_size, islands=islands, timeout=timeout)
    try:
        comm = world_communicator()
        if comm.path != "bridge":
            raise RuntimeError(f"the world is not bridged (path {comm.path!r}); islands: {world.island_keys}")
        report: dict[str, Any] = {"backend": world.backend.name, "device": str(world.device), "checks": _correctness(comm)}
        report["chunk_bytes"] = comm._bridge.chunk_bytes
        fast = world_communicator(validate=False)  # no per-call checks while timing
        report["timings"] = _bandwidth(fast, opts)
        if rank == 0:
            report["device_name"] = world.backend.device_name(world.device.index or 0)
        comm.barrier()
        return report
    finally:
        shutdown()


def _correctness(comm: Any) -> dict[str, str]:
    """Bridged results against values computed by hand; raises on the first wrong one."""
    rank, size, dev = comm.rank, comm.size, comm.device
    checks: dict[str, str] = {}
    expect_sum = size * (size + 1) // 2
    for dtype in (torch.float32, torch.int64):
        t = torch.full((1000,), rank + 1, dtype=dtype, device=dev)
        comm.all_reduce(t, "sum")
        _require(bool((t == expect_sum).all()), f"all_reduce sum {dtype}: got {t[:4].tolist()}, want {expect_sum}")
        t = torch.full((1000,), rank + 1, dtype=dtype, device=dev)
        comm.all_reduce(t, "max")
        _require(bool((t == size).all()), f"all_reduce max {dtype}: got {t[:4].tolist()}, want {size}")
    avg = comm.all_reduce(torch.full((1000,), rank + 1 / 3, device=dev), "avg")
    rows = comm.all_gather(avg.view(1, -1)).cpu()
    _require(bool((rows == rows[0]).all()), f"all_reduce avg differs between ranks: {rows[:, 0].tolist()}")
    checks["all_reduce"] = "ok (avg identical on every rank)"
    g = comm.all_gather(torch.full((rank + 1, 2), rank, dtype=torch.int64, device=dev))
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int64) for r in range(size)])
    _require(torch.equal(g.cpu(), want), f"all_gather: got {g[:, 0].tolist()}")
    checks["all_gather"] = "ok"
    _check_others(comm)
    checks["reduce_scatter/all_to_all/broadcast/reduce/gather/scatter"] = "ok"
    n = 3 * comm._bridge.chunk_bytes // 4 + 123  # fp32 elements: three chunks and a partial one
    pattern = torch.arange(n, dtype=torch.float32)
    if rank == 0:
        comm.send(pattern.to(dev), 1)
        back = comm.recv(torch.zeros(n, device=dev), 1)[0]
        _require(torch.equal(back.cpu(), pattern * 2), "P2P rank 1 -> rank 0: wrong data")
    elif rank == 1:
        got = comm.recv(torch.zeros(n, device=dev), 0)[0]
        _require(torch.equal(got.cpu(), pattern), "P2P rank 0 -> rank 1: wrong data")
        comm.send(got * 2, 0)
    checks["p2p"] = f"ok ({n * 4} bytes both ways)"
    return checks


def _check_others(comm: Any) -> None:
    """The host-staged and remaining hierarchical ops, with values known in advance."""
    rank, size, dev = comm.rank, comm.size, comm.device
    expect_sum = size * (size + 1) // 2
    rs = comm.reduce_scatter(torch.full((size * 2, 3), rank + 1, dtype=torch.bfloat16, device=dev), "avg")
    _require(bool((rs.float() == expect_sum / size).all()) and rs.device == dev, f"reduce_scatter avg bf16: got {rs.flatten()[:3].tolist()}")
    sent = torch.tensor([100 * rank + j for j in range(size)], dtype=torch.int64, device=dev)
    got = comm.all_to_all(sent)
    _require(got.cpu().tolist() == [100 * j + rank for j in range(size)], f"all_to_all: got {got.tolist()}")
    b = comm.broadcast(torch.full((3,), rank, dtype=torch.float32, device=dev), src=size - 1)
    _require(b.cpu().tolist() == [size - 1] * 3, f"broadcast: got {b.tolist()}")
    r = comm.reduce(torch.full((3,), rank + 1, dtype=torch.int64, device=dev), dst=0)
    _require(rank != 0 or r.cpu().tolist() == [expect_sum] * 3, f"reduce: got {r.tolist()}")
    g = comm.gather(torch.full((2,), rank, dtype=torch.int64, device=dev), dst=0)
    _require(rank != 0 or [x.cpu().tolist() for x in g] == [[i, i] for i in range(size)], f"gather: got {g}")
    chunks = [torch.full((2,), 10 + i, dtype=torch.int64, device=dev) for i in range(size)] if rank == size - 1 else None
    sc = comm.scatter(torch.zeros(2, dtype=torch.int64, device=dev), chunks, src=size - 1)
    _require(sc.cpu().tolist() == [10 + rank] * 2, f"scatter: got {sc.tolist()}")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"bridge result wrong: {what}")


def _bandwidth(comm: Any, opts: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Seconds per transfer, per size: bridge P2P, plain wire, and (rank 0) the device copies."""
    import torch.distributed as dist

    rank, dev = comm.rank, comm.device
    out: dict[str, dict[str, list[float]]] = {}
    for mib in opts["sizes_mib"]:
        n = mib * MIB // 4
        times: dict[str, list[float]] = {"bridge": [], "wire": []}
        src = torch.rand(n, device=dev) if rank == 0 else None
        dst = torch.empty(n) if rank == 1 else None
        host = _host_buffer(comm, n) if rank in (0, 1) else None
        for i in range(opts["warmup"] + opts["iters"]):
            keep = i >= opts["warmup"]
            seconds = _timed(comm, lambda: comm.send(src, 1) if rank == 0 else comm.recv(dst, 0) if rank == 1 else None)
            if keep:
                times["bridge"].append(seconds)
            group = comm.layout.host_group
            seconds = _timed(comm, lambda: dist.send(host, 1, group=group) if rank == 0 else dist.recv(host, 0, group=group) if rank == 1 else None)
            if keep:
                times["wire"].append(seconds)
        if rank == 0:
            times["d2h"], times["h2d"] = _copy_times(comm, src, host, opts)
        out[str(mib)] = times
        src = dst = host = None  # free before the next size is allocated
    return out


def _host_buffer(comm: Any, n: int) -> torch.Tensor:
    buf = torch.empty(n)
    return buf if comm.backend.device_type == "cpu" else buf.pin_memory()


def _timed(comm: Any, fn: Any) -> float:
    """Wall time of ``fn`` after every rank has arrived (a host barrier first)."""
    comm.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _copy_times(comm: Any, src: torch.Tensor, host: torch.Tensor, opts: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Pinned device→host and host→device copies of ``src``, timed with the backend's events."""
    be = comm.backend
    d2h, h2d = [], []
    for i in range(opts["warmup"] + opts["iters"]):
        for direction, times in (("d2h", d2h), ("h2d", h2d)):
            start, end = be.Event(enable_timing=True), be.Event(enable_timing=True)
            start.record(be.current_stream())
            if direction == "d2h":
                host.copy_(src, non_blocking=True)
            else:
                src.copy_(host, non_blocking=True)
            end.record(be.current_stream())
            end.synchronize()
            if i >= opts["warmup"]:
                times.append(start.elapsed_time(end) / 1e3)
    return d2h, h2d


# --- the parent: launch, collect, report -------------------------------------------------------------
def _summary(reports: dict[int, dict[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    r0, r1 = reports[0], reports[1]
    rows = []
    for mib in opts["sizes_mib"]:
        key, nbytes = str(mib), mib * MIB
        # A transfer is done when both ends are: the slower side's time, iteration by iteration.
        bridge = statistics.median(max(a, b) for a, b in zip(r0["timings"][key]["bridge"], r1["timings"][key]["bridge"]))
        wire = statistics.median(max(a, b) for a, b in zip(r0["timings"][key]["wire"], r1["timings"][key]["wire"]))
        d2h = statistics.median(r0["timings"][key]["d2h"])
        h2d = statistics.median(r0["timings"][key]["h2d"])
        gbps = lambda s: round(nbytes / s / 1e9, 3) if s > 0 else float("inf")  # noqa: E731
        rows.append({
            "size_mib": mib, "bridge_gbps": gbps(bridge), "wire_gbps": gbps(wire), "d2h_gbps": gbps(d2h),
            "h2d_gbps": gbps(h2d), "bridge_ms": round(bridge * 1e3, 3), "wire_ms": round(wire * 1e3, 3),
            "d2h_ms": round(d2h * 1e3, 3), "bridge_over_wire_plus_d2h": round(bridge / (wire + d2h), 3),
        })
    return {
        "benchmark": "bridge_p2p", "mode": "cpu-only (declared islands, staging forced)" if opts["cpu_only"] else "cuda rank 0 + cpu ranks",
        "device": r0.get("device_name", r0["device"]), "world_size": len(reports), "chunk_bytes": r0["chunk_bytes"],
        "torch": torch.__version__, "iters": opts["iters"], "correctness": r0["checks"], "rows": rows,
    }


def _table(summary: dict[str, Any]) -> str:
    lines = [
        f"bridge P2P rank 0 ({summary['device']}) -> rank 1 (cpu); {summary['mode']}; world {summary['world_size']}, "
        f"chunk {summary['chunk_bytes'] // 1024} KiB, torch {summary['torch']}, median of {summary['iters']}",
        "correctness: " + ", ".join(f"{k} {v}" for k, v in summary["correctness"].items()),
        f"{'size MiB':>9} {'bridge GB/s':>12} {'wire GB/s':>10} {'d2h GB/s':>9} {'h2d GB/s':>9} {'bridge/(wire+d2h)':>18}",
    ]
    for r in summary["rows"]:
        lines.append(f"{r['size_mib']:>9} {r['bridge_gbps']:>12} {r['wire_gbps']:>10} {r['d2h_gbps']:>9} {r['h2d_gbps']:>9} {r['bridge_over_wire_plus_d2h']:>18}")
    lines.append("bridge/(wire+d2h) < 1 means the device copies overlap the network; ~1 means they run one after the other.")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-ranks", type=int, default=1, help="CPU ranks beside the CUDA rank (default 1)")
    parser.add_argument("--sizes-mib", default=None, help="comma-separated sizes in MiB (default 1..1024; 1..64 with --cpu-only)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-mib", type=float, default=None, help="bridge chunk size (sets HAL_BRIDGE_CHUNK_BYTES on every rank)")
    parser.add_argument("--cpu-only", action="store_true", help="two declared CPU islands instead of CUDA + CPU")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run before every rank is stopped")
    parser.add_argument("--op-timeout", type=float, default=120, help="seconds one collective may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu_ranks < 1:
        parser.error("--cpu-ranks must be at least 1 (rank 1 receives)")
    sizes = [int(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else list(CPU_SIZES_MIB if args.cpu_only else GPU_SIZES_MIB)
    if not sizes or min(sizes) < 1:
        parser.error("--sizes-mib: give whole MiB, at least 1")
    return {
        "cpu_ranks": args.cpu_ranks, "sizes_mib": sizes, "iters": max(1, args.iters), "warmup": max(0, args.warmup),
        "chunk_bytes": int(args.chunk_mib * MIB) if args.chunk_mib else None, "cpu_only": args.cpu_only,
        "timeout_s": args.timeout, "op_timeout_s": args.op_timeout, "json": args.json,
    }


def main(argv: list[str] | None = None) -> int:
    opts = _parse_args(argv)
    world_size = 1 + opts["cpu_ranks"]
    reports = launch_ranks(_rank_body, world_size, opts, opts["timeout_s"])
    problems = failures(reports, world_size, opts["timeout_s"])
    if problems:
        print("\n".join(problems), file=sys.stderr)
        if any("backend 'cuda' is not available" in line for line in problems):
            print("hint: no usable GPU here; run with --cpu-only", file=sys.stderr)
        return 1
    summary = _summary(reports, opts)
    print(json.dumps(summary, indent=2) if opts["json"] else _table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
