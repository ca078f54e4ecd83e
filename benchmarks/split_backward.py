"""What splitting the backward costs a stage, eager and compiled: F, B (whole) against F, I, W (zero-bubble).

The zero-bubble schedules run each backward as an input half ``I`` and a weight half ``W``
(``hal.parallel.models.weight_grad``). A compiled layer runs its split linears eagerly between its graphs (a
graph break a linear), so the split costs a compiled stage more than an eager one; this measures how much, on
one device, for a middle stage of the 1.21B benchmark model (no embedding, no head), and the share of the
backward its ``W`` takes (the simulator plays unit times with W half the backward).

    python benchmarks/split_backward.py [--backend cuda] [--layers 6] [--micro-batch-size 4] [--seq 2048]
    python benchmarks/split_backward.py --backend cpu --preset tiny     # a smoke test, not a benchmark

Each figure is the median over ``--iters`` micro-batches of device events around each action (what a
pipeline's step pays for it, the host's enqueueing included where the host is slower); the ratios at the end
compare totals (F + B, or F + I + W) of one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pipeline import PRESETS  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _stage(model: Any, layers: int, device: torch.device, dtype: torch.dtype, compiled: bool, compile_backend: str) -> Any:
    from hal.parallel.models.stage import build_stage
    from hal.parallel.pipeline.compile_stage import compile_layers

    stage = build_stage(model, range(layers), first=False, last=False, tp_comm=None, sp=False, seed=0,
                        device=device, dtype=dtype)
    if compiled:
        compile_layers(stage, compile_backend, dynamic=False)
    return stage


def _measure(backend: Any, stage: Any, x: torch.Tensor, grad: torch.Tensor, split: bool, compiled: bool,
             iters: int, warmup: int) -> dict[str, float]:
    """Median ms of F, and of B (whole) or I and W (split), over ``iters`` micro-batches after ``warmup``."""
    from hal.parallel.models.weight_grad import WeightGradStore, collecting, splittable
    from hal.parallel.pipeline.compile_stage import eager_first_forward

    names = ("F", "I", "W") if split else ("F", "B")
    pairs: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}

    def timed(name: str, record: bool, fn: Any) -> Any:
        if not record:
            return fn()
        start, end = backend.Event(enable_timing=True), backend.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        pairs[name].append((start, end))
        return out

    for i in range(warmup + iters):
        record = i >= warmup
        stage.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_(True)
        first = eager_first_forward() if compiled and i == 0 else torch.enable_grad()
        with first, splittable(split):
            out = timed("F", record, lambda: stage(inp))
        if split:
            store = WeightGradStore()
            with collecting(store):
                timed("I", record, lambda: out.backward(grad))
            if i == warmup and not len(store):
                raise RuntimeError("the split backward deferred no weight gradient: the W half is empty")
            timed("W", record, store.run)
        else:
            timed("B", record, lambda: out.backward(grad))
    backend.synchronize()
    return {n: statistics.median(s.elapsed_time(e) for s, e in pairs[n]) for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--layers", type=int, default=6, help="decoder layers in the stage (default 6: a quarter of the 1b preset)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    from hal import get_backend
    from hal.parallel.config.model import ModelConfig

    backend = get_backend(a.backend)
    backend.require_available()
    backend.set_device(0)
    device, dtype = backend.device(0), DTYPES[a.dtype]
    spec = dict(PRESETS[a.preset])
    seq = a.seq or spec["max_seq_len"]
    spec["max_seq_len"] = max(seq, spec["max_seq_len"])
    if not 1 <= a.layers <= spec["num_layers"]:
        p.error(f"--layers {a.layers}: give 1 to {spec['num_layers']} (the preset's layers)")
    model = ModelConfig(**spec)
    torch.manual_seed(0)
    x = torch.randn(a.micro_batch_size, seq, model.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    rows: list[dict[str, Any]] = []
    for compiled in (False, True):
        stage = _stage(model, a.layers, device, dtype, compiled, a.compile_backend)
        for split in (False, True):
            if compiled:
                torch._dynamo.reset()  # each variant compiles its own graphs (split: one graph break a linear)
            times = _measure(backend, stage, x, grad, split, compiled, a.iters, a.warmup)
            rows.append({"compiled": compiled, "split": split, **times, "total": sum(times.values())})
            print(f"  {'compiled' if compiled else 'eager':8s} {'F I W' if split else 'F B':5s} "
                  + "  ".join(f"{k} {v:7.2f} ms" for k, v in times.items()), file=sys.stderr, flush=True)
        del stage
    total = {(r["compiled"], r["split"]): r["total"] for r in rows}
    summary = {
        "card": backend.device_name(0), "torch": torch.__version__, "layers": a.layers, "rows": a.micro_batch_size,
        "seq": seq, "dtype": a.dtype, "results": rows,
        "split_cost_eager": total[(False, True)] / total[(False, False)],
        "split_cost_compiled": total[(True, True)] / total[(True, False)],
        "compiled_split_vs_eager_split": total[(False, True)] / total[(True, True)],
        "w_share_eager": rows[1]["W"] / (rows[1]["I"] + rows[1]["W"]),
        "w_share_compiled": rows[3]["W"] / (rows[3]["I"] + rows[3]["W"]),
    }
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['card']}, torch {summary['torch']}: {a.layers} layers, {a.micro_batch_size} x {seq} tokens, {a.dtype}")
    print("| stage | F ms | B ms | I ms | W ms | F+B(+I+W) ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'compiled' if r['compiled'] else 'eager'}, {'split' if r['split'] else 'whole'} | {r['F']:.2f} | "
              f"{r.get('B', float('nan')):.2f} | {r.get('I', float('nan')):.2f} | {r.get('W', float('nan')):.2f} | {r['total']:.2f} |")
    print(f"split / whole: eager {summary['split_cost_eager']:.3f}x, compiled {summary['split_cost_compiled']:.3f}x; "
          f"compiled split is {summary['compiled_split_vs_eager_split']:.3f}x faster than eager split; "
          f"W share of the backward: eager {summary['w_share_eager']:.2f}, compiled {summary['w_share_compiled']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
