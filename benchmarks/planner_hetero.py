"""The planner on two device types at once: GPUs plus CPU ranks of the same host, planned, written and trained.

One host with GPUs: a cluster of ``--gpus`` GPUs and ``--cpus`` cpu ranks (two device types of very
different speeds). ``hal profile``'s measurement of both (the cpu ranks with their in-run calibration,
the GPUs with tp layers and the engine's host work when there are two), then ``hal plan --search
--use-all-types`` (every type holds a stage), its best plan written as ``--write`` writes it and trained
with ``hal train`` as is; against it the same stages with the layers split evenly (the naive split), and the
planner's best plan with no constraint (which may leave the slow type out). Each is a short ``hal train
--json`` run; the median step after the first is the measurement.

    python benchmarks/planner_hetero.py [--gpus 2] [--cpus 2] [--steps 8] [--full-profile] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# small enough that a cpu rank computes a layer in milliseconds; a GPU's step is then bound by its host
MODEL = {"vocab_size": 4096, "hidden_size": 512, "num_layers": 12, "num_heads": 8, "num_kv_heads": 4,
         "ffn_hidden_size": 1408, "max_seq_len": 256}
PRECISION = "fp32"  # one precision both device types run as is
BATCH = {"micro_batches": 8, "micro_batch_size": 2}


def cluster(gpus: int, cpus: int) -> dict[str, Any]:
    """The GPUs of this host and ``cpus`` cpu ranks; the cpu group's cores are what hal train gives those ranks
    (the host's cores over every rank of the run), so the profile measures them as they will run."""
    from hal.backend_registry import get_backend

    device = get_backend("cuda").capabilities(0).catalog_id
    if device is None:
        raise SystemExit("planner_hetero: GPU 0 is not in the catalog; it cannot be planned for")
    cores = max(cpus, (os.cpu_count() or 1) * cpus // (gpus + cpus))
    return {"groups": [{"backend": "cuda", "device": device, "count": gpus},
                       {"backend": "cpu", "device": "cpu-generic", "count": cpus, "cores": cores}]}


def config(parallel: dict[str, Any], steps: int, groups: dict[str, Any]) -> dict[str, Any]:
    return {"backend": "cuda", "precision": PRECISION, "fallback": "warn", "model": MODEL, "parallel": parallel,
            "train": {"steps": steps, "lr": 1e-3, "data": "synthetic"}, "cluster": groups}


def train(path: Path, run_dir: Path, steps: int) -> float:
    """Median seconds a step of ``hal train PATH`` after the first (warm-up) step."""
    out = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--steps", str(steps), "--json",
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"hal train {path} failed:\n{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median([r["step_s"] for r in records if "step_s" in r][1:])


def even_split(plan: Any) -> Any:
    """The same stages, devices, grids and schedule with the layers split evenly (the first stages take the rest)."""
    S, L, V = plan.num_stages, MODEL["num_layers"], plan.virtual_stages
    counts = [L // S + (1 if k < L % S else 0) for k in range(S)]
    stages = []
    for stage, n in zip(plan.stages, counts):
        layers = n if V == 1 else tuple(n // V + (1 if i < n % V else 0) for i in range(V))
        stages.append(dataclasses.replace(stage, layers=layers))
    return dataclasses.replace(plan, stages=tuple(stages))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--full-profile", action="store_true",
                        help="profile as hal profile does by default (more row counts and repeats); the default is "
                             "hal profile --quick's, which keeps the benchmark within its 3 minutes (a cpu type's "
                             "profile alone took 201 s in full and 76 s quick on a 2-core host, 2026-11-29)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from hal.launch import run_function
    from hal.parallel.config.run import load_run_config
    from hal.parallel.planner.cluster import load_cluster
    from hal.parallel.planner.cost import Placement
    from hal.parallel.planner.make_profile import make_profile
    from hal.parallel.planner.run_search import planning_inputs, stage_text, write_plan
    from hal.parallel.planner.search import Result, Search

    groups = cluster(args.gpus, args.cpus)
    base = {**BATCH, "stages": [{"backend": "cuda", "devices": args.gpus, "dp": args.gpus, "layers": MODEL["num_layers"]}]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="planner-hetero-") as tmp:
        first = Path(tmp, "base.yaml")
        first.write_text(yaml.safe_dump(config(base, args.steps, groups), sort_keys=False))
        run = load_run_config(first, check_backends=False)
        began = time.perf_counter()
        # each line with the seconds since the start: where the benchmark's own time goes (its goal: <= 3 minutes)
        say = lambda m: print(f"planner_hetero: [{time.perf_counter() - began:5.0f} s] {m}", file=sys.stderr, flush=True)  # noqa: E731
        cl = load_cluster(run.hal.cluster, run.origin, None)
        profile = make_profile(cl, run.model, PRECISION, MODEL["max_seq_len"], quick=not args.full_profile, progress=say,
                               launch=run_function)
        profile_path = Path(tmp, "profile.json")
        profile.save(profile_path)
        _, _, cost = planning_inputs(run, None, str(profile_path))
        both = Search(cost, run.plan, use_all_types=True).run(top=1).results[0]
        free = Search(cost, run.plan).run(top=1).results[0]
        even = even_split(both.plan)
        cases = [("planner, every type used", both.plan, both.placement.kinds),
                 ("even layer split, same stages", even, both.placement.kinds)]
        if free.plan != both.plan:
            cases.append(("planner, unconstrained", free.plan, free.placement.kinds))
        for i, (name, plan, kinds) in enumerate(cases):
            place = Placement.pack(plan, kinds)
            pred = cost.predict(plan, place, measured_order=True)  # the order hal train keeps
            stages = stage_text(Result(plan, place, pred))
            path = Path(tmp, f"plan{i}.yaml")
            write_plan(run, Result(plan, place, pred), path, cost, "measured by this benchmark")  # as --write writes
            say(f"training {name}: {stages}")
            step = train(path, Path(tmp, f"run{i}"), args.steps)
            rows.append({"plan": name, "stages": stages,
                         "schedule": plan.schedule.name, "micro_batches": plan.micro_batches, "predicted_s": pred.step_s,
                         "measured_s": step, "error": (pred.step_s - step) / step})
        say("done")
    tokens = BATCH["micro_batches"] * BATCH["micro_batch_size"] * MODEL["max_seq_len"]
    for r in rows:
        r["tokens_per_s"] = tokens / r["measured_s"]
    result = {"card": [t.device for t in cl.types], "cluster": groups, "model": MODEL, "rows": rows,
              "planner_over_even": rows[1]["measured_s"] / rows[0]["measured_s"],
              "profile": profile.to_dict()}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'plan':<32} {'predicted s':>11} {'measured s':>10} {'error':>7} {'tokens/s':>10}  stages")
    for r in rows:
        print(f"{r['plan']:<32} {r['predicted_s']:>11.4f} {r['measured_s']:>10.4f} {r['error']:>+7.1%} {r['tokens_per_s']:>10,.0f}  "
              f"{r['stages']} ({r['schedule']}, M={r['micro_batches']})")
    print(f"the planner's split over the even split: {result['planner_over_even']:.2f}× faster (measured; "
          f"{args.gpus} × {result['card'][0]} + {args.cpus} cpu ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
