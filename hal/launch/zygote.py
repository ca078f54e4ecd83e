"""Local ranks forked from one interpreter that imported their program once (``python -m hal.launch.zygote``).

Why: a rank of ``hal train`` spends about 4 s of CPU importing torch (and ``torch._dynamo``, which an optimizer's
first parameter group pulls in) before it does anything; four ranks on a 2-core host pay that four times over,
one after the other. A zygote pays it once and forks each rank from there — the ranks are still processes of
their own, each with its environment, working directory, stdio, session (process group) and exit status.

Why they stay the launcher's children (``spawn_ranks`` watches, signals and reaps its ranks as its own): the
launcher marks itself a child subreaper; the zygote forks a short-lived middle process that forks the rank and
exits, so the rank is re-parented to the launcher. The rank then arms its parent-death signal (as
``hal.launch.guard`` does) against the launcher, never against the zygote.

What may be forked: the zygote only imports modules — it runs no torch op (no thread pool exists to be
forked) and touches no device. ``spawn_ranks`` uses it for CPU-only jobs on Linux; an accelerator runtime is
never forked. A rank reads ``OMP_NUM_THREADS`` from its own environment (the zygote's torch read it before).
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Mapping, NoReturn, Sequence

from hal.launch.guard import guarded
from hal.rank.name import take_name

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
DISABLE_ENV = "HAL_RANK_START"  # "exec": every rank a fresh interpreter (no zygote)
MAX_MESSAGE = 1 << 20


def _prctl(option: int, value: int) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def available() -> bool:
    """Linux (a subreaper and a parent-death signal exist) and not switched off by ``HAL_RANK_START=exec``."""
    return sys.platform.startswith("linux") and os.environ.get(DISABLE_ENV, "") != "exec" and hasattr(socket, "send_fds")


def module_command(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """``(module, args)`` for ``[this python, [-u,] -m, module, args...]``; None for any other command. (``-u`` asks
    for unbuffered output; a forked rank's stdout and stderr are line-buffered, so its lines arrive as written.)"""
    rest = list(command[1:])
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if command[:1] == [sys.executable] and len(rest) >= 2 and rest[0] == "-m":
        return rest[1], rest[2:]
    return None


class ForkedRank:
    """A rank the zygote forked, re-parented to this process: the little of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Zygote:
    """The launcher's side: start the zygote (it imports ``preload``), then ask it for ranks."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], cwd: str | None = None, ready_s: float = 120,
                 shown: Sequence[str] = ()) -> None:
        """``shown``: arguments put on the zygote's command line after ``--``, and so on every forked rank's
        (``ps`` shows a forked process with its parent's command line): what the ranks run."""
        if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
            raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        if can_fork_here(preload):
            self.proc: Any = _ForkedZygote(theirs, ours, preload, env, cwd)
        else:
            self.proc = subprocess.Popen(
                guarded([sys.executable, "-m", "hal.launch.zygote", str(theirs.fileno()), *preload, "--", *shown]),
                pass_fds=[theirs.fileno()], env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(ready_s)
        try:
            ready = self._read()
        except (OSError, ValueError) as exc:
            self.close()
            raise OSError(f"the rank zygote did not start: {exc}") from None
        if ready.get("error"):
            self.close()
            raise OSError(f"the rank zygote could not import {', '.join(preload)}: {ready['error']}")
        self.sock.settimeout(30)

    def _read(self) -> dict:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(4096)
            if not chunk:
                err = self.proc.stderr.read().decode("utf-8", "replace").strip().splitlines() if self.proc.poll() is not None else []
                raise ValueError(err[-1] if err else "it closed its socket")
            data += chunk
        return json.loads(data)

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: str | None,
              stdio: tuple[int, int, int]) -> ForkedRank:
        """Fork one rank running ``python -m module args`` with ``env`` and ``stdio`` (stdin, stdout, stderr fds)."""
        message = json.dumps({"module": module, "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
                              "launcher": os.getpid()}).encode() + b"\n"
        socket.send_fds(self.sock, [message], list(stdio))
        reply = self._read()
        if "pid" not in reply:
            raise OSError(f"the rank zygote could not fork a rank: {reply.get('error', reply)}")
        return ForkedRank(int(reply["pid"]))

    def close(self) -> None:
        """Stop the zygote (its ranks live on: they are ours) and reap it."""
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()


