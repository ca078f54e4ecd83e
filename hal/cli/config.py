"""``hal config``: check a config and show what it resolves to — backend (and why), devices, precision."""
from __future__ import annotations

import argparse
import json
from typing import Any

from .common import add_config_argument, config_path

NAME = "config"
RUN_SECTIONS = ("model", "parallel", "train")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(NAME, help="check a config and show what it resolves to (backend, devices, precision)")
    add_config_argument(p, "YAML config file")
    p.add_argument("--backend", help="override the backend")
    p.add_argument("--precision", help="override the precision mode")
    p.add_argument("--fallback", help="override the fallback policy (error, warn, allow)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.config import load_config
    from hal.selection import select_backend

    path = config_path(args)
    config = load_config(path, overrides={"backend": args.backend, "precision": args.precision, "fallback": args.fallback})
    run_sections = _check_run_sections(path, config)
    selection = select_backend(config)
    report = {
        "config": config.to_dict(),
        "backend": selection.backend.name,
        "reason": selection.reason,
        "devices": list(selection.devices),
        "precision": selection.precision.describe(),
        "downgrades": [d.to_dict() for d in selection.precision.downgrades],
        "run_sections_checked": run_sections,
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
    if run_sections:
        print(f"-> {', '.join(run_sections)}: checked (hal plan --config F shows the stages and every rank)")
    return 0


def _check_run_sections(path: str | None, config: Any) -> list[str]:
    """A file with model:/parallel:/train: gets them checked too, as hal plan and hal train would (one line each
    problem); a file of hal keys alone has none to check."""
    present = [name for name in RUN_SECTIONS if getattr(config, name, None) is not None]
    if path is None or not present:
        return []
    from hal.parallel.loop.preflight import CONFIG, Request, preflight

    preflight(Request(path, local=False, writes=False), CONFIG)  # the one door: hal plan's and hal train's checks
    return present
