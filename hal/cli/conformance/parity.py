"""``hal conformance parity``: does a real training run on the backend converge like the reference device's, within the
reference's own seed-to-seed spread? Argument wiring and what is printed where (progress and summary on stderr with
``--json``)."""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

from hal.errors import ConfigError

from ..common import add_standin_argument, print_result

MIN_REFERENCE_SEEDS = 4
MIN_CANDIDATE_SEEDS = 2


# the planted faults' names and what each does (``hal.conformance.parity.faults``, which imports torch: the parser may not;
# tests/unit/test_parity_stats.py keeps the two equal)
FAULT_HELP: dict[str, str] = {
    "lr+5%": "learning rate 1.05 x the reference's",
    "half-grad": "layers.1.mlp.down.weight's gradient halved",
    "data-order": "the data order drawn from another seed",
    "bf16-accumulate": "every linear layer's matmul accumulated in bfloat16",
}


def add_parser(inner: Any) -> None:
    p = inner.add_parser(
        "parity",
        help="train a real model K times on the reference and N times on the backend: does the backend converge "
        "within the reference's own seed-to-seed spread?",
        description="Training parity. The tiny example's Llama shape (or --config's model) trains for --steps on the "
        "reference backend with K seeds and on the candidate with N of the same seeds (data order fixed). The verdict "
        "has four checks after warm-up. Loss: every step within the reference band, mean ± max(1 %%, 3 sigma). Gradient "
        "norm: within mean ± max(10 %%, 3 sigma). Per layer: at the first, middle and last step's weights, every "
        "gradient with cosine >= 0.99 and a norm within bound of the float64 CPU gradient. Steps to target: a Welch "
        "one-sided t-test at p = 0.05 each way (faster is suspect too). The reference band is cached "
        "(HAL_CACHE_DIR/parity) and reused. Writes results.json, summary.md and report.html (the band and the curves "
        "plotted). Exit 0 on pass, 1 on fail, 2 for bad input.",
    )
    p.add_argument("--backend", help="the candidate backend (default: HAL_BACKEND, else auto)")
    p.add_argument("--reference", default="cpu", help="the reference backend (default cpu)")
    p.add_argument("--config", metavar="FILE", help="a hal config whose model, train.steps/lr/data, rows a step and "
                   "precision to train (default: the tiny example's Llama shape on the shipped corpus, 300 steps, fp32)")
    p.add_argument("--steps", type=int, metavar="N", help="steps a run (default 300, or the config's train.steps)")
    p.add_argument("--seeds", type=int, default=MIN_REFERENCE_SEEDS, metavar="K",
                   help=f"reference runs, one a seed (default and least {MIN_REFERENCE_SEEDS})")
    p.add_argument("--candidate-seeds", type=int, default=MIN_CANDIDATE_SEEDS, metavar="N",
                   help=f"candidate runs, the first N of the reference's seeds (default and least {MIN_CANDIDATE_SEEDS})")
    p.add_argument("--plant", choices=sorted(FAULT_HELP), metavar="FAULT",
                   help="plant a known fault in the candidate, to see the verdict catch it: " +
                   "; ".join(f"{k}: {v}" for k, v in FAULT_HELP.items()))
    p.add_argument("--no-cache", action="store_true", help="train the reference band even where an identical one is cached")
    p.add_argument("--report", metavar="DIR", help="where the files go (default: runs/parity-<backend>-<date-time>)")
    p.add_argument("--overwrite", action="store_true", help="replace a parity report already in --report DIR")
    p.add_argument("--json", action="store_true", help="print results.json on stdout (the summary goes to stderr)")
    add_standin_argument(p)
    p.set_defaults(func=cmd_parity)


class _Progress:
    def __init__(self, every: float = 2.0) -> None:
        self.started = self.last = time.monotonic()
        self.every = every

    def __call__(self, what: str, step: int, steps: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every or step == steps - 1:
            self.last = now
            print(f"parity: {what}: step {step + 1}/{steps} · {now - self.started:.0f} s", file=sys.stderr, flush=True)


def cmd_parity(args: argparse.Namespace) -> int:
    from hal.backend_registry import get_backend
    from hal.conformance import runner
    from hal.conformance.parity import band as B
    from hal.conformance.parity import document, runs, verdict
    from hal.conformance.parity.faults import FAULTS
    from hal.conformance.reports.report import check_report_dir
    from hal.run_dirs import new_run_dir

    if args.seeds < MIN_REFERENCE_SEEDS:
        raise ConfigError(f"--seeds {args.seeds}: the reference band needs at least {MIN_REFERENCE_SEEDS} seeds (MLPerf "
                          "asks for 2N reference runs); give 4 or more")
    if not MIN_CANDIDATE_SEEDS <= args.candidate_seeds <= args.seeds:
        raise ConfigError(f"--candidate-seeds {args.candidate_seeds}: give {MIN_CANDIDATE_SEEDS} to --seeds ({args.seeds}); "
                          "the candidate runs the first N of the reference's seeds")
    if args.steps is not None and not 20 <= args.steps <= 100_000:
        raise ConfigError(f"--steps {args.steps}: give 20 to 100000 steps (the band skips a warm-up of 5 %, at least 5)")
    config = runs.from_file(args.config, args.steps) if args.config else runs.ParityConfig(steps=args.steps or 300)
    if config.steps < 20:
        raise ConfigError(f"{args.config}: train.steps {config.steps}: parity needs 20 or more; give --steps")
    reference = get_backend(args.reference)
    reference.require_available()
    ctx, _ = runner.build_context(args.backend)
    candidate = ctx.backend
    target = Path(args.report) if args.report else new_run_dir(f"parity-{candidate.name}")
    existed = target.is_dir()
    directory = check_report_dir(target, refuse_existing=() if args.overwrite else document.FILES)
    seeds = list(range(args.seeds))
    progress = _Progress()
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    plant = FAULTS[args.plant][1]() if args.plant else runs.Candidate()
    try:
        band = B.reference_band(config, seeds, reference, use_cache=not args.no_cache, progress=progress)
        if band.cached:
            print(f"parity: the reference band of seeds {seeds} on {reference.name} is cached ({B.cache_path(config, seeds, reference)})",
                  file=sys.stderr)
        curves = [runs.train_run(config, s, candidate, ctx.device, candidate=plant, layer_check=True,
                                 on_step=lambda t, s=s: progress(f"candidate seed {s}", t, config.steps))
                  for s in seeds[:args.candidate_seeds]]
    except BaseException:
        if not existed and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
        raise
    checks = verdict.judge(config, band, curves)
    doc = document.assemble(config, band, candidate, curves, checks, fault=args.plant, wall_s=time.monotonic() - t0,
                            started=started)
    paths = document.write(doc, directory)
    summary = document.summary_text(doc) + f"reports: {', '.join(str(p) for p in paths)}\n"
    print_result(summary, doc, args.json)
    return 0 if doc["verdict"] == "pass" else 1
