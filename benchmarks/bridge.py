"""Bridge point-to-point bandwidth on one GPU machine: 1 CUDA rank + N CPU ranks.

Rank 0 runs ``cuda``, the others ``cpu``, so the world has two islands and every call between
them goes through ``collectives.bridge``. The run first checks correctness (bridged all_reduce,
all_gather and P2P in both directions, sizes that are not a multiple of the chunk), then measures
bridge P2P rank 0 (GPU) → rank 1 (CPU) for 1 MiB .. 1 GiB against, in the same run:

* ``d2h`` / ``h2d`` — a pinned host↔device copy of the same size on rank 0 (device events);
* ``wire`` — a plain gloo send of the same bytes from rank 0's host memory (no device at all): one
  TCP stream, the speed of the bridge before it striped messages.

The bridge is measured once per channel count in ``--channels`` (default 1,2,4,8): the world opens
the largest count of host channels and each measurement uses the first c of them, so the single
stream (c = 1) and the striped bridge are timed alternately in one run. A bridge that overlaps its
copies with the network runs close to the wire speed of its channels; ``striped/single`` is the best
count's throughput over c = 1. ``--cpu-only`` runs the same thing with two declared CPU islands and
staging forced on (for machines without a GPU).

    python benchmarks/bridge.py [--cpu-ranks 1] [--sizes-mib 1,4,16,64,256,1024] [--iters 5]
                                [--chunk-mib 4] [--channels 1,2,4,8] [--cpu-only] [--json] [--timeout 900]
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
    if opts["stage"]:
        os.environ["HAL_BRIDGE_STAGE"] = opts["stage"]
    elif opts["cpu_only"]:
        os.environ["HAL_BRIDGE_STAGE"] = "always"  # run the staging path even without a device
    os.environ["HAL_BRIDGE_CHANNELS"] = str(max(opts["channels"]))
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


def _with_channels(comm: Any, count: int) -> Any:
    """The same communicator limited to its first ``count`` host channels (1 = the single stream)."""
    import dataclasses

    from hal.collectives import Communicator

    layout = dataclasses.replace(comm.layout, extra_channels=comm.layout.extra_channels[: count - 1])
    return Communicator(layout, comm.world, validate=False)


def _bandwidth(comm: Any, opts: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Seconds per transfer, per size: bridge P2P per channel count, plain wire, and (rank 0) the device copies."""
    import torch.distributed as dist

    rank, dev = comm.rank, comm.device
    comms = {c: _with_channels(comm, c) for c in opts["channels"]}
    out: dict[str, dict[str, list[float]]] = {}
    for mib in opts["sizes_mib"]:
        n = mib * MIB // 4
        times: dict[str, list[float]] = {"wire": [], **{f"bridge_c{c}": [] for c in comms}}
        src = torch.rand(n, device=dev) if rank == 0 else None
        dst = torch.empty(n) if rank == 1 else None
        host = _host_buffer(comm, n) if rank in (0, 1) else None
        for i in range(opts["warmup"] + opts["iters"]):
            keep = i >= opts["warmup"]
            for c, cc in comms.items():  # alternate the channel counts within every iteration
                seconds = _timed(cc, lambda: cc.send(src, 1) if rank == 0 else cc.recv(dst, 0) if rank == 1 else None)
                if keep:
                    times[f"bridge_c{c}"].append(seconds)
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
        # A transfer is done when both ends are: the slower side's time, iteration by iteration.
        def median_of(name: str) -> float:
            return statistics.median(max(a, b) for a, b in zip(r0["timings"][key][name], r1["timings"][key][name]))

        wire = median_of("wire")
        d2h = statistics.median(r0["timings"][key]["d2h"])
        h2d = statistics.median(r0["timings"][key]["h2d"])
        gbps = lambda s: round(nbytes / s / 1e9, 3) if s > 0 else float("inf")  # noqa: E731
        bridge = {c: gbps(median_of(f"bridge_c{c}")) for c in opts["channels"]}
        best = max(bridge, key=lambda c: bridge[c])
        rows.append({
            "size_mib": mib, "bridge_gbps": bridge, "wire_gbps": gbps(wire), "d2h_gbps": gbps(d2h), "h2d_gbps": gbps(h2d),
            "best_channels": best,
            "striped_over_single": round(bridge[best] / bridge[1], 3) if 1 in bridge and bridge[1] else None,
            "single_over_wire": round(bridge[1] / gbps(wire), 3) if 1 in bridge else None,
        })
    return {
        "benchmark": "bridge_p2p", "mode": "cpu-only (declared islands, staging forced)" if opts["cpu_only"] else "cuda rank 0 + cpu ranks",
        "device": r0.get("device_name", r0["device"]), "world_size": len(reports), "chunk_bytes": r0["chunk_bytes"],
        "channels": opts["channels"], "torch": torch.__version__, "iters": opts["iters"], "correctness": r0["checks"], "rows": rows,
    }


