"""The client of ``tests/plain_python.py``'s fork server: plain ``python ...`` runs forked from a process that
imported torch once (and nothing of hal), each with its own environment, working directory, streams and status."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


class PlainServer:
    """A fork server (``tests/plain_python.py``): torch imported once, each run forked from it; started at its first
    run (it imports no hal, so a plain run stays plain)."""

    def __init__(self, env: Callable[[], dict[str, str]]) -> None:
        self._env = env  # the server's environment (its sys.path comes from PYTHONPATH there)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def start(self, argv: list[str], cwd: Path, scratch: Path, env: dict[str, str] | None = None) -> ForkedRun:
        with self._lock:
            if self._proc is None:
                self._proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "plain_python.py")],
                                              stdin=subprocess.PIPE, env=self._env(), cwd=REPO)
            request = {"argv": argv, "env": env if env is not None else self._env(), "cwd": str(cwd), "out": str(scratch / "out"),
                       "err": str(scratch / "err"), "status": str(scratch / "status")}
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        return ForkedRun(scratch)

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.stdin is not None:
                self._proc.stdin.close()
                self._proc.wait(300)
                self._proc = None


class ForkedRun:
    """A run the server forked: wait for its status file; stop its session when it outlives the deadline."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def _read(self, name: str) -> str | None:
        path = self.scratch / name
        return path.read_text(encoding="utf-8", errors="backslashreplace") if path.exists() else None

    def communicate(self, deadline: float) -> tuple[int, str, str, bool]:
        """(exit status, stdout, stderr, killed)."""
        killed = False
        while (status := self._read("status")) is None:
            if time.monotonic() > deadline and not killed:
                pid = None
                while pid is None:
                    pid = self._read("status.pid")
                    time.sleep(0.02)
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(int(pid), sig)
                    except ProcessLookupError:
                        break
                    time.sleep(2)
                killed = True
            time.sleep(0.02)
        return int(status), self._read("out") or "", self._read("err") or "", killed




_SHARED: PlainServer | None = None


def shared() -> PlainServer:
    """The session's one plain server (PYTHONPATH: the repository): every test module's plain runs fork from it."""
    global _SHARED
    if _SHARED is None:
        _SHARED = PlainServer(lambda: {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return _SHARED


def run_plain(server: PlainServer, argv: list[str], env: dict[str, str], cwd: Path, timeout: float
              ) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` (``argv`` without the interpreter: a script, ``-m MODULE`` or ``-c CODE``) forked from
    ``server``: what ``subprocess.run(..., capture_output=True, text=True)`` returns; killed past ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="plain-") as tmp:
        code, out, err, killed = server.start(argv, cwd, Path(tmp), env).communicate(time.monotonic() + timeout)
    if killed:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out, err)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out, err)
