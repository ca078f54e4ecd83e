"""``hal train F``: check the whole run, then one local process per rank of the plan, and train."""
from __future__ import annotations

import argparse
from typing import Any

NAME = "train"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="train a hybrid-parallel plan: one local process per rank, progress, JSON-lines log, checkpoints",
        description="Validate CONFIG (model, plan, train, backends, data, --resume checkpoint), then start one process "
        "per rank of the plan on this machine, each with HAL_BACKEND of its stage, and train: a progress line on "
        "stderr, one JSON line per step (loss, tokens/s, per-stage compute / p2p / bubble) in train.log_file, and a "
        "device-agnostic checkpoint at the end (and every train.checkpoint_every steps). Several nodes: see "
        "--print-multinode.",
    )
    p.add_argument("config", help="YAML config with model:, parallel: and train: sections")
    p.add_argument("--steps", type=int, help="train until this many steps are done in total (default: train.steps)")
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint (a step-N directory, or a checkpoint_dir: its latest) — any plan with the same model")
    p.add_argument("--run-dir", metavar="DIR", help="where the log, summary and checkpoints go (default: runs/<config>-<date-time>)")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON on stdout")
    p.add_argument("--print-multinode", type=int, metavar="NODES",
                   help="print the plain torchrun command for each of NODES nodes and start nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.parallel.train import train_main

    return train_main(args.config, steps=args.steps, resume=args.resume, run_dir=args.run_dir, as_json=args.json,
                      print_multinode=args.print_multinode)
