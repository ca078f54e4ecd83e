"""Replicas of unequal speed: ``rows: auto`` against even shares, and against the fast island alone.

Two islands declared separate (``HAL_ISLANDS``: the first half of the ranks and the second), each a dp replica of
``--devices`` ranks; island B made slower the honest way: it trains in fp32 where island A trains bf16-mixed (or
``--slow-precision``). Three ``hal train`` runs of one model, global batch and steps:

* ``alone``: island A by itself, the whole global batch;
* ``even``: both islands, half the rows each;
* ``auto``: both islands, ``rows: auto`` (a calibration at start, then re-balanced every 10 steps).

``--compress none,fp8`` runs ``even`` and ``auto`` once a wire (``even_fp8``, ``auto_fp8``: the cross-island part
as fp8 with error feedback), against the one ``alone`` run; ``--overlap both`` runs each with the exchange during
the backward and after it (``_after``).

Each run's steady tokens/s (``hal train``'s summary: the first step and checkpoint writes left out) and the shares
in force at its end; ``auto / even`` and ``auto / alone`` are the ratios to read. Every cross-island byte goes
through the bridge (host-staged), so the sync's share of the step is reported too. ``--backend cpu`` runs the same
on CPU ranks (a smoke run; the speeds then do not differ by precision on most hosts).

    python benchmarks/replicas_shares.py [--backend cuda] [--devices 2] [--steps 30] [--rows 64] [--hidden 768]
                                         [--layers 12] [--seq 1024] [--compress none,fp8] [--overlap on|off|both] [--no-even]
                                         [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def config(args: argparse.Namespace, parallel: dict[str, Any]) -> dict[str, Any]:
    h = args.hidden
    return {"backend": args.backend, "precision": "bf16-mixed" if args.backend != "cpu" else "fp32", "fallback": "warn",
            "model": {"vocab_size": 32000, "hidden_size": h, "num_layers": args.layers, "num_heads": max(1, h // 64),
                      "num_kv_heads": max(1, h // 256), "ffn_hidden_size": 4 * h, "max_seq_len": args.seq},
            "parallel": parallel,
            "train": {"steps": args.steps, "lr": 3e-4, "seed": 0, "data": "synthetic", "seq_len": args.seq}}


def replica(args: argparse.Namespace, rows: Any, precision: str | None) -> dict[str, Any]:
    stage: dict[str, Any] = {"backend": args.backend, "devices": args.devices, "layers": args.layers, "dp": args.devices}
    if precision:
        stage["precision"] = precision
    return {"rows": rows, "micro_batch_size": args.devices * args.mbs_per_rank, "stages": [stage]}


def run(args: argparse.Namespace, name: str, parallel: dict[str, Any], islands: str | None, folder: Path) -> dict[str, Any]:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(args, parallel), sort_keys=False), encoding="utf-8")
    env = {**os.environ, **({"HAL_ISLANDS": islands} if islands else {})}
    result = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--run-dir", str(folder / name), "--json"],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(f"{name}: hal train failed:\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout)
    log = [json.loads(line) for line in (folder / name / "train.jsonl").read_text().splitlines()]
    out: dict[str, Any] = {"run": name, "tokens_per_s": summary["tokens_per_s"], "final_loss": summary["final_loss"]}
    if "replicas" in log[-1]:
        steady = log[1:] or log
        out["rows"] = [r["rows"] for r in log[-1]["replicas"]]
        out["first_rows"] = [r["rows"] for r in log[0]["replicas"]]
        out["sync_share"] = sum(max(r["sync_s"] for r in rec["replicas"]) / rec["step_s"] for rec in steady) / len(steady)
        out["rebalances"] = sum("rebalanced" in rec for rec in log)
        out["said"] = [line for line in result.stderr.splitlines() if "replica shares" in line]
    return out


def _tag(wire: str, overlap: bool) -> str:
    """A run's name suffix: its wire (none: nothing) and, when the exchange waits for the backward, ``_after``."""
    return ("" if wire == "none" else f"_{wire}") + ("" if overlap else "_after")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--devices", type=int, default=2, help="ranks an island")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=64, help="global batch (rows a step)")
    parser.add_argument("--mbs-per-rank", type=int, default=2, help="rows a rank a micro-batch")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--slow-precision", default="fp32")
    parser.add_argument("--compress", default="none",
                        help="the replicas' cross-island wires (replica_sync.compress: none, bf16, fp8), comma-separated: "
                             "an even and an auto run for each")
    parser.add_argument("--no-even", action="store_true", help="leave out the even-shares runs")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                        help="replica_sync.overlap: the exchange during the backward (on), after it (off), or both runs")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wires = [w for w in args.compress.split(",") if w]
    if not wires or any(w not in ("none", "bf16", "fp8") for w in wires):
        parser.error(f"--compress {args.compress}: give none, bf16 and/or fp8, comma-separated")
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    settings = [(wire, overlap) for wire in wires for overlap in overlaps]
    n = args.devices
    islands = ",".join(["0"] * n + ["1"] * n)
    half = args.rows // 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = [run(args, "alone", {"micro_batch_size": n * args.mbs_per_rank,
                                    "micro_batches": args.rows // (n * args.mbs_per_rank),
                                    "stages": [{"backend": args.backend, "devices": n, "layers": args.layers, "dp": n}]},
                    None, folder)]
        for wire, overlap in settings:
            sync = {"replica_sync": {"compress": wire, "overlap": "on" if overlap else "off"}}
            tag = _tag(wire, overlap)
            if not args.no_even:
                rows.append(run(args, f"even{tag}", {**sync, "replicas": [replica(args, half, None),
                                                                          replica(args, half, args.slow_precision)]},
                                islands, folder))
            rows.append(run(args, f"auto{tag}", {**sync, "global_batch": args.rows,
                                                 "replicas": [replica(args, "auto", None),
                                                              replica(args, "auto", args.slow_precision)]},
                            islands, folder))
    by = {r["run"]: r for r in rows}
    ratios = {}
    for wire, overlap in settings:
        tag = _tag(wire, overlap)
        if not args.no_even:
            ratios[f"auto_over_even{tag}"] = by[f"auto{tag}"]["tokens_per_s"] / by[f"even{tag}"]["tokens_per_s"]
        ratios[f"auto_over_alone{tag}"] = by[f"auto{tag}"]["tokens_per_s"] / by["alone"]["tokens_per_s"]
    if args.json:
        print(json.dumps({"runs": rows, **ratios}, indent=2))
        return 0
    for r in rows:
        extra = "" if "rows" not in r else (f"  rows {r['first_rows']} -> {r['rows']} ({r['rebalances']} rebalance(s)), "
                                             f"sync {r['sync_share']:.0%} of the step")
        print(f"{r['run']:10s} {r['tokens_per_s']:>12,.0f} tokens/s{extra}")
    for wire, overlap in settings:
        tag = _tag(wire, overlap)
        even = "" if args.no_even else f"auto / even {ratios[f'auto_over_even{tag}']:.2f}x   "
        print(f"wire {'fp32' if wire == 'none' else wire}, exchange {'during' if overlap else 'after'} the backward: "
              f"{even}auto / alone {ratios[f'auto_over_alone{tag}']:.2f}x")
        for line in by[f"auto{tag}"].get("said", []):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
