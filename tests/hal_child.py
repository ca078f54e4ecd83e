"""One ``hal`` command in a child of a process that imported torch and hal once (the tests' fork server).

Why: ``python -m hal ...`` spends seconds of CPU starting an interpreter and importing torch before the
command runs; a test suite runs the command hundreds of times. Each call here is still a process of its
own — its own environment, working directory, stdout, stderr and exit status, ranks it starts included —
but forked from a server that did the imports once (torch, torch._dynamo, hal) (``multiprocessing``'s forkserver, which runs no torch
op, so no thread pool is forked). ``tests/conftest.py``'s ``run_hal`` uses it unless the call changes how
an interpreter starts (``PYTHON*`` variables) or ``HAL_TEST_FORK=0`` asks for a fresh interpreter every time.
"""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import torch  # noqa: F401  (the import this module exists to do once)
import torch._dynamo  # noqa: F401  (an optimizer's first param group imports it: 1.6 s of CPU in every child otherwise)

import hal
from hal.cli import main
from tests.plain_python import exit_like_the_interpreter

MAIN = str(Path(hal.__file__).with_name("__main__.py"))  # what ``python -m hal`` puts in sys.argv[0]


def run_command(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """Run ``hal ARGV`` as ``python -m hal`` would, its streams into the files ``out`` and ``err``; exit with its status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    sys.argv = [MAIN, *argv]
    exit_like_the_interpreter(lambda: main(argv))
