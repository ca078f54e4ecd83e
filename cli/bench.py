"""``hal bench collectives``: nccl-tests-style time/algbw/busbw of hal's collectives beside raw torch.distributed."""
from __future__ import annotations

import argparse
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
    from hal.collectives.bench import bench_main

    return bench_main(
        backend=args.backend, world_size=args.world_size, sizes=args.sizes, dtypes=args.dtype, ops=args.ops,
        iters=args.iters, warmup=args.warmup, as_json=args.json, rounds=args.rounds,
    )
