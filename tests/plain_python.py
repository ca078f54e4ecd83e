"""A fork server for plain ``python SCRIPT ARGS`` and ``python -m MODULE ARGS`` runs (the migration corpus's runs).

Why: a corpus run spends about 4.5 s of its 5 importing torch and ``torch._dynamo`` (an optimizer's first
parameter group imports it); the corpus starts 60-odd such processes on two cores. This server imports those two
once and forks each run from itself. It imports nothing of hal, so a script's plain-CPU twin still runs with no
hal anywhere; ``python -m hal run ...`` runs as a module here and imports hal in its own child.

Each run is still a process of its own: its own session (``os.setsid``: the caller stops it with ``killpg``),
environment, working directory, ``sys.argv``, ``sys.path[0]``, stdout and stderr (files) and exit status. The
server runs no torch op, so no thread pool exists to be forked; a child applies ``OMP_NUM_THREADS`` from its own
environment, as a fresh interpreter's torch would.

Protocol (one JSON object a line on stdin): ``{"argv": [...], "env": {...}, "cwd": ..., "out": F, "err": F,
"status": F}``; ``argv`` is ``[SCRIPT, ...]`` or ``["-m", MODULE, ...]``. The server writes the child's pid to
``F.pid`` when forked and its exit status (as ``subprocess`` reports it: negative for a signal) to ``F`` when
reaped, each by an atomic rename. It exits when stdin closes, after reaping every child.
"""
from __future__ import annotations

import json
import os
import select
import sys
from typing import Callable, NoReturn

import torch  # noqa: F401  (the import this server exists to do once)
import torch._dynamo  # noqa: F401


def _write(path: str, text: str) -> None:
    with open(path + ".part", "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(path + ".part", path)


def _child(request: dict) -> None:
    """Become the run: session, environment, streams, argv; run it as the interpreter would; exit."""
    import io

    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for path, fd in ((request["out"], 1), (request["err"], 2)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    exit_like_the_interpreter(lambda: _run(request["argv"]))


def _run(argv: list[str]) -> None:
    """Run ``argv`` as ``python ARGV`` would (a script, ``-m MODULE`` or ``-c CODE``)."""
    import runpy

    for entry in reversed([e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:  # this run's PYTHONPATH (the server's own is on sys.path already)
            sys.path.insert(1, entry)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        import builtins
        import types

        main = types.ModuleType("__main__")  # a fresh __main__, as the interpreter gives -c code
        main.__builtins__ = builtins  # type: ignore[attr-defined]
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), vars(main))
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def exit_like_the_interpreter(body: Callable[[], object]) -> NoReturn:
    """Run ``body`` and leave as the interpreter leaves a program: SystemExit's code (a non-int printed, status
    1), an uncaught exception's traceback and status 1, the atexit handlers (a forked child never reaches them),
    flushed streams; then ``os._exit``. Shared with ``tests/hal_child.py``."""
    import atexit
    import traceback

    code: object
    try:
        code = body()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # what the interpreter does with an uncaught exception: the traceback, status 1
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def serve() -> None:
    children: dict[int, str] = {}  # pid -> its status file
    buffer = b""
    open_input = True
    while open_input or children:
        if open_input:
            ready, _, _ = select.select([0], [], [], 0.05)
            if ready:
                chunk = os.read(0, 1 << 16)
                open_input = bool(chunk)
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        _child(request)
                    children[pid] = request["status"]
                    _write(request["status"] + ".pid", str(pid))
        else:
            select.select([], [], [], 0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            if pid in children:
                _write(children.pop(pid), str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    serve()
