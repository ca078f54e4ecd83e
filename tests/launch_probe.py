"""A rank for ``hal launch`` tests: join the world with no arguments, all-reduce the rank, report.

Prints one JSON line: rank, world size, backend, device, LOCAL_RANK, the sum of all ranks, and how the
rank's interpreter started (``sys.orig_argv``: a forked rank has its zygote's).
``--fail-rank R`` makes rank R exit with status 3 before joining (the others wait in the
rendezvous until the launcher stops them); ``--sleep S`` sleeps after printing ``ready`` (for the
Ctrl-C test). ``--marker M`` is only there to find these processes by command line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from hal.collectives import init_distributed, shutdown, world_communicator


def _say(record: dict[str, object]) -> None:
    """One write per line: ranks share the launcher's stdout, and print() writes the newline apart."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--marker", default="")
    args = parser.parse_args()
    if int(os.environ["RANK"]) == args.fail_rank:
        # Fail before joining: the others wait in the rendezvous until the launcher stops them, so
        # the only rank that fails on its own is this one (a rank that loses a peer mid-collective
        # may instead abort, which would make the launcher's status depend on a race).
        _say({"rank": int(os.environ["RANK"]), "failing": True})
        return 3
    world = init_distributed()
    if args.sleep:
        _say({"rank": world.rank, "ready": True})
        time.sleep(args.sleep)
    comm = world_communicator()
    value = torch.tensor([float(world.rank)], device=world.device)
    comm.all_reduce(value)
    _say({
        "rank": world.rank, "world": world.size, "backend": world.backend.name, "device": str(world.device),
        "local_rank": int(os.environ["LOCAL_RANK"]), "result": value.item(), "started_as": sys.orig_argv[1:4],
        "name": open("/proc/self/comm", encoding="utf-8").read().strip() if os.path.exists("/proc/self/comm") else None,
    })
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
