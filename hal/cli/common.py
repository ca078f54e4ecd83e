"""What every sub-command shares: the one-line argparse error and the exit status for user errors."""
from __future__ import annotations

import argparse
import difflib
import re
from typing import Any, NoReturn, Sequence

from hal.errors import HalError

EXIT_USAGE = 2


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """'; did you mean 'x'?' for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line (naming the sub-command's help) and exit 2."""

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        if choice and choice.group(1).startswith("{"):  # a mistyped sub-command name
            names = choice.group(1).strip("{}").split(",")
            message = f"unknown command {choice.group(2)!r}{did_you_mean(choice.group(2), names)} (choose from {', '.join(names)})"
        missing = re.match(r"the following arguments are required: \{([^}]*)\}$", message)
        if missing:  # no sub-command at all
            message = f"give a command: {', '.join(missing.group(1).split(','))}"
        raise HalError(f"{message} (see '{self.prog} --help')")

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Leftover arguments, reported by the sub-command they were given to, with the closest flag."""
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        first = extras[0].split("=", 1)[0]
        hint = did_you_mean(first, options) if first.startswith("-") else ""
        what = "argument" if len(extras) == 1 else "arguments"
        self.error(f"unrecognized {what}: {' '.join(extras)}{hint}")


def add_standin_argument(parser: argparse.ArgumentParser) -> None:
    """``--standin VENDOR[,VENDOR]``: the vendors' host-backed stand-in runtimes (``hal.standin``)."""
    parser.add_argument("--standin", metavar="VENDOR[,VENDOR]",
                        help="run ascend / cambricon on host-backed stand-ins of torch_npu / torch_mlu (not hardware: "
                             "a dry run before the real cluster; sets HAL_STANDIN for every process started)")


def apply_standin(args: argparse.Namespace) -> None:
    """``--standin`` as ``HAL_STANDIN`` in this process's environment, so its ranks and scripts inherit it."""
    import os

    from hal.standin import STANDIN_ENV, flag_value

    value = getattr(args, "standin", None)
    if value:
        os.environ[STANDIN_ENV] = flag_value(value)


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def add_config_argument(parser: argparse.ArgumentParser, help: str, *, required: bool = False) -> None:
    """CONFIG as the first argument (as ``hal train F``) or as ``--config F``: both work, one is enough."""
    parser.add_argument("config_file", nargs="?", metavar="CONFIG", help=f"{help} (or --config CONFIG)")
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.set_defaults(config_required=required)


def config_path(args: argparse.Namespace) -> str | None:
    """The config named either way; one line when both name different files, or none where one is required."""
    if args.config and args.config_file and args.config != args.config_file:
        raise HalError(f"two configs given ({args.config_file} and --config {args.config}); give one")
    path: str | None = args.config or args.config_file
    if path is None and args.config_required:
        raise HalError("give a config file: the YAML with model:, parallel: and train: sections")
    return path


def print_result(summary: str, doc: dict[str, Any], as_json: bool) -> None:
    """The human summary on stdout, or with ``--json`` the document on stdout and the summary on stderr."""
    import json
    import sys

    if as_json:
        sys.stderr.write(summary)
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        sys.stdout.write(summary)
