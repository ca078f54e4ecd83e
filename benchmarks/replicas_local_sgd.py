"""Local SGD across replicas against the every-step gradient sync, on the tiny CPU example's model and data.

    python benchmarks/replicas_local_sgd.py [--steps 320] [--every 1,8,32] [--wires bf16,fp8] [--json]

Two replicas of one rank each (each its own island: every cross-replica byte goes through the bridge), 8 rows of
every step's 16 each, trained with ``hal train`` once per H in ``--every`` (1: the exact every-step sync; H > 1:
local SGD meeting every H steps over AdamW inner steps: the mean delta applied as it is, outer lr 1 and no
momentum, unless ``--outer-lr`` / ``--outer-momentum`` ask DiLoCo's Nesterov step), and H = 1 with the
cross-replica part sent compressed (``--wires``: ``compress: bf16``, ``compress: fp8`` with error feedback).
Reports, per run, the cross-replica bytes a step (from the run's log) and the final evaluation loss on held-out
text, and each against H = 1. Needs ``examples/data/tiny.bin`` (``hal data prepare``: see examples/tiny_cpu.yaml). Name the machine with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


OUTER = {"outer_lr": 1.0, "outer_momentum": 0.0}  # plain averaging; DiLoCo's is 0.7 and Nesterov 0.9 (for H ~ 500)


def config(steps: int, every: int, compress: str = "none") -> dict:
    raw = yaml.safe_load((REPO / "examples" / "tiny_cpu.yaml").read_text(encoding="utf-8"))
    one = {"micro_batch_size": 4, "stages": [{"backend": "cpu", "devices": 1, "layers": 4}]}
    sync = {"every": every, "compress": compress} if every == 1 else {"every": every, **OUTER}
    raw["parallel"] = {"replica_sync": sync, "replicas": [{"rows": 8, **one}, {"rows": 8, **one}]}
    train = raw["train"]
    train.pop("grad_clip", None)  # not with local SGD (each replica's own gradient norm): left out of every run alike
    train.pop("checkpoint_every", None)  # one checkpoint, at the end
    train.update(steps=steps, eval_every=every * max(1, 32 // every),
                 data=str(REPO / "examples" / "data" / "tiny.bin"))
    return raw


def run(steps: int, every: int, folder: Path, compress: str = "none") -> dict:
    name = f"every{every}-{compress}"
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(steps, every, compress)), encoding="utf-8")
    env = {**os.environ, "HAL_ISLANDS": "0,1"}
    result = subprocess.run([sys.executable, "-m", "hal", "train", str(path), "--run-dir", str(folder / name),
                             "--json"], capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"every {every}: hal train failed:\n{result.stderr[-2000:]}")
    summary = json.loads(result.stdout)
    log = [json.loads(line) for line in (folder / name / "train.jsonl").read_text().splitlines()]
    evals = [rec["eval_loss"] for rec in log if "eval_loss" in rec]  # every 32 steps (at a meeting)
    sent = sum(r["cross_replica_bytes"] for rec in log for r in rec["replicas"])
    return {"every": every, "compress": compress, "steps": steps, "final_loss": summary["final_loss"], "final_eval_loss": evals[-1],
            "best_eval_loss": min(evals),
            "bytes_per_step": sent / len(log), "tokens_per_s": summary["tokens_per_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=320, help="a multiple of every H (default 320)")
    parser.add_argument("--every", default="1,8,32", help="comma-separated H values; 1 is the baseline")
    parser.add_argument("--outer-lr", type=float, default=OUTER["outer_lr"])
    parser.add_argument("--outer-momentum", type=float, default=OUTER["outer_momentum"])
    parser.add_argument("--wires", default="bf16,fp8",
                        help="compressed wires tried at H = 1, comma-separated (bf16, fp8; empty: none)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    values = [int(v) for v in args.every.split(",")]
    OUTER.update(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    if 1 not in values or any(args.steps % h for h in values):
        parser.error("--every must include 1 and divide --steps")
    wires = [w for w in args.wires.split(",") if w]
    if any(w not in ("bf16", "fp8") for w in wires):
        parser.error(f"--wires {args.wires}: give bf16 and/or fp8, comma-separated")
    if not (REPO / "examples" / "data" / "tiny.bin").is_file():
        parser.error("examples/data/tiny.bin is missing: run the hal data prepare line of examples/tiny_cpu.yaml")
    with tempfile.TemporaryDirectory(prefix="hal-localsgd-") as tmp:
        rows = []
        for every in values:
            rows.append(run(args.steps, every, Path(tmp)))
            print(f"every {every}: {rows[-1]}", file=sys.stderr)
        for wire in wires:
            rows.append(run(args.steps, 1, Path(tmp), wire))
            print(f"every 1, {wire}: {rows[-1]}", file=sys.stderr)
    base = next(r for r in rows if r["every"] == 1 and r["compress"] == "none")
    for r in rows:
        r["bytes_ratio"] = base["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
        r["eval_gap"] = r["final_eval_loss"] / base["final_eval_loss"] - 1.0
        r["best_gap"] = r["best_eval_loss"] / base["best_eval_loss"] - 1.0
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'H':>4} {'wire':>5} {'bytes/step':>12} {'÷ vs H=1':>9} {'final eval':>11} {'gap vs H=1':>11} "
          f"{'best eval':>10} {'gap':>8} {'tokens/s':>9}")
    for r in rows:
        wire = "fp32" if r["compress"] == "none" else r["compress"]
        print(f"{r['every']:>4} {wire:>5} {r['bytes_per_step']:>12,.0f} {r['bytes_ratio'] or 0:>9.1f} {r['final_eval_loss']:>11.4f} "
              f"{r['eval_gap']:>+11.2%} {r['best_eval_loss']:>10.4f} {r['best_gap']:>+8.2%} {r['tokens_per_s'] or 0:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
