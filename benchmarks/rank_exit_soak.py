"""Exit soak: the collectives snippet of docs/collectives.md (no explicit shutdown) under ``hal launch``, N times.

    python benchmarks/rank_exit_soak.py [--runs 50] [--nproc 2] [--timeout 120]

The failure it looks for is intermittent: a rank that printed its result and then exits 134 (an abort in the
process groups' teardown), hangs at exit, or is reported by a signal instead of its exit status. Each run must
exit 0 with every rank's line printed; a run past ``--timeout`` counts as a hang. A table is printed last.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SNIPPET = """
import datetime, sys, torch
from hal.collectives import init_distributed, world_communicator

init_distributed()
comm = world_communicator()
t = torch.ones(4) * (comm.rank + 1)
comm.all_reduce(t, "avg")
comm.all_gather(t)
comm.all_to_all(torch.ones(2 * comm.size), input_splits=[2] * comm.size)
h = comm.reduce_scatter(torch.ones(4 * comm.size), async_op=True, timeout=datetime.timedelta(seconds=30)); h.wait()
sys.stdout.write(f"rank {comm.rank} done\\n"); sys.stdout.flush()  # one write: ranks share the pipe
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    outcomes: collections.Counter[str] = collections.Counter()
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "snippet.py"
        script.write_text(SNIPPET, encoding="utf-8")
        for i in range(args.runs):
            started = time.monotonic()
            try:
                done = subprocess.run([sys.executable, "-m", "hal", "launch", "--nproc", str(args.nproc), "--backend",
                                       "cpu", str(script)], capture_output=True, text=True, timeout=args.timeout)
                lines = sum(line.endswith(" done") for line in done.stdout.splitlines())
                outcome = "ok" if done.returncode == 0 and lines == args.nproc else f"exit {done.returncode}, {lines} line(s)"
                if outcome != "ok":
                    print(f"run {i + 1}: {outcome}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            except subprocess.TimeoutExpired:
                outcome = "hang"
            seconds.append(time.monotonic() - started)
            outcomes[outcome] += 1
            print(f"run {i + 1}/{args.runs}: {outcome} ({seconds[-1]:.1f} s)", file=sys.stderr, flush=True)
    print(f"{'outcome':<28} {'runs':>5}")
    for outcome, n in outcomes.most_common():
        print(f"{outcome:<28} {n:>5}")
    bad = args.runs - outcomes["ok"]
    print(f"{args.runs} runs of {args.nproc} ranks: {bad} bad exit(s); {sum(seconds) / len(seconds):.1f} s a run")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
