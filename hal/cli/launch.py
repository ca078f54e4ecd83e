"""``hal launch --nproc N script.py``: N local ranks of a script, each pinned to its device."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

NAME = "launch"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="run SCRIPT as N local ranks with each rank pinned to its device",
        description="Run SCRIPT as N local ranks (torchrun's environment, each in its own process group); "
                    "hal.collectives.init_distributed() in the script picks "
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
    """Validate, then print the multi-node lines (stderr) or run the ranks and report how each ended."""
    from hal.errors import HalError
    from hal.launch.script import plan_launch, run_launch

    script_args = list(args.script_args)
    if args.print_multinode is not None:
        if args.print_multinode < 1:
            raise HalError(f"--print-multinode {args.print_multinode} is not a node count; give 1 or more")
        plan = plan_launch(args.nproc, args.script, script_args, backend=args.backend, config=args.config, check_devices=False)
        for line in plan.multinode_lines(args.print_multinode):
            print(line, file=sys.stderr)
        return 0
    plan = plan_launch(args.nproc, args.script, script_args, backend=args.backend, config=args.config)
    count = os.environ.get("HAL_DEVICE_COUNT") or plan.nproc
    shown = (f"; torch.cuda.device_count() is {count} in each rank, every device the host "
             f"(HAL_DEVICE_COUNT=N to show another count)" if plan.backend.device_type == "cpu" else "")
    print(f"hal launch: {plan.nproc} rank(s) on backend {plan.backend.name}{shown}: {plan.command_line()}",
          file=sys.stderr)
    return print_report(run_launch(plan), "hal launch")


def print_report(report: Any, who: str) -> int:
    """The launcher's report on stderr, one line per rank that did not end ok; the run's exit status."""
    from hal.launch.ranks import signal_name

    if report.interrupted:
        print(f"{who}: stopped by {signal_name(report.interrupted)}; every rank was stopped", file=sys.stderr)
    else:
        for line in report.lines():
            print(f"{who}: {line}", file=sys.stderr)
    return int(report.exit_status)
