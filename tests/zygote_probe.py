"""A rank for the zygote tests: reports who it is, then exits as its environment says.

Prints one JSON line on stderr: RANK, its pid, parent, process group and session, OMP threads as torch sees
them, whether torch was imported before this module ran (forked from the zygote), its working directory and the mark
a launcher left in its own ``sys`` (inherited only when the zygote is the launcher's fork).
``PROBE_EXIT`` is its exit status; ``PROBE_SLEEP`` seconds it sleeps first (the kill test).
"""
from __future__ import annotations

import json
import os
import sys
import time

preloaded = "torch" in sys.modules  # before this module imports anything: inherited from the zygote


def main() -> int:
    import torch

    with open(f"rank{os.environ['RANK']}.pid", "w", encoding="utf-8") as fh:  # in its working directory
        fh.write(str(os.getpid()))
    time.sleep(float(os.environ.get("PROBE_SLEEP", "0")))
    sys.stderr.write(json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "ppid": os.getppid(),
                                 "pgid": os.getpgid(0), "sid": os.getsid(0), "threads": torch.get_num_threads(),
                                 "preloaded": preloaded, "cwd": os.getcwd(), "argv": sys.argv[1:],
                                 "launcher_marker": getattr(sys, "_probe_launcher_marker", None)}) + "\n")
    print(f"stdout of rank {os.environ['RANK']}", flush=True)
    return int(os.environ.get("PROBE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