def _table(summary: dict[str, Any]) -> str:
    lines = [
        f"bridge P2P rank 0 ({summary['device']}) -> rank 1 (cpu); {summary['mode']}; world {summary['world_size']}, "
        f"chunk {summary['chunk_bytes'] // 1024} KiB, torch {summary['torch']}, median of {summary['iters']}",
        "correctness: " + ", ".join(f"{k} {v}" for k, v in summary["correctness"].items()),
        f"{'size MiB':>9} " + " ".join(f"{f'bridge c={c}':>12}" for c in summary["channels"])
        + f" {'wire GB/s':>10} {'d2h GB/s':>9} {'h2d GB/s':>9} {'striped/single':>15}",
    ]
    for r in summary["rows"]:
        cells = " ".join(f"{r['bridge_gbps'][c]:>12}" for c in summary["channels"])
        ratio = "" if r["striped_over_single"] is None else f"{r['striped_over_single']} (c={r['best_channels']})"
        lines.append(f"{r['size_mib']:>9} {cells} {r['wire_gbps']:>10} {r['d2h_gbps']:>9} {r['h2d_gbps']:>9} {ratio:>15}")
    lines.append("bridge columns: GB/s of bridged P2P over c host channels; wire: one plain gloo stream from host memory.")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-ranks", type=int, default=1, help="CPU ranks beside the CUDA rank (default 1)")
    parser.add_argument("--sizes-mib", default=None, help="comma-separated sizes in MiB (default 1..1024; 1..64 with --cpu-only)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunk-mib", type=float, default=None, help="bridge chunk size (sets HAL_BRIDGE_CHUNK_BYTES on every rank)")
    parser.add_argument("--channels", default="1,2,4,8", help="host channel counts to measure, comma-separated (default 1,2,4,8)")
    parser.add_argument("--cpu-only", action="store_true", help="two declared CPU islands instead of CUDA + CPU")
    parser.add_argument("--stage", choices=["auto", "always"],
                        help="HAL_BRIDGE_STAGE on every rank (default: always with --cpu-only, else auto)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run before every rank is stopped")
    parser.add_argument("--op-timeout", type=float, default=120, help="seconds one collective may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu_ranks < 1:
        parser.error("--cpu-ranks must be at least 1 (rank 1 receives)")
    sizes = [int(s) for s in args.sizes_mib.split(",")] if args.sizes_mib else list(CPU_SIZES_MIB if args.cpu_only else GPU_SIZES_MIB)
    if not sizes or min(sizes) < 1:
        parser.error("--sizes-mib: give whole MiB, at least 1")
    try:
        channels = sorted({int(c) for c in args.channels.split(",") if c.strip()})
    except ValueError:
        channels = []
    if not channels or channels[0] < 1 or channels[-1] > 16:
        parser.error("--channels: give channel counts from 1 to 16, e.g. 1,2,4,8")
    return {
        "cpu_ranks": args.cpu_ranks, "sizes_mib": sizes, "iters": max(1, args.iters), "warmup": max(0, args.warmup),
        "chunk_bytes": int(args.chunk_mib * MIB) if args.chunk_mib else None, "cpu_only": args.cpu_only, "channels": channels, "stage": args.stage,
        "timeout_s": args.timeout, "op_timeout_s": args.op_timeout, "json": args.json,
    }


def main(argv: list[str] | None = None) -> int:
    opts = _parse_args(argv)
    world_size = 1 + opts["cpu_ranks"]
    reports = launch_ranks(_rank_body, world_size, opts, opts["timeout_s"], "cpu" if opts["cpu_only"] else None)
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
