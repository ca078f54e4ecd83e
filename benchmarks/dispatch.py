"""Operator-registry overhead per call, against calling the reference function directly.

Small CPU tensors make the op itself cheap, so the difference is the registry's dispatch cost
(device/dtype lookup in the per-op cache). Both sides are measured in the same run, interleaved,
and the median of several repeats is reported. Goal: ≤ 1.5 µs per call.

    python benchmarks/dispatch.py [--calls 20000] [--repeats 7] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hal import ops  # noqa: E402

GOAL_US = 1.5


def _per_call_us(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - start) / calls / 1e3


def measure(name: str, args: tuple[Any, ...], calls: int, repeats: int) -> dict[str, Any]:
    handle = ops.registry.op(name)
    reference = ops.registry.choose(name, "cpu", args[handle._arg].dtype).impl.fn
    handle(*args)  # warm the dispatch cache
    direct, dispatched = [], []
    for _ in range(repeats):  # interleave so drift hits both sides alike
        direct.append(_per_call_us(reference, args, calls))
        dispatched.append(_per_call_us(handle, args, calls))
    d, h = statistics.median(direct), statistics.median(dispatched)
    return {"op": name, "direct_us": round(d, 3), "registry_us": round(h, 3), "overhead_us": round(h - d, 3),
            "ratio": round(h / d, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(4, 8)
    cases = [
        ("silu", (x,)),
        ("softmax", (x,)),
        ("rms_norm", (x, torch.ones(8))),
        ("embedding", (torch.tensor([1, 2]), torch.randn(10, 8))),
    ]
    rows = [measure(name, case_args, args.calls, args.repeats) for name, case_args in cases]
    worst = max(r["overhead_us"] for r in rows)
    summary = {"device": "cpu", "torch": torch.__version__, "goal_us": GOAL_US, "worst_overhead_us": worst,
               "meets_goal": worst <= GOAL_US, "rows": rows}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{'op':<10} {'direct µs':>10} {'registry µs':>12} {'overhead µs':>12} {'ratio':>7}")
        for r in rows:
            print(f"{r['op']:<10} {r['direct_us']:>10.3f} {r['registry_us']:>12.3f} {r['overhead_us']:>12.3f} {r['ratio']:>7.3f}")
        print(f"worst overhead {worst:.3f} µs per call (goal ≤ {GOAL_US} µs): {'met' if worst <= GOAL_US else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
