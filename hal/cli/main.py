"""``hal``: wires the sub-command modules together and turns every HalError into one line and exit 2.

Every user error is one line on stderr and exit status 2 — argparse's usage dump included — so
scripts and people get the same short, fixable message and never a traceback.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Sequence

from hal.errors import HalError

from . import bench, conformance, data, devices, export, launch, ops, plan, profile, run, train
from . import config as config_cmd
from .common import EXIT_USAGE, Parser, apply_standin

COMMANDS = (devices, config_cmd, ops, run, launch, bench, profile, plan, train, export, conformance, data)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hal", description="hetero-hal: one PyTorch code base on every vendor's accelerator.")
    names = ",".join(module.NAME for module in COMMANDS)
    sub = parser.add_subparsers(dest="command", metavar=f"{{{names}}}", parser_class=Parser)
    sub.required = True
    for module in COMMANDS:
        module.add_parser(sub)
    _remember_parsers(parser)
    return parser


def _remember_parsers(parser: argparse.ArgumentParser) -> None:
    """Each leaf sub-command records its own parser, so leftovers are reported against its flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(parser=child)
                _remember_parsers(child)


def _format_warning(message: Any, category: type, filename: str, lineno: int, line: str | None = None) -> str:
    """hal's own warnings (downgrades, migration gaps) as one 'hal: warning:' line; others as usual."""
    if category.__module__.split(".")[0] == "hal":
        where = f"{filename}:{lineno}: " if getattr(category, "names_script_line", False) else ""
        return f"hal: warning: {where}{message}\n"
    return _default_format(message, category, filename, lineno, line)


_default_format = warnings.formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            getattr(args, "parser", parser).unrecognized(extras)
        apply_standin(args)
        return int(args.func(args) or 0)
    except HalError as exc:
        print(f"hal: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("hal: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hal plan F | head`: the reader left; no traceback, no second error at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
