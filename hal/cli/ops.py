"""``hal ops``: operator coverage — op × dtype → the implementation the registry dispatches to."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .common import add_standin_argument

NAME = "ops"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(NAME, help="operator coverage: op × dtype → implementation")
    p.add_argument("--backend", help="backend to show (default: the configured or auto-selected one)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_standin_argument(p)
    p.set_defaults(func=run)


def ops_report(backend_name: str) -> dict[str, Any]:
    """Coverage: op × dtype → implementation the registry picks on ``backend_name`` (no policy applied)."""
    from hal.ops import STANDARD_DTYPES, registry

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
    problems = [p.__dict__ for p in registry.load_problems()]
    return {"backend": backend_name, "ops": table, "load_problems": problems,
            "other_backends": _other_backends(registry, backend_name)}


def _other_backends(registry: Any, backend_name: str) -> list[dict[str, Any]]:
    """Implementations registered for other backends only (why a kernel is not used here at all)."""
    found: dict[str, dict[str, Any]] = {}
    for op in registry.names():
        for impl in registry.implementations(op):
            if impl.backends is None or backend_name in impl.backends:
                continue
            entry = found.setdefault(impl.name, {"impl": impl.name, "backends": sorted(impl.backends), "ops": []})
            entry["ops"].append(op)
    return list(found.values())


def _print_ops(report: dict[str, Any]) -> None:
    dtypes = list(next(iter(report["ops"].values())))
    width = max(len(op) for op in report["ops"]) + 2
    col = max(14, *(len(c["impl"]) + 2 for row in report["ops"].values() for c in row.values()))
    print(f"ops on backend '{report['backend']}' (op × dtype → implementation; * = fallback, see below)")
    print("op".ljust(width) + "".join(d.ljust(col) for d in dtypes))
    notes: dict[str, str] = {}
    for op, row in report["ops"].items():
        cells = []
        for cell in row.values():
            mark = "*" if cell["fallback_from"] else ""
            cells.append((cell["impl"] + mark).ljust(col))
            for skipped in cell["fallback_from"]:
                notes[f"{op}: {skipped['impl']}"] = skipped["reason"]
        print(op.ljust(width) + "".join(cells))
    for what, why in notes.items():
        print(f"* {what} not used: {why}")
    for other in report["other_backends"]:
        print(f"not for {report['backend']}: {other['impl']} serves {', '.join(other['backends'])} only "
              f"({', '.join(other['ops'])})")
    for p in report["load_problems"]:  # last: a broken plug-in adds lines below the usual report
        print(f"kernel module {p['name']}: {p['reason']} [{p['origin']}]")


def run(args: argparse.Namespace) -> int:
    from hal.backend_registry import get_backend
    from hal.config import load_config
    from hal.selection import choose_backend

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
