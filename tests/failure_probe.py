"""A ``hal launch`` rank that hits a per-call collective timeout and then leaves as a script does.

Rank 1 never arrives (it sleeps until the launcher stops it); rank 0 calls ``all_reduce`` with
``--timeout`` seconds, prints one JSON line with the wall-clock time of the call, and lets the
``CollectiveTimeout`` end the script (one `hal: error:` line from the shim hal launch runs it in, exit 1) — a plain interpreter exit, not the
``os._exit`` of hal's function ranks, so a CCL thread left running would hold the process. The
group timeout stays torch's default (300 s), as in a user's script. ``--shutdown`` calls
``shutdown()`` before leaving; ``--no-validate`` skips the signature check (the op itself waits).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from hal.collectives import init_distributed, shutdown, world_communicator


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--shutdown", action="store_true")
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument("--marker", default="")
    args = parser.parse_args()
    world = init_distributed()
    comm = world_communicator(validate=not args.no_validate)
    if world.rank == 1:
        time.sleep(600)  # never arrives; the launcher stops it once rank 0 fails
        return 0
    sys.stdout.write(json.dumps({"rank": 0, "called_at": time.time()}) + "\n")
    sys.stdout.flush()
    try:
        comm.all_reduce(torch.ones(2), timeout=datetime.timedelta(seconds=args.timeout))
    finally:
        if args.shutdown:
            shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
