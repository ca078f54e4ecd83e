"""The planner's accuracy on the CPU: predicted against measured steady-state step time for 8+ plans of 4 ranks.

One profile of this host (``hal profile``'s measurement: one layer at a few row counts, recompute off
and on, embedding, head, AdamW, the P2P links), one cluster (4 cpu ranks sharing this host's cores), then
for each plan: the cost model's prediction and a short ``hal train --json`` run (the median step after
the first), and the error. Memory is not compared here: the ranks' host RSS is
dominated by torch itself on a model this small; the memory model is tested against its parts instead.

    python benchmarks/planner_accuracy.py [--steps 10] [--json] [--only 1,3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = {"vocab_size": 256, "hidden_size": 256, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
         "ffn_hidden_size": 704, "max_seq_len": 64}
CPU = {"backend": "cpu", "devices": 1}

PLANS: list[tuple[str, dict[str, Any]]] = [
    ("4 stages 1f1b M8", {"schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2,
                          "stages": [{**CPU, "layers": 2}] * 4}),
    ("4 stages zero-bubble M8", {"schedule": "zero-bubble", "micro_batches": 8, "micro_batch_size": 2,
                                 "stages": [{**CPU, "layers": 2}] * 4}),
    ("4 stages interleaved V2 M8", {"schedule": "interleaved-1f1b", "virtual_stages": 2, "micro_batches": 8,
                                    "micro_batch_size": 2, "stages": [{**CPU, "layers": 2}] * 4}),
    ("4 stages 1f1b M4 recompute", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                    "stages": [{**CPU, "layers": 2, "checkpoint": True}] * 4}),
    ("tp2 | tp2 1f1b M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                           "stages": [{"backend": "cpu", "devices": 2, "tp": 2, "layers": 4}] * 2}),
    ("dp2 | dp2 1f1b M8", {"schedule": "1f1b", "micro_batches": 8, "micro_batch_size": 2,
                           "stages": [{"backend": "cpu", "devices": 2, "dp": 2, "layers": 4}] * 2}),
    ("tp2+sp rc | dp2 5/3 M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4,
                                "stages": [{"backend": "cpu", "devices": 2, "tp": 2, "sp": True, "layers": 5, "checkpoint": True},
                                           {"backend": "cpu", "devices": 2, "dp": 2, "layers": 3}]}),
    ("dp2 zero1 | dp2 6/2 M4", {"schedule": "1f1b", "micro_batches": 4, "micro_batch_size": 4, "zero1": True,
                                "stages": [{"backend": "cpu", "devices": 2, "dp": 2, "layers": 6},
                                           {"backend": "cpu", "devices": 2, "dp": 2, "layers": 2}]}),
    ("tp2 dp2 one stage M2", {"schedule": "1f1b", "micro_batches": 2, "micro_batch_size": 8,
                              "stages": [{"backend": "cpu", "devices": 4, "tp": 2, "dp": 2, "layers": 8}]}),
]


def config_text(parallel: dict[str, Any], steps: int) -> str:
    import yaml

    return yaml.safe_dump({"backend": "cpu", "precision": "fp32", "fallback": "warn", "model": MODEL, "parallel": parallel,
                           "train": {"steps": steps, "lr": 1e-3, "data": "synthetic"},
                           "cluster": {"groups": [{"backend": "cpu", "device": "cpu-generic", "count": 4,
                                                   "cores": os.cpu_count() or 1}]}}, sort_keys=False)


def measured_step_s(path: Path, run_dir: Path, steps: int) -> float:
    """Median seconds a step of ``hal train`` after the first (warm-up) step, from its step log.

    The median: on a shared 2-core host single steps swing by ±20 % (other processes, the scheduler);
    a mean over a few steps moves the "measured" side of the comparison by ±10 % from run to run."""
    out = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--steps", str(steps), "--json",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"hal train {path} failed:\n{out.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_s"] for r in records if "step_s" in r][1:]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", help="comma-separated plan numbers (1-based)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.plan_search import planning_inputs
    from hal.launch import run_function
    from hal.parallel.planner.profiler import make_profile
    from hal.parallel.run_config import load_run_config

    chosen = [int(x) - 1 for x in args.only.split(",")] if args.only else range(len(PLANS))
    rows = []
    with tempfile.TemporaryDirectory(prefix="planner-accuracy-") as tmp:
        first = Path(tmp, "base.yaml")
        first.write_text(config_text(PLANS[0][1], args.steps))
        run = load_run_config(first)
        print("profiling this host (hal profile's measurement) ...", file=sys.stderr, flush=True)
        cluster, _, _ = planning_inputs(run, None, None)
        profile = make_profile(cluster, run.model, "fp32", run.model.max_seq_len, progress=lambda m: None,
                               launch=run_function)
        profile_path = Path(tmp, "profile.json")
        profile.save(profile_path)
        for i in chosen:
            name, parallel = PLANS[i]
            path = Path(tmp, f"plan{i + 1}.yaml")
            path.write_text(config_text(parallel, args.steps))
            run = load_run_config(path)
            _, _, cost = planning_inputs(run, None, str(profile_path))
            kind = cluster.types[0]
            pred = cost.predict(run.plan, Placement.pack(run.plan, (kind,) * run.plan.num_stages))
            measured = measured_step_s(path, Path(tmp, f"run{i + 1}"), args.steps)
            err = (pred.step_s - measured) / measured
            rows.append({"plan": name, "predicted_s": pred.step_s, "measured_s": measured, "error": err, "bound": pred.bound})
            print(f"{i + 1}. {name:<28} predicted {pred.step_s:7.3f} s  measured {measured:7.3f} s  error {err:+6.1%}",
                  file=sys.stderr, flush=True)
    errors = [abs(r["error"]) for r in rows]
    result = {"rows": rows, "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors),
              "cores": os.cpu_count(), "profile_links": {k: v.__dict__ for k, v in profile.links.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'plan':<30} {'predicted s':>11} {'measured s':>10} {'error':>7}  bound")
    for r in rows:
        print(f"{r['plan']:<30} {r['predicted_s']:>11.3f} {r['measured_s']:>10.3f} {r['error']:>+7.1%}  {r['bound']}")
    print(f"median |error| {result['median_abs_error']:.1%}, worst {result['worst_abs_error']:.1%} "
          f"({len(rows)} plans, 4 cpu ranks on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
