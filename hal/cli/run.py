"""``hal run --backend X script.py``: a CUDA-written script, unmodified, on backend X (the migration shim)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hal.errors import HalError

from .common import add_standin_argument

NAME = "run"
MAX_DEVICE_COUNT = 64  # more CUDA devices than any one host has


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        NAME,
        help="run an unmodified CUDA-written script on another backend",
        description="Run SCRIPT with its CUDA calls mapped to the chosen backend; arguments after SCRIPT go to it.",
    )
    p.add_argument("--backend", help="target backend (overrides HAL_BACKEND and the config file)")
    p.add_argument("--config", help="YAML config file (backend, devices, precision, fallback)")
    p.add_argument("--device-count", type=int, metavar="N",
                   help="cpu only: tell the script N CUDA devices exist (all are the one host device), "
                   "for scripts that insist on several")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    add_standin_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hal.config import load_config
    from hal.selection import select_backend

    script = Path(args.script)
    if not script.is_file():
        raise HalError(f"script {args.script!r} not found; give the path of a Python file")
    config = load_config(args.config, overrides={"backend": args.backend})
    selection = select_backend(config)
    _check_device_count(args.device_count, selection.backend.device_type)
    selection.activate()
    from hal.migration import run_script  # after validation: the shim is only loaded to run something
    from hal.migration.runner import COUNT_ENV, launched_device_count

    count, device_count = "", args.device_count
    if selection.backend.device_type == "cpu":
        if device_count is None:  # a rank torchrun started (--no-python hal run): a device a local rank, as hal launch
            device_count = launched_device_count("cpu")
            why = COUNT_ENV if COUNT_ENV in os.environ else "torchrun's LOCAL_WORLD_SIZE: a device a local rank"
            count = (f", torch.cuda.device_count() {device_count} ({why})" if device_count else
                     ", torch.cuda.device_count() 1 (--device-count N for a script that needs N)")
        else:
            count = f", torch.cuda.device_count() {device_count}"
    standin = f" — {selection.backend.standin}" if selection.backend.standin else ""
    print(f"hal run: backend {selection.backend.name} ({selection.reason.split(';')[0]}){standin}, "
          f"devices {list(selection.devices)}{count}, precision {selection.precision.describe()}", file=sys.stderr)
    code = run_script(selection.backend, str(script), list(args.script_args), device_count=device_count)
    from hal.rank.exit import exit_rank

    exit_rank(code)  # the script's process groups torn down before the interpreter's finalization could


def _check_device_count(count: int | None, device_type: str) -> None:
    """--device-count is the cpu target's: checked before anything runs."""
    if count is None:
        return
    if device_type != "cpu":
        raise HalError(f"--device-count is for the cpu target only (its one device shown as N); "
                       f"backend {device_type!r} shows its real devices: drop --device-count")
    if count < 1:
        raise HalError(f"--device-count {count} is not a device count; give 1 or more")
    if count > MAX_DEVICE_COUNT:
        raise HalError(f"--device-count {count} is above {MAX_DEVICE_COUNT}, more GPUs than one host holds; give a smaller count")
