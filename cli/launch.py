"""``hal launch --nproc N script.py``: N local ranks of a script, each pinned to its device."""
from __future__ import annotations

import argparse
from typing import Any

NAME = "launch"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="run SCRIPT as N local ranks (torchrun) with each rank pinned to its device",
        description="Run SCRIPT as N local ranks under torchrun; hal.collectives.init_distributed() in the script picks "
        "the backend and the rank's device. Arguments after SCRIPT go to it. Multi-node: see --print-multinode.",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of local ranks (one per device on accelerators)")
    p.add_argument("--backend", help="backend every rank runs (overrides HAL_BACKEND and the config file)")
    p.add_argument("--config", help="YAML config file (backend, devices, precision, fallback)")
    p.add_argument("--print-multinode", type=int, metavar="NODES",
                   help="print the plain torchrun command for each of NODES nodes (to stderr) and start nothing")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.collectives.launch import launch_main

    return launch_main(
        args.nproc, args.script, list(args.script_args), backend=args.backend, config=args.config,
        print_multinode=args.print_multinode,
    )
