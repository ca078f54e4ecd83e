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

``--profile P`` (a ``hal profile`` of the fast island's config, links measured: the host-staged bridge among them)
and ``--slow-profile S`` (the slow island's precision; default P) set the planner's prediction beside each run: the
step the cost model predicts for the plan as it ran (``planner.replica_search.predict_replicas``, the islands
declared apart, each replica at the shares in force at the run's end) against the measured one, and the sync's
predicted share against the measured. ``--profile make`` runs ``hal profile`` for both first (its minutes said).

Each run's steady tokens/s (``hal train``'s summary: the first step and checkpoint writes left out) and the shares
in force at its end; ``auto / even`` and ``auto / alone`` are the ratios to read. Every cross-island byte goes
through the bridge (host-staged), so the sync's share of the step is reported too. ``--backend cpu`` runs the same
on CPU ranks (a smoke run; the speeds then do not differ by precision on most hosts).

    python benchmarks/replicas_shares.py [--backend cuda] [--devices 2] [--steps 30] [--rows 64] [--hidden 768]
                                         [--layers 12] [--seq 1024] [--compress none,fp8] [--overlap on|off|both] [--no-even]
                                         [--profile P|make] [--slow-profile S] [--json]
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
    mixed = island(args, True)[0] != args.backend  # stages on two backends: none at the top
    return {"backend": "auto" if mixed else args.backend, "precision": "bf16-mixed" if args.backend != "cpu" else "fp32",
            "fallback": "warn",
            "model": {"vocab_size": 32000, "hidden_size": h, "num_layers": args.layers, "num_heads": max(1, h // 64),
                      "num_kv_heads": max(1, h // 256), "ffn_hidden_size": 4 * h, "max_seq_len": args.seq},
            "parallel": parallel,
            "train": {"steps": args.steps, "lr": 3e-4, "seed": 0, "data": "synthetic", "seq_len": args.seq}}


def island(args: argparse.Namespace, slow: bool) -> tuple[str, int]:
    """(backend, ranks) of island A (``slow`` False) or B."""
    if not slow:
        return args.backend, args.devices
    return args.slow_backend or args.backend, args.slow_devices or args.devices


def replica(args: argparse.Namespace, rows: Any, slow: bool) -> dict[str, Any]:
    backend, n = island(args, slow)
    stage: dict[str, Any] = {"backend": backend, "devices": n, "layers": args.layers, "dp": n}
    if slow:
        stage["precision"] = args.slow_precision
    return {"rows": rows, "micro_batch_size": n * args.mbs_per_rank, "stages": [stage]}


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
        out["said"] = [line for line in result.stderr.splitlines() if "replica shares" in line or "slow this job" in line]
    return out


def replica_plans(args: argparse.Namespace, rows: list[int]) -> list[Any]:
    """The replicas' plans as they ran at the end (``rows`` each), for the cost model."""
    from hal.parallel.config.plan import ParallelPlan, StagePlan

    out = []
    for i, n in enumerate(rows):
        backend, devices = island(args, i == 1)
        stage = StagePlan(backend, devices, args.layers, dp=devices, precision=args.slow_precision if i == 1 else None)
        mbs = devices * args.mbs_per_rank
        out.append(ParallelPlan((stage,), "1f1b", n // mbs, mbs))
    return out


def make_profiles(args: argparse.Namespace, folder: Path) -> tuple[str, str]:
    """``hal profile`` of the fast island's config (links measured) and of the slow one's precision."""
    from hal.parallel.planner.cluster import load_cluster

    probed = load_cluster(None, "this host")  # each island's backend alone: the other devices are not timed
    paths = []
    for name, slow in (("fast", False), ("slow", True)):
        backend, n = island(args, slow)
        groups = [{"backend": t.backend, "device": t.device, "count": n if t.is_cpu else count, "node": node,
                   **({"cores": t.cores} if t.is_cpu and t.cores else {})}
                  for t in probed.types if t.backend == backend for node, count in t.nodes]
        cluster = folder / f"cluster_{name}.yaml"
        cluster.write_text(yaml.safe_dump({"cluster": {"groups": groups}}), encoding="utf-8")
        cfg = config(args, {"micro_batch_size": n * args.mbs_per_rank, "micro_batches": 1,
                            "stages": [{"backend": backend, "devices": 1, "layers": args.layers}]})
        cfg["backend"] = backend
        if slow:
            cfg["precision"] = args.slow_precision
        path, out = folder / f"profile_{name}.yaml", folder / f"profile_{name}.json"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        flags = ["--no-links"] if slow and backend == args.backend else []  # one bridge measurement is enough
        print(f"replicas_shares: hal profile of the {name} island ({cfg['precision']})", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "hal", "profile", "--config", str(path), "--out", str(out),
                               "--cluster", str(cluster), *flags],
                              capture_output=True, text=True, cwd=REPO, timeout=args.timeout)
        if done.returncode != 0:
            raise SystemExit(f"hal profile ({name}) failed:\n{done.stderr[-3000:]}")
        paths.append(str(out))
    return paths[0], paths[1]


def predictions(args: argparse.Namespace, rows: list[dict[str, Any]], fast: str, slow: str, folder: Path) -> None:
    """Set ``predicted_step_s`` (and for replicated runs ``predicted_sync_share``) beside each run's measured step."""
    from hal.parallel.config.plan import ParallelPlan, StagePlan
    from hal.parallel.config.run import load_run_config
    from hal.parallel.planner.cluster import load_cluster
    from hal.parallel.planner.cost import CostModel, Placement
    from hal.parallel.planner.profile_store import load_profile
    from hal.parallel.planner.replica_search import predict_replicas

    path = folder / "alone.yaml"
    run_config = load_run_config(path, check_backends=False)
    cluster = load_cluster(None, str(path))
    model, seq = run_config.model, args.seq
    fast_profile, slow_profile = load_profile(fast, model, run_config.hal.precision), load_profile(slow, model, args.slow_precision)
    for name, link in slow_profile.links.items():  # island B's links (a cpu island's bridge) where A has none
        fast_profile.links.setdefault(name, link)
    fast_cost = CostModel(cluster, fast_profile, model, seq)
    slow_cost = CostModel(cluster, slow_profile, model, seq)
    for r in rows:
        r["measured_step_s"] = args.rows * seq / r["tokens_per_s"]
        if "rows" not in r:  # alone
            mbs = args.devices * args.mbs_per_rank
            plan = ParallelPlan((StagePlan(args.backend, args.devices, args.layers, dp=args.devices),), "1f1b",
                                args.rows // mbs, mbs)
            kind = next(t for t in cluster.types if t.backend == args.backend)
            r["predicted_step_s"] = fast_cost.predict(plan, Placement.pack(plan, (kind,))).step_s
            continue
        wire = "fp8" if "_fp8" in r["run"] else "bf16" if "_bf16" in r["run"] else "none"
        c = predict_replicas([fast_cost, slow_cost], replica_plans(args, r["rows"]), r["rows"], bridged=True,
                             compress=wire)
        r["predicted_step_s"], r["predicted_sync_share"] = c.step_s, c.sync.seconds / c.step_s
        r["predicted_replica_s"] = [x.prediction.step_s for x in c.results]


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
    parser.add_argument("--slow-backend", help="island B's backend (default --backend's): cpu makes it a cpu island")
    parser.add_argument("--slow-devices", type=int, help="island B's ranks (default --devices)")
    parser.add_argument("--compress", default="none",
                        help="the replicas' cross-island wires (replica_sync.compress: none, bf16, fp8), comma-separated: "
                             "an even and an auto run for each")
    parser.add_argument("--no-even", action="store_true", help="leave out the even-shares runs")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                        help="replica_sync.overlap: the exchange during the backward (on), after it (off), or both runs")
    parser.add_argument("--profile", help="a hal profile of the fast island (links measured), or 'make': predictions "
                                          "beside the measured steps")
    parser.add_argument("--slow-profile", help="a hal profile at the slow island's precision (default: --profile's)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    wires = [w for w in args.compress.split(",") if w]
    if not wires or any(w not in ("none", "bf16", "fp8") for w in wires):
        parser.error(f"--compress {args.compress}: give none, bf16 and/or fp8, comma-separated")
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    settings = [(wire, overlap) for wire in wires for overlap in overlaps]
    n = args.devices
    islands = ",".join(["0"] * n + ["1"] * island(args, True)[1])
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
                rows.append(run(args, f"even{tag}", {**sync, "replicas": [replica(args, half, False),
                                                                          replica(args, half, True)]},
                                islands, folder))
            rows.append(run(args, f"auto{tag}", {**sync, "global_batch": args.rows,
                                                 "replicas": [replica(args, "auto", False),
                                                              replica(args, "auto", True)]},
                            islands, folder))
        if args.profile:  # after the runs: a profile that fails costs the predictions, not the measurements
            try:
                fast, slow = (make_profiles(args, folder) if args.profile == "make" else
                              (args.profile, args.slow_profile or args.profile))
                predictions(args, rows, fast, slow, folder)
            except (SystemExit, Exception) as exc:  # said, and the measured table still printed
                print(f"replicas_shares: no predictions: {exc}", file=sys.stderr)
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
        if "predicted_step_s" in r:
            err = r["predicted_step_s"] / r["measured_step_s"] - 1
            sync = (f"; sync share predicted {r['predicted_sync_share']:.0%}" if "predicted_sync_share" in r else "")
            print(f"{'':10s} step measured {r['measured_step_s']:.4g} s, predicted {r['predicted_step_s']:.4g} s "
                  f"({err:+.1%}){sync}")
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
