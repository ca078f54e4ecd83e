"""A played schedule's order from measured stage times against its unit-time order, through ``hal train``.

One model, one plan, one schedule per row, trained twice — ``parallel.order: unit`` and ``parallel.order:
measured`` (a calibration on the run's second step, then the order the simulator finds fastest with the measured
times) — each ``--repeats`` times, alternating, so host drift falls on both alike. Each run's steady tokens/s is
``hal train``'s (the steps after the calibration, for the measured runs); the table gives the medians, their
ratio, and what the calibration predicted (the simulated step of either order on the measured times) and chose.

The default plan is the heterogeneous one the issue names: a CUDA stage with most layers beside a CPU stage
(``--stages cuda:6,cpu:2``; a stage's layers are split evenly over its chunks). ``--stages cpu:2,cpu:2`` runs on
any host (a smoke run: two ranks on shared cores measure little).

    python benchmarks/measured_order.py [--stages cuda:6,cpu:2] [--schedules zbv,interleaved-zero-bubble,zero-bubble]
                                        [--hidden 512] [--seq 256] [--mbs 4] [--micro-batches 8] [--steps 30]
                                        [--repeats 2] [--cpu-binding cores|none] [--json] [--timeout 900]
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

import yaml

REPO = Path(__file__).resolve().parents[1]


def stages(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        backend, _, layers = part.partition(":")
        if not backend or not layers.isdigit() or int(layers) < 1:
            raise SystemExit(f"--stages: {part!r} is not backend:layers (e.g. cuda:6,cpu:2)")
        out.append((backend, int(layers)))
    return out


def config(args: argparse.Namespace, schedule: str, order: str) -> dict[str, Any]:
    plan = stages(args.stages)
    chunks = 2 if schedule in ("zbv", "interleaved-zero-bubble") else 1
    backends = {b for b, _ in plan}
    h = args.hidden
    return {"backend": "auto" if len(backends) > 1 else plan[0][0], "precision": args.precision, "fallback": "warn",
            "model": {"vocab_size": 32000, "hidden_size": h, "num_layers": sum(n for _, n in plan),
                      "num_heads": max(1, h // 64), "num_kv_heads": max(1, h // 256), "ffn_hidden_size": 4 * h,
                      "max_seq_len": args.seq},
            "parallel": {"schedule": schedule, "order": order, "virtual_stages": chunks, "micro_batches": args.micro_batches,
                         "micro_batch_size": args.mbs,
                         "stages": [{"backend": b, "devices": 1, "layers": n} for b, n in plan]},
            "train": {"steps": args.steps, "lr": 3e-4, "seed": 0, "data": "synthetic", "seq_len": args.seq}}


def run(args: argparse.Namespace, schedule: str, order: str, folder: Path, index: int) -> dict[str, Any]:
    name = f"{schedule}-{order}-{index}"
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(args, schedule, order), sort_keys=False), encoding="utf-8")
    print(f"measured_order: {name}", file=sys.stderr, flush=True)
    binding = ["--cpu-binding", args.cpu_binding] if args.cpu_binding != "none" else []
    result = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--run-dir", str(folder / name), "--json", *binding],
                            capture_output=True, text=True, cwd=REPO, timeout=args.timeout, env=dict(os.environ))
    if result.returncode != 0:
        raise SystemExit(f"{name}: hal train failed:\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout)
    said = [line for line in result.stderr.splitlines() if "order from measured times" in line]
    return {"run": name, "schedule": schedule, "order": order, "tokens_per_s": summary["tokens_per_s"],
            "final_loss": summary["final_loss"], "calibration": summary.get("order"), "said": said}


def table(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for schedule in args.schedules.split(","):
        unit = [r["tokens_per_s"] for r in runs if r["schedule"] == schedule and r["order"] == "unit"]
        measured = [r for r in runs if r["schedule"] == schedule and r["order"] == "measured"]
        rate = statistics.median(r["tokens_per_s"] for r in measured)
        calibrations = [r["calibration"] for r in measured if r["calibration"]]
        rows.append({"schedule": schedule, "unit_tokens_per_s": statistics.median(unit), "measured_tokens_per_s": rate,
                     "ratio": rate / statistics.median(unit),
                     "predicted_gain": [c["unit_step_s"] / c["measured_step_s"] for c in calibrations],
                     "chosen": [c["chosen"] for c in calibrations]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="cuda:6,cpu:2")
    parser.add_argument("--schedules", default="zbv,interleaved-zero-bubble,zero-bubble")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--cpu-binding", default="cores", choices=("none", "cores"),
                        help="hal train --cpu-binding: cores (default) keeps a GPU rank's host thread off the cpu stage's cores")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="measured_order_") as tmp:
        for schedule in args.schedules.split(","):
            for index in range(args.repeats):
                for order in ("unit", "measured"):
                    runs.append(run(args, schedule, order, Path(tmp), index))
    rows = table(args, runs)
    if args.json:
        print(json.dumps({"stages": args.stages, "runs": runs, "table": rows}, indent=2))
        return 0
    for r in runs:
        for line in r["said"]:
            print(f"{r['run']}: {line}")
    print(f"stages {args.stages}, hidden {args.hidden}, seq {args.seq}, {args.micro_batches} x {args.mbs} rows, "
          f"{args.steps} steps, median of {args.repeats}")
    print(f"{'schedule':26s} {'unit tok/s':>11s} {'measured tok/s':>15s} {'ratio':>6s}  predicted  chosen")
    for row in rows:
        predicted = ",".join(f"{g:.3f}" for g in row["predicted_gain"])
        print(f"{row['schedule']:26s} {row['unit_tokens_per_s']:11.0f} {row['measured_tokens_per_s']:15.0f} "
              f"{row['ratio']:6.3f}  {predicted:9s}  {','.join(row['chosen'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
