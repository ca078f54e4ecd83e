"""The ``hal`` command: ``hal devices``, ``hal config``, ``hal ops``, ``hal run``, ``hal launch``,
``hal bench collectives``, ``hal plan``, ``hal train``, ``hal conformance``.

Every user error is one line on stderr and exit status 2 — argparse's usage dump included — so
scripts and people get the same short, fixable message and never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, NoReturn, Sequence

import torch

from .errors import HalError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise HalError(f"{self.prog}: {message} (see '{self.prog} --help')")


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


# --- hal devices -------------------------------------------------------------------------------------


def _device_rows(backend: Any) -> list[dict[str, Any]]:
    rows = []
    for index in range(backend.device_count()):
        caps = backend.capabilities(index).to_dict()
        try:
            free, total = backend.mem_get_info(index)
        except Exception as exc:  # shown, not fatal: the rest of the listing still helps
            free, total = None, caps["memory_bytes"]
            caps["memory_error"] = str(exc)
        rows.append({"index": index, **caps, "memory_free_bytes": free, "memory_total_bytes": total})
    return rows


def devices_report() -> dict[str, Any]:
    """Every registered backend: availability and why, devices, CCL, hardware verification."""
    from .backend_registry import all_backends, load_problems
    from .selection import choose_backend

    entries = []
    for name, backend in all_backends().items():
        try:
            status = backend.availability()
            available, reason = status.available, status.reason
            devices = _device_rows(backend) if available else []
        except Exception as exc:  # a third-party backend's broken probe is reported, not raised
            available, reason, devices = False, f"probe raised {type(exc).__name__}: {exc}", []
        entries.append(
            {
                "name": name,
                "vendor": backend.vendor,
                "device_type": backend.device_type,
                "ccl": backend.ccl,
                "process_group_backend": backend.process_group_backend(),
                "visible_devices_env": backend.visible_devices_env,
                "available": available,
                "reason": reason,
                "device_count": len(devices),
                "devices": devices,
                "verified_on_hardware": backend.hardware_verification is not None,
                "verification": backend.verification,
            }
        )
    chosen, why = choose_backend("auto")
    return {
        "torch": torch.__version__,
        "backends": entries,
        "auto": {"backend": chosen.name, "reason": why},
        "load_problems": [p.__dict__ for p in load_problems()],
    }


def _print_devices(report: dict[str, Any]) -> None:
    print(f"hal devices (torch {report['torch']})")
    for b in report["backends"]:
        state = "available" if b["available"] else "unavailable"
        print(f"\n{b['name']:<10} {state:<12} vendor {b['vendor']}, device type '{b['device_type']}', ccl {b['ccl']}")
        print(f"  {'why':<9} {b['reason']}")
        print(f"  {'verified':<9} {b['verification']}")
        for d in b["devices"]:
            native = " ".join(k for k, v in d["dtypes"].items() if v == "native")
            catalog = d["catalog_id"] or "not in catalog (probed facts only)"
            print(f"  {b['device_type']}:{d['index']:<6} {d['name']}  memory {_gib(d['memory_total_bytes'])} "
                  f"(free {_gib(d['memory_free_bytes'])})  catalog {catalog}")
            print(f"  {'':<9} native dtypes: {native or 'none'}")
    for p in report["load_problems"]:
        print(f"\nplug-in {p['name']}: {p['reason']} [{p['origin']}]")
    print(f"\nauto -> {report['auto']['backend']}: {report['auto']['reason']}")


def cmd_devices(args: argparse.Namespace) -> int:
    report = devices_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_devices(report)
    return 0


# --- hal ops ---------------------------------------------------------------------------------------


def ops_report(backend_name: str) -> dict[str, Any]:
    """Coverage: op × dtype → implementation the registry picks on ``backend_name`` (no policy applied)."""
    from .ops import STANDARD_DTYPES, registry

    table: dict[str, dict[str, Any]] = {}
    for op in registry.names():
        row = {}
        for dtype in STANDARD_DTYPES:
            choice = registry.choose(op, backend_name, dtype)
            row[str(dtype).replace("torch.", "")] = {
                "impl": choice.impl.name,
                "source": choice.impl.source,
                "fallback_from": [{"impl": n, "reason": r} for n, r in choice.skipped],
            }
        table[op] = row
    return {"backend": backend_name, "ops": table}


def _print_ops(report: dict[str, Any]) -> None:
    dtypes = list(next(iter(report["ops"].values())))
    width = max(len(op) for op in report["ops"]) + 2
    col = max(14, *(len(c["impl"]) + 2 for row in report["ops"].values() for c in row.values()))
    print(f"ops on backend '{report['backend']}' (op × dtype → implementation; * = fallback, see below)")
    print("op".ljust(width) + "".join(d.ljust(col) for d in dtypes))
    notes: dict[str, str] = {}
    for op, row in report["ops"].items():
        cells = []
        for dtype, cell in row.items():
            mark = "*" if cell["fallback_from"] else ""
            cells.append((cell["impl"] + mark).ljust(col))
            for skipped in cell["fallback_from"]:
                notes[f"{op}: {skipped['impl']}"] = skipped["reason"]
        print(op.ljust(width) + "".join(cells))
    for what, why in notes.items():
        print(f"* {what} not used: {why}")


def cmd_ops(args: argparse.Namespace) -> int:
    from .backend_registry import get_backend
    from .config import load_config
    from .selection import choose_backend

    config = load_config(args.config, overrides={"backend": args.backend})
    if config.backend == "auto":
        name = choose_backend("auto")[0].name
    else:
        name = get_backend(config.backend).name  # coverage is data: shown even where unavailable
    report = ops_report(name)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_ops(report)
    return 0


# --- hal run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .config import load_config
    from .selection import select_backend

    script = Path(args.script)
    if not script.is_file():
        raise HalError(f"hal run: script {args.script!r} not found; give the path of a Python file")
    config = load_config(args.config, overrides={"backend": args.backend})
    selection = select_backend(config)
    selection.activate()
    from .migration import run_script  # after validation: the shim is only loaded to run something

    print(f"hal run: backend {selection.backend.name} ({selection.reason.split(';')[0]}), "
          f"devices {list(selection.devices)}, precision {selection.precision.describe()}", file=sys.stderr)
    return run_script(selection.backend, str(script), list(args.script_args))


# --- hal config ---------------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace) -> int:
    from .config import load_config
    from .selection import select_backend

    config = load_config(args.config, overrides={"backend": args.backend, "precision": args.precision, "fallback": args.fallback})
    selection = select_backend(config)
    report = {
        "config": config.to_dict(),
        "backend": selection.backend.name,
        "reason": selection.reason,
        "devices": list(selection.devices),
        "precision": selection.precision.describe(),
        "downgrades": [d.to_dict() for d in selection.precision.downgrades],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for key, value in report["config"].items():
        if key != "origins":
            print(f"{key:<10} {value!s:<14} from {config.origins[key]}")
    print(f"-> backend {report['backend']} ({report['reason']})")
    print(f"-> devices {report['devices']}, precision {report['precision']}")
    for d in selection.precision.downgrades:
        print(f"-> {d.describe()}")
    return 0


# --- hal launch ----------------------------------------------------------------------------------------


def cmd_launch(args: argparse.Namespace) -> int:
    from hal.collectives.launch import launch_main

    return launch_main(
        args.nproc, args.script, list(args.script_args), backend=args.backend, config=args.config,
        print_multinode=args.print_multinode,
    )


# --- hal bench collectives -----------------------------------------------------------------------------


def cmd_bench_collectives(args: argparse.Namespace) -> int:
    from hal.collectives.bench import bench_main

    return bench_main(
        backend=args.backend, world_size=args.world_size, sizes=args.sizes, dtypes=args.dtype, ops=args.ops,
        iters=args.iters, warmup=args.warmup, as_json=args.json, rounds=args.rounds,
    )


# --- hal plan ------------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from hal.parallel.plan_report import plan_main  # lazily: hal never imports parallel at import time

    return plan_main(args.config, as_json=args.json)


# --- hal train -----------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    from hal.parallel.train import train_main  # lazily: hal never imports parallel at import time

    return train_main(args.config, steps=args.steps, resume=args.resume, run_dir=args.run_dir, as_json=args.json,
                      print_multinode=args.print_multinode)


# --- wiring --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hal", description="hetero-hal: one PyTorch code base on every vendor's accelerator.")
    sub = parser.add_subparsers(dest="command", metavar="{devices,config,ops,run,launch,bench,plan,train,conformance}", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("devices", help="list every backend: available or not and why, devices, CCL, verification")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("config", help="check a config and show what it resolves to (backend, devices, precision)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--backend", help="override the backend")
    p.add_argument("--precision", help="override the precision mode")
    p.add_argument("--fallback", help="override the fallback policy (error, warn, allow)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("ops", help="operator coverage: op × dtype → implementation")
    p.add_argument("--backend", help="backend to show (default: the configured or auto-selected one)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ops)

    p = sub.add_parser(
        "run",
        help="run an unmodified CUDA-written script on another backend",
        description="Run SCRIPT with its CUDA calls mapped to the chosen backend; arguments after SCRIPT go to it.",
    )
    p.add_argument("--backend", help="target backend (overrides HAL_BACKEND and the config file)")
    p.add_argument("--config", help="YAML config file (backend, devices, precision, fallback)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "launch",
        help="run SCRIPT as N local ranks (torchrun) with each rank pinned to its device",
        description="Run SCRIPT as N local ranks under torchrun; collectives.init_distributed() in the script picks "
        "the backend and the rank's device. Arguments after SCRIPT go to it. Multi-node: see --print-multinode.",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of local ranks (one per device on accelerators)")
    p.add_argument("--backend", help="backend every rank runs (overrides HAL_BACKEND and the config file)")
    p.add_argument("--config", help="YAML config file (backend, devices, precision, fallback)")
    p.add_argument("--print-multinode", type=int, metavar="NODES",
                   help="print the plain torchrun command for each of NODES nodes (to stderr) and start nothing")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("bench", help="benchmarks: 'hal bench collectives'")
    bench = p.add_subparsers(dest="bench", metavar="{collectives}", parser_class=_Parser)
    bench.required = True
    p = bench.add_parser(
        "collectives",
        help="collective latency and bandwidth, hal's API against raw torch.distributed, with correctness checks",
        description="Spawn N ranks and time every op x dtype x size (nccl-tests columns) through hal's Communicator "
        "(validation off) and through raw torch.distributed on the same group; every result is checked exactly.",
    )
    p.add_argument("--backend", help="backend to benchmark (default: the configured or auto-selected one)")
    p.add_argument("--world-size", type=int, help="ranks to spawn (default: every device; 2 on cpu)")
    p.add_argument("--sizes", help="MIN..MAX bytes, doubling (e.g. 8B..1GiB; K/M/G are powers of 1024), or one size")
    p.add_argument("--dtype", help="comma-separated dtypes (default float32)")
    p.add_argument("--ops", help="comma-separated ops (default all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,reduce)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations before each measurement (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="ours and raw measured alternately this many times; medians reported (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout instead of the table")
    p.set_defaults(func=cmd_bench_collectives)

    p = sub.add_parser(
        "plan",
        help="check a parallel plan against its model and backends and show the topology (starts nothing)",
        description="Validate the model, parallel and train sections of CONFIG (layers, tp/dp/sp divisibility, "
        "micro-batching, backends and their device counts) and print the stage table and every rank's "
        "(stage, dp, tp) coordinate. Nothing is started.",
    )
    p.add_argument("--config", required=True, help="YAML config with model:, parallel: and train: sections")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "train",
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
    p.set_defaults(func=cmd_train)

    from hal.conformance.cli import add_parser as add_conformance  # lazily: hal never imports conformance at import time

    add_conformance(sub)
    return parser


def _format_warning(message: Any, category: type, filename: str, lineno: int, line: str | None = None) -> str:
    """hal's own warnings (downgrades, migration gaps) as one 'hal: warning:' line; others as usual."""
    if category.__module__.split(".")[0] == "hal":
        return f"hal: warning: {message}\n"
    return _default_format(message, category, filename, lineno, line)


_default_format = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
