"""What running a DualPipeV pair at once saves on one device: a forward and another micro-batch's backward.

DualPipeV's steady state pairs a forward of one chunk with a backward of the other; the engine runs the forward on a
second thread while its own runs the backward (``hal.parallel.pipeline.pairs``). This times that pair on one stage of
the 1.21B benchmark model (a middle stage: no embedding, no head) both ways, with the engine's own ``PairRunner``:

    python benchmarks/pair_overlap.py [--backend cuda] [--layers 6] [--micro-batch-size 1] [--compile]
    python benchmarks/pair_overlap.py --backend cpu --preset tiny      # a smoke test, not a benchmark

Each figure is the median over ``--iters`` pairs of the wall time from a synchronised start to a synchronised end
(the pair as the stage's next action sees it), the two ways alternating over ``--rounds`` rounds; the ratio is in
turn / at once from the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pipeline import PRESETS  # noqa: E402
from benchmarks.split_backward import _stage  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def measure(opts: dict[str, Any]) -> dict[str, Any]:
    from hal.backend_registry import get_backend
    from hal.parallel.config.model import ModelConfig
    from hal.parallel.pipeline.compile_stage import eager_first_forward
    from hal.parallel.pipeline.pairs import PairRunner

    backend = get_backend(opts["backend"])
    device = backend.device(0) if opts["backend"] != "cpu" else torch.device("cpu")
    spec = dict(PRESETS[opts["preset"]])
    spec["max_seq_len"] = max(spec["max_seq_len"], opts["seq"])
    model = ModelConfig(**spec)
    dtype = DTYPES[opts["dtype"]]
    stage = _stage(model, opts["layers"], device, dtype, opts["compile"], "inductor")
    x = torch.randn(opts["micro_batch_size"], opts["seq"], model.hidden_size, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    runner = PairRunner(backend, device)

    def forward() -> torch.Tensor:
        return stage(x.detach().requires_grad_(True))

    with eager_first_forward():  # fills the op caches; compiling starts with the next forward
        forward().backward(grad)
    for _ in range(2):
        forward().backward(grad)
    backend.synchronize()

    def timed(at_once: bool) -> list[float]:
        previous = forward()
        seconds = []
        for _ in range(opts["iters"]):
            backend.synchronize()
            began = time.perf_counter()
            if at_once:
                previous, _ = runner.run(forward, lambda p=previous: p.backward(grad))
            else:
                made = forward()
                previous.backward(grad)
                previous = made
            backend.synchronize()
            seconds.append(time.perf_counter() - began)
        previous.backward(grad)
        return seconds

    both: dict[str, list[float]] = {"in_turn": [], "at_once": []}
    for _ in range(opts["rounds"]):
        both["in_turn"] += timed(False)[1:]
        both["at_once"] += timed(True)[1:]
    runner.close()
    ms = {k: 1e3 * statistics.median(v) for k, v in both.items()}
    card = backend.device_name(0) if opts["backend"] != "cpu" else "cpu"
    return {"card": card, "torch": torch.__version__, **{k: v for k, v in opts.items() if k != "json"},
            "in_turn_ms": ms["in_turn"], "at_once_ms": ms["at_once"], "ratio": ms["in_turn"] / ms["at_once"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=None, help="tokens a row (default: the preset's max_seq_len)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16, float32 on the cpu")
    parser.add_argument("--compile", action="store_true", help="each decoder layer through torch.compile (inductor)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("layers", "micro_batch_size", "iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.layers > PRESETS[args.preset]["num_layers"]:
        parser.error(f"--layers {args.layers} exceeds the preset's {PRESETS[args.preset]['num_layers']} layers")
    opts = {"backend": args.backend, "preset": args.preset, "layers": args.layers,
            "micro_batch_size": args.micro_batch_size, "seq": args.seq or PRESETS[args.preset]["max_seq_len"],
            "dtype": args.dtype or ("float32" if args.backend == "cpu" else "bfloat16"), "compile": args.compile,
            "iters": args.iters, "rounds": args.rounds}
    result = measure(opts)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"pair on {result['card']} (torch {result['torch']}): {args.layers} layers of the {args.preset} preset, "
              f"{args.micro_batch_size} x {result['seq']} tokens, {result['dtype']}, "
              f"{'compiled' if args.compile else 'eager'}; medians of {args.rounds} x {args.iters - 1} pairs")
        print(f"  in turn {result['in_turn_ms']:.2f} ms   at once {result['at_once_ms']:.2f} ms   "
              f"in turn / at once {result['ratio']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
