"""The planner's accuracy on replica plans: the cost model's step for five replicated runs of 4 ranks against
``hal train``'s measured steady step.

One ``hal profile`` of this host (4 ranks of ``--backend``; on the cpu the links, the bridge and the node's
calibration pipelines too), then for each plan ``hal plan --config F --profile P --json`` (every replica its own
island: ``HAL_ISLANDS``, so the sync crosses the bridge) and a short ``hal train --json`` (its steady tokens/s).
The plans: (a) tp2 on 6 rows beside dp2 on 2; (b) the same with ``rows: auto``;
(c) three replicas, dp2 on 4 rows beside two one-rank replicas; (d) a 2-stage pipeline replica beside a dp2 one;
(e) (a) with bf16 on the wire. Printed: each plan's predicted and measured step, the error, the shares predicted
and run; last the median |error|.

    python benchmarks/replica_accuracy.py [--steps 30] [--profile P] [--json]

CPU only (the example's model is CPU-sized); on GPUs, ``benchmarks/replicas_shares.py --profile make`` sets the
predictions beside its runs.
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


def _stage(backend: str, devices: int, layers: int, **grid: Any) -> dict[str, Any]:
    return {"backend": backend, "devices": devices, "layers": layers, **grid}


def cases(backend: str) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (parallel section, HAL_ISLANDS)."""
    s = lambda *a, **g: _stage(backend, *a, **g)  # noqa: E731
    tp_dp = [{"rows": 6, "micro_batch_size": 2, "stages": [s(2, 4, tp=2)]},
             {"rows": 2, "micro_batch_size": 2, "stages": [s(2, 4, dp=2)]}]
    return {
        "a: tp2 6 rows | dp2 2 rows": ({"replica_sync": {"every": 1}, "replicas": tp_dp}, "0,0,1,1"),
        "b: rows auto, tp2 | dp2": ({"global_batch": 8, "replica_sync": {"every": 1},
                                    "replicas": [{**r, "rows": "auto"} for r in tp_dp]}, "0,0,1,1"),
        "c: dp2 4 | 1 rank 2 | 1 rank 2": ({"replica_sync": {"every": 1}, "replicas": [
            {"rows": 4, "micro_batch_size": 2, "stages": [s(2, 4, dp=2)]},
            {"rows": 2, "micro_batch_size": 1, "stages": [s(1, 4)]},
            {"rows": 2, "micro_batch_size": 2, "stages": [s(1, 4)]}]}, "0,0,1,2"),
        "d: 2-stage pipeline 6 | dp2 2": ({"replica_sync": {"every": 1}, "replicas": [
            {"rows": 6, "micro_batch_size": 2, "stages": [s(1, 2), s(1, 2)]},
            {"rows": 2, "micro_batch_size": 2, "stages": [s(2, 4, dp=2)]}]}, "0,0,1,1"),
        "e: (a) with bf16 on the wire": ({"replica_sync": {"every": 1, "compress": "bf16"}, "replicas": tp_dp}, "0,0,1,1"),
    }


def _hal(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "hal", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"hal {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", help="a hal profile of this model on this host (default: made now)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = yaml.safe_load((REPO / "examples" / "replicas_cpu.yaml").read_text(encoding="utf-8"))
    backend = "cpu"
    base["train"].pop("checkpoint_every", None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cluster = folder / "cluster.yaml"
        group = {"backend": backend, "device": _device(backend), "count": 4, "node": 0, "cores": os.cpu_count() or 1}
        cluster.write_text(yaml.safe_dump({"cluster": {"groups": [group]}}), encoding="utf-8")
        profile = args.profile
        if profile is None:
            profile = str(folder / "profile.json")
            print("replica_accuracy: hal profile of this host", file=sys.stderr, flush=True)
            _hal("profile", "--config", str(_write(folder / "profile.yaml", {**base, "parallel": {
                "micro_batch_size": 2, "micro_batches": 1, "stages": [_stage(backend, 1, 4)]}})),
                 "--cluster", str(cluster), "--out", profile)
        for name, (parallel, islands) in cases(backend).items():
            path = _write(folder / f"{name[0]}.yaml", {**base, "parallel": parallel})
            env = {"HAL_ISLANDS": islands}
            predicted = json.loads(_hal("plan", "--config", str(path), "--profile", profile, "--cluster", str(cluster),
                                        "--json", env=env))["predicted"]
            run_dir = folder / f"run_{name[0]}"
            summary = json.loads(_hal("train", str(path), "--steps", str(args.steps), "--run-dir", str(run_dir),
                                      "--json", env=env))
            tokens = 8 * base["train"].get("seq_len", base["model"]["max_seq_len"])
            measured = tokens / summary["tokens_per_s"]
            log = [json.loads(line) for line in (run_dir / "train.jsonl").read_text().splitlines()]
            rows.append({"plan": name, "predicted_s": predicted["step_s"], "measured_s": measured,
                         "error": predicted["step_s"] / measured - 1, "rows_predicted": predicted["rows"],
                         "rows_run": [r["rows"] for r in log[-1]["replicas"]]})
            print(f"replica_accuracy: {name}: {rows[-1]['error']:+.1%}", file=sys.stderr, flush=True)
    median = statistics.median(abs(r["error"]) for r in rows)
    if args.json:
        print(json.dumps({"plans": rows, "median_abs_error": median}, indent=2))
        return 0
    for r in rows:
        print(f"{r['plan']:32s} predicted {r['predicted_s']:.4f} s  measured {r['measured_s']:.4f} s  {r['error']:+6.1%}  "
              f"rows predicted {r['rows_predicted']}, run {r['rows_run']}")
    print(f"median |error| {median:.1%}")
    return 0


def _device(backend: str) -> str:
    from hal.parallel.planner.cluster import load_cluster

    probed = load_cluster(None, "this host")
    return next(t.device for t in probed.types if t.backend == backend)


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


if __name__ == "__main__":
    sys.exit(main())
