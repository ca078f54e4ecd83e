"""What every sub-command shares: the one-line argparse error and the exit status for user errors."""
from __future__ import annotations

import argparse
from typing import NoReturn

from hal.errors import HalError

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise HalError(f"{self.prog}: {message} (see '{self.prog} --help')")


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