def can_fork_here(preload: Sequence[str]) -> bool:
    """Whether the zygote can be this process itself, forked: it already imported the heavy part of ``preload``
    (torch, and torch._dynamo where asked for) and is one thread only (``/proc/self/task``: no OpenMP pool, no
    Python or native thread whose locks a fork could copy held). Then the zygote costs a fork, not a fresh
    interpreter importing torch again (~4 s of CPU); otherwise, or with ``HAL_ZYGOTE=exec``, it is started fresh."""
    if os.environ.get("HAL_ZYGOTE", "") == "exec":
        return False
    heavy = [m for m in preload if m.split(".")[0] == "torch"]
    if not heavy or any(m not in sys.modules for m in heavy):
        return False
    if sys.modules["torch"]._C._get_privateuse1_backend_name() != "privateuseone":
        return False  # this process holds a device runtime (a plug-in's, a stand-in's): never forked
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _forget_the_launcher(keep: int) -> None:
    """In a zygote forked from the launcher: drop what is the launcher's, not a rank's — its other file descriptors
    (a pipe end held by a rank would keep its reader from seeing EOF), its atexit handlers (a rank would run them)
    and the warnings it has shown (a rank shows its own, once each, as a fresh interpreter would)."""
    import warnings

    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    atexit._clear()
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()
    warnings._filters_mutated()  # type: ignore[attr-defined]


class _ForkedZygote(ForkedRank):
    """The zygote as a fork of the launcher: the little of ``subprocess.Popen`` ``Zygote`` uses (pid, stderr)."""

    def __init__(self, theirs: socket.socket, ours: socket.socket, preload: Sequence[str], env: Mapping[str, str],
                 cwd: str | None) -> None:
        read_err, write_err = os.pipe()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # the zygote: its own session, no stdin/stdout, stderr to the pipe, dies with the launcher
            code = 1
            try:
                os.close(read_err)
                ours.close()
                os.setsid()
                _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
                if os.getppid() != launcher:
                    os._exit(1)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                null = os.open(os.devnull, os.O_RDWR)
                for target, fd in ((0, null), (1, null), (2, write_err)):
                    os.dup2(fd, target)
                os.close(null)
                os.close(write_err)
                _forget_the_launcher(theirs.fileno())
                os.environ.clear()
                os.environ.update(env)
                if cwd:
                    os.chdir(cwd)
                serve(theirs, preload)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write_err)
        super().__init__(pid)
        self.stderr = os.fdopen(read_err, "rb")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the zygote's side --------------------------------------------------------------------------------------------


def _send(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _become_rank(request: dict, fds: list[int], sock: socket.socket) -> NoReturn:
    """In the grandchild: wait to be the launcher's, arm the parent-death signal, take stdio, run the module."""
    code = 1
    try:
        sock.close()
        os.setsid()
        launcher = int(request["launcher"])
        deadline = time.monotonic() + 10
        while os.getppid() != launcher:  # the middle process is exiting: we are re-parented to the subreaper
            if time.monotonic() > deadline:
                os._exit(125)
            time.sleep(0.001)
        if not _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) or os.getppid() != launcher:
            os._exit(128 + int(signal.SIGKILL))  # the launcher is gone already
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        take_name()  # the rank's own name (hal-rank-N), not the zygote's, in ps and top
        os.chdir(request["cwd"])
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
            sys.modules["torch"].set_num_threads(int(threads))  # torch read the zygote's value at import
        sys.argv = [request["module"], *request["args"]]
        # As ``python -m``: the module runs as __main__ only (the zygote's warm-up may have imported it; runpy would
        # warn once a rank that it was already there).
        sys.modules.pop(request["module"], None)
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # what an interpreter runs at exit (this forked process never reaches it)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket, preload: Sequence[str]) -> None:
    """Import ``preload``, say ready, then fork one rank per request until the launcher closes the socket."""
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:  # the launcher falls back to fresh interpreters and says why
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return
    _send(sock, {"ready": True})
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            return
        if not message:
            return
        request = json.loads(message)
        read_pid, write_pid = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read_pid)
            rank = os.fork()
            if rank == 0:
                os.close(write_pid)
                _become_rank(request, fds, sock)
            os.write(write_pid, str(rank).encode())
            os._exit(0)
        os.close(write_pid)
        os.waitpid(middle, 0)
        pid = os.read(read_pid, 32).decode()
        os.close(read_pid)
        for fd in set(fds):
            os.close(fd)
        _send(sock, {"pid": int(pid)} if pid.isdigit() else {"error": "the middle process died"})


def main(argv: Sequence[str]) -> None:
    """``FD MODULE... [-- SHOWN...]``: serve on socket FD after importing the modules (SHOWN is for ``ps`` only)."""
    sock = socket.socket(fileno=int(argv[0]))
    rest = list(argv[1:])
    serve(sock, rest[:rest.index("--")] if "--" in rest else rest)


if __name__ == "__main__":
    main(sys.argv[1:])
