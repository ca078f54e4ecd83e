"""``hal bench collectives``: nccl-tests-style time/algbw/busbw of hal's collectives beside raw torch.distributed.

The command part: arguments, the ranks (hal.launch, each running ``rank_main``), the streamed
table or the JSON document, and the exit status. What is measured and how is
``hal.collectives.bench`` (the library, which returns data and prints nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from .common import Parser

NAME = "bench"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(NAME, help="benchmarks: 'hal bench collectives'")
    bench = p.add_subparsers(dest="bench", metavar="{collectives}", parser_class=Parser)
    bench.required = True
    p = bench.add_parser(
        "collectives",
        help="collective latency and bandwidth, hal's API against raw torch.distributed, with correctness checks",
        description="Spawn N ranks and time every op x dtype x size (nccl-tests columns) through hal's Communicator "
        "(validation off) and through raw torch.distributed on the same group; every result is checked exactly.",
    )
    p.add_argument("--backend", help="backend to benchmark (default: the configured or auto-selected one)")
    p.add_argument("--world-size", type=int, help="ranks to spawn (default: every device; 2 on cpu)")
    p.add_argument("--sizes", help="MIN..MAX bytes, doubling (e.g. 8B..1GiB; K/M/G are powers of 1024), or one size")
    p.add_argument("--dtype", help="comma-separated dtypes (default float32)")
    p.add_argument("--ops", help="comma-separated ops (default all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,reduce)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before each measurement (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="ours and raw measured alternately this many times; medians reported (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    p.set_defaults(func=run_collectives)


def run_collectives(args: argparse.Namespace) -> int:
    return bench_main(
        backend=args.backend, world_size=args.world_size, sizes=args.sizes, dtypes=args.dtype, ops=args.ops,
        iters=args.iters, warmup=args.warmup, as_json=args.json, rounds=args.rounds,
    )


def bench_main(
    *, backend: str | None, world_size: int | None, sizes: str | None, dtypes: str | None, ops: str | None,
    iters: int, warmup: int, as_json: bool, rounds: int = 5,
) -> int:
    """The ``hal bench collectives`` command: 0 when every result is exact, 1 otherwise."""
    from hal.collectives.bench import BenchFailed, make_plan

    plan = make_plan(
        backend=backend, world_size=world_size, sizes=sizes, dtypes=dtypes, ops=ops, iters=iters, warmup=warmup,
        stream_table=not as_json, rounds=rounds,
    )
    started = time.monotonic()
    try:
        report = run_bench(plan)
    except BenchFailed as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report, indent=2))
    bad = [r for r in report["rows"] if r["ours"]["wrong"] or r["raw"]["wrong"]]
    took = time.monotonic() - started
    if bad:
        first = bad[0]
        _progress(f"{len(bad)} of {len(report['rows'])} results have wrong elements (first: {first['op']} {first['dtype']} "
                  f"{first['size']} B); {took:.1f} s")
        return 1
    _progress(f"{len(report['rows'])} results, every element correct; {took:.1f} s")
    return 0


def run_bench(plan: Any) -> dict[str, Any]:
    """Start the ranks (hal.launch; each runs ``rank_main``), wait, return rank 0's report; BenchFailed if a rank fails."""
    from hal.collectives.bench import BenchFailed
    from hal.launch import LaunchFailed, run_function

    try:
        run = run_function(f"{__name__}:rank_main", plan.world_size, {"plan": plan}, deadline_s=None,
                           what="bench collectives", stdout="inherit", echo_stderr=sys.stderr,
                           env={"HAL_BACKEND": plan.backend})  # cpu ranks fork from one interpreter that imported torch
    except LaunchFailed as exc:
        raise BenchFailed(str(exc)) from None
    return run.values[0]


def rank_main(plan: Any) -> dict[str, Any] | None:
    """One rank of the command: measure; rank 0 streams the table (stdout) and the progress (stderr) as it goes."""
    import os

    from hal.collectives.bench import bench_in_world

    if int(os.environ["RANK"]) != 0:
        return bench_in_world(plan)
    table = plan.stream_table
    return bench_in_world(
        plan,
        on_header=(lambda header: print("\n".join(format_header(header)), flush=True)) if table else None,
        on_row=(lambda row: print(format_row(row), flush=True)) if table else None,
        on_progress=_announce,
    )


def _announce(number: int, total: int, op: str, dtype: str, points: list[Any]) -> None:
    span = _human(points[0].size) + (f"..{_human(points[-1].size)}" if len(points) > 1 else "")
    _progress(f"[{number}/{total}] {op} {dtype}: {len(points)} size(s), {span}")


def _progress(message: str) -> None:
    print(f"hal bench: {message}", file=sys.stderr, flush=True)


# --- the table ------------------------------------------------------------------------------------------

_COLS = "{:>12}  {:>12}  {:>8}  {:>14}"
_SIDE = "  {:>9}  {:>7}  {:>7}  {:>6}"


def format_header(header: dict[str, Any]) -> list[str]:
    """nccl-tests-style comment lines and column titles."""
    factors = ", ".join(f"{op} {f:.3g}" for op, f in header["bus_factors"].items())
    lines = [
        f"# hal bench collectives: backend {header['backend']} ({header['process_group_backend']}), "
        f"world size {header['world_size']}, torch {header['torch']}, iters {header['iters']}, warmup {header['warmup']}",
        *(f"#   {d}" for d in header["devices"]),
        f"# ours = {header['ours']}; raw = {header['raw']}",
        f"# {header['validation']}",
        f"# size: {header['size_convention']}; busbw = algbw x ({factors}) per nccl-tests doc/PERFORMANCE.md",
        "#" + (_COLS + "  {:^35}  {:^35}").format("", "", "", "", "--- ours ---", "--- raw ---")[1:],
        "#" + (_COLS + _SIDE + _SIDE + "  {:>6}").format(
            "size(B)", "count", "type", "op", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong", "ratio"
        )[1:],
        "#" + (_COLS + _SIDE + _SIDE + "  {:>6}").format(
            "", "(elements)", "", "", "", "(GB/s)", "(GB/s)", "", "", "(GB/s)", "(GB/s)", "", "busbw"
        )[1:],
    ]
    return lines


def format_row(row: dict[str, Any]) -> str:
    """One measurement: ours and raw side by side, then busbw ours/raw."""
    def side(s: dict[str, Any]) -> tuple[str, str, str, str]:
        return _fmt_time(s["time_us"]), f"{s['algbw_gbps']:.2f}", f"{s['busbw_gbps']:.2f}", str(s["wrong"])

    ratio = "-" if row["busbw_ratio"] is None else f"{row['busbw_ratio']:.2f}"
    return (_COLS + _SIDE + _SIDE + "  {:>6}").format(
        row["size"], row["count"], row["dtype"], row["op"], *side(row["ours"]), *side(row["raw"]), ratio
    )


def format_table(report: dict[str, Any]) -> str:
    return "\n".join([*format_header(report["header"]), *(format_row(r) for r in report["rows"])])


def _fmt_time(us: float) -> str:
    """nccl-tests' precision: fewer decimals for longer times."""
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"
