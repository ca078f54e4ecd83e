"""Summarise ``hal bench collectives --json`` files: ours/raw busbw at large sizes, per op and dtype.

    python benchmarks/bench_ratio.py bench2.json bench4.json [--min-bytes 64MiB] [--goal 0.97]

Prints one line per (world size, op, dtype): the smallest ours/raw busbw ratio over sizes at or
above the threshold, the raw and our busbw at the largest size, and whether the goal is met.
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--min-bytes", type=int, default=64 * 2**20)
    parser.add_argument("--goal", type=float, default=0.97)
    args = parser.parse_args()
    print(f"{'n':>2} {'op':<15} {'dtype':<9} {'min ratio':>9} {'raw busbw':>10} {'our busbw':>10} {'wrong':>6}  goal")
    all_met = True
    for path in args.files:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
        world = report["header"]["world_size"]
        groups: dict[tuple[str, str], list[dict]] = {}
        for row in report["rows"]:
            if row["size"] >= args.min_bytes:
                groups.setdefault((row["op"], row["dtype"]), []).append(row)
        for (op, dtype), rows in sorted(groups.items()):
            ratio = min(r["busbw_ratio"] for r in rows)
            last = max(rows, key=lambda r: r["size"])
            wrong = sum(r["ours"]["wrong"] + r["raw"]["wrong"] for r in rows)
            met = ratio >= args.goal and wrong == 0
            all_met &= met
            print(f"{world:>2} {op:<15} {dtype:<9} {ratio:>9.3f} {last['raw']['busbw_gbps']:>10.1f} "
                  f"{last['ours']['busbw_gbps']:>10.1f} {wrong:>6}  {'met' if met else 'NOT met'}")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
