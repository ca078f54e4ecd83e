"""The local rank spawner: N commands, each in its own session, watched together, stopped together.

Why one process group per rank: a rank may start helpers (data loaders, compilers); killing the
group kills them too, and a session of its own keeps the terminal's Ctrl-C away from the ranks so
the launcher alone decides when and how they stop. Exits are detected with ``waitid(WNOWAIT)``,
which leaves every rank a zombie until the very end: its pid, and so its process group id, cannot
be reused by an unrelated process before the final SIGKILL of every group.

Fates are decided by what the launcher saw, not guessed from exit codes: a rank that ended before
the launcher began stopping ended on its own (ok, exit status N, or killed by signal S); a rank
still running when the launcher stopped the job was "stopped by the launcher" (after another
rank failed, or after the launcher got a signal) or "timed out" (the deadline passed).
"""
from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Literal, Mapping, Sequence

from hal.errors import HalError
from hal.launch.guard import guarded
from hal.rank.name import PROCESS_NAME_ENV, rank_name

Fate = Literal["ok", "exit", "signal", "stopped", "timed out"]
Output = Literal["inherit", "devnull", "merge"]  # a rank's stdout: ours, dropped, or into its stderr tail
POLL_S = 0.05
TAIL_LINES = 40
# A rank whose last line says a peer went away failed because of another rank: its report line comes after.
# (hal.collectives names these CollectiveTimeout / CollectivePeerLost; the rest are the CCLs' own words.)
CONSEQUENCE = ("CollectiveTimeout", "CollectivePeerLost", "closed the connection", "collectives were aborted",
               "Connection closed by peer", "Connection reset by peer", "Broken pipe")
# When every failure so far is such a consequence, the rank it lost is usually still ending (writing its traceback,
# tearing down): the launcher waits this long for it to end on its own, so the report names it and not its victim.
CONSEQUENCE_GRACE_S = 3.0


def lost_a_peer(fate: str, code: int | None, last_line: str) -> bool:
    """Whether a failed rank failed because of another: its last line says a peer went away, or it was killed by
    SIGPIPE (it wrote to a connection whose other end had closed)."""
    return (fate == "signal" and code == signal.SIGPIPE) or any(m in last_line for m in CONSEQUENCE)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RankFate:
    """How one rank ended, and the last meaningful line it wrote to stderr."""

    rank: int
    pid: int
    fate: Fate
    code: int | None = None  # exit status ("exit"), signal number ("signal")
    last_line: str = ""

    @property
    def failed_on_its_own(self) -> bool:
        return self.fate in ("exit", "signal")

    @property
    def status(self) -> int:
        """The shell's view: N for exit status N, 128+S for signal S, 0 for ok."""
        if self.fate == "exit":
            return int(self.code or 0)
        if self.fate == "signal":
            return 128 + int(self.code or 0)
        return 0

    def describe(self, cause: str = "") -> str:
        tail = f": {self.last_line}" if self.last_line else ""
        if self.fate == "ok":
            return f"rank {self.rank} ok"
        if self.fate == "exit":
            return f"rank {self.rank} failed (exit status {self.code}){tail}"
        if self.fate == "signal":
            return f"rank {self.rank} failed (killed by {signal_name(int(self.code or 0))}){tail}"
        if self.fate == "stopped":
            return f"rank {self.rank} stopped by the launcher{f' after {cause}' if cause else ''}"
        return f"rank {self.rank} timed out{f' after {cause}' if cause else ''} (killed){tail}"


@dataclass(frozen=True)
class LaunchReport:
    """The one failure report of a run: every rank's fate, in the order the launcher saw them end."""

    fates: tuple[RankFate, ...]
    seconds: float
    deadline_s: float | None = None
    timed_out: bool = False
    interrupted: int | None = None  # the signal the launcher got, if it stopped the ranks for one

    @property
    def ok(self) -> bool:
        return all(f.fate == "ok" for f in self.fates) and not self.interrupted

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(f.pid for f in sorted(self.fates, key=lambda f: f.rank))

    @property
    def causes(self) -> list[RankFate]:
        """Ranks that failed on their own: root causes first, then those that lost a peer; else in order seen."""
        own = [f for f in self.fates if f.failed_on_its_own]
        return sorted(own, key=lambda f: lost_a_peer(f.fate, f.code, f.last_line))

    @property
    def exit_status(self) -> int:
        """Worst status among ranks that failed on their own; 128+S when interrupted; 124 at the deadline."""
        if self.interrupted:
            return 128 + self.interrupted
        if self.causes:
            return max(f.status for f in self.causes)
        return 124 if self.timed_out else 0

    def _why_stopped(self) -> str:
        if self.interrupted:
            return signal_name(self.interrupted)
        first = self.causes[0] if self.causes else None
        return f"rank {first.rank} failed" if first else "another rank failed"

    def entries(self) -> list[tuple[RankFate, str]]:
        """Each rank that did not end ok with its report line: causes first, then the ranks stopped or timed out."""
        out = []
        for f in [*self.causes, *(f for f in self.fates if not f.failed_on_its_own and f.fate != "ok")]:
            if f.fate == "stopped":
                out.append((f, f.describe(self._why_stopped())))
            elif f.fate == "timed out":
                out.append((f, f.describe(f"{self.deadline_s:g} s")))
            else:
                out.append((f, f.describe()))
        return out

    def lines(self) -> list[str]:
        """One line per rank that did not end ok (see ``entries``)."""
        return [line for _, line in self.entries()]

    def summary(self) -> str:
        """The report as one line (for an exception message)."""
        return "; ".join(self.lines()) or "every rank ok"


class LaunchFailed(HalError):
    """A rank failed, the deadline passed or the launcher was signalled; every rank was stopped and reaped."""

    def __init__(self, message: str, report: LaunchReport) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[Any, tuple[str, LaunchReport]]:  # pickled whole (a launcher run in another process)
        return (type(self), (str(self), self.report))

    @property
    def pids(self) -> tuple[int, ...]:
        return self.report.pids


WARNING_LINE = re.compile(r"\b\w*Warning: |\bwarning: ")
"""A warning as a rank writes it: Python's ``file:line: XWarning: text`` or hal's ``hal ...: warning: text``."""


class _Echo:
    """Where the ranks' stderr lines go, shared by their readers: one lock, and the warnings already shown. Every rank
    of a run tends to warn the same (a downgrade, a deprecation), so a warning another rank already showed is not
    shown again — with the indented source line Python prints under it; any other line is always shown."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.warned: dict[str, int] = {}  # a warning shown -> the reader (rank) that showed it

    def line(self, line: str, reader: int, quiet_context: bool) -> bool:
        """Show ``line`` from ``reader`` unless another reader showed the same warning (or it is the source line under
        such a warning); whether it was left out as such (so the reader's next line, its source context, goes too).
        One rank repeating its own warning is shown each time: that may be news (a step that skipped again)."""
        if self.stream is None:
            return False
        text = line.rstrip("\n")
        with self.lock:
            if quiet_context and text.startswith((" ", "\t")):
                return False
            if WARNING_LINE.search(text):
                if self.warned.setdefault(text, reader) != reader:
                    return True
            self.stream.write(line)
            self.stream.flush()
        return False


class _Tail:
    """Reads one rank's stderr pipe: echoes each line (optionally) and keeps the last ones."""

    def __init__(self, pipe: IO[bytes], echo: _Echo) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.closed_at: float | None = None  # when the pipe closed: the rank's exit, seen closer than a poll sees it
        self._thread = threading.Thread(target=self._pump, args=(pipe, echo), daemon=True)
        self._thread.start()

    def _pump(self, pipe: IO[bytes], echo: _Echo) -> None:
        repeated = False
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self.lines.append(line.rstrip("\n"))
            repeated = echo.line(line, id(self), repeated)
        self.closed_at = time.monotonic()
        pipe.close()

    def join(self, timeout_s: float = 2.0) -> None:
        """Until the pipe closes (every writer gone), or ``timeout_s`` (a helper escaped the group)."""
        self._thread.join(timeout=timeout_s)

    def last_line(self) -> str:
        """The last meaningful line (a traceback's last line is the exception); warnings are skipped."""
        kept = [s.strip() for s in self.lines if s.strip() and "warn" not in s.lower()]
        return kept[-1][:400] if kept else ""


class _Signals:
    """While ranks run, SIGINT/SIGTERM/SIGHUP to the launcher only note which came (main thread only)."""

    WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, enabled: bool) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._enabled = enabled and threading.current_thread() is threading.main_thread()

    def _note(self, signum: int, _frame: object) -> None:
        self.received = self.received or signum

    def __enter__(self) -> _Signals:
        if self._enabled:
            for sig in self.WATCHED:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _zygote(modules: Sequence[str], commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
            cwd: str | None) -> Any:
    """A started zygote when ``modules`` are asked for and every command can be forked from it; else None."""
    from . import zygote

    if not modules or not zygote.available() or any(zygote.module_command(c) is None for c in commands):
        return None
    try:
        mains = [zygote.module_command(c)[0] for c in commands]  # type: ignore[index]
        preload = list(dict.fromkeys([*modules, *mains]))  # the ranks' own modules too, each once
        return zygote.Zygote(preload, envs[0], cwd, shown=[mains[0], *zygote.module_command(commands[0])[1]])  # type: ignore[index]
    except OSError as exc:
        sys.stderr.write(f"hal: warning: every rank starts as a fresh interpreter ({exc}); set {zygote.DISABLE_ENV}=exec "
                         "to make that the default\n")
        return None


def _forked(zygote: Any, command: Sequence[str], env: Mapping[str, str], cwd: str | None,
            stdout: Output) -> tuple[Any, IO[bytes]]:
    """One rank forked by ``zygote``: (its process, the read end of its stderr pipe)."""
    from .zygote import module_command

    module, args = module_command(command)  # type: ignore[misc]
    read_end, write_end = os.pipe()
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        out = {"inherit": 1, "devnull": devnull, "merge": write_end}[stdout]
        proc = zygote.spawn(module, args, env, cwd, (devnull, out, write_end))
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
        os.close(devnull)
    return proc, os.fdopen(read_end, "rb")


def _exited(proc: subprocess.Popen[bytes]) -> tuple[Fate, int] | None:
    """How the rank ended, without reaping it where the OS allows (the zombie keeps its group id reserved)."""
    if not hasattr(os, "waitid"):  # no waitid (older macOS Pythons): poll reaps; the final group kill may then miss
        code = proc.poll()
        return None if code is None else ("ok", 0) if code == 0 else ("exit", code) if code > 0 else ("signal", -code)
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return ("ok", 0) if info.si_status == 0 else ("exit", info.si_status)
    return "signal", info.si_status


def _signal_groups(procs: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class _Watch:
    """The ranks' processes and what the launcher has seen of them so far."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tails: list[_Tail] = field(default_factory=list)
    seen: dict[int, tuple[Fate, int]] = field(default_factory=dict)  # rank -> fate, in the order seen
    seen_at: dict[int, float] = field(default_factory=dict)
    stopping: Fate | None = None  # once set ("stopped" / "timed out"), a rank that ends badly ended by our hand

    def poll(self) -> None:
        for rank, p in enumerate(self.procs):
            if rank not in self.seen:
                how = _exited(p)
                if how is not None:
                    self.seen[rank] = how if how[0] == "ok" or self.stopping is None else (self.stopping, 0)
                    self.seen_at[rank] = time.monotonic()

    def _ended_at(self, rank: int) -> float:
        """Ranks seen in one poll are ordered by when their pipe closed (a crash before its peers' consequences)."""
        closed = self.tails[rank].closed_at if rank < len(self.tails) else None
        return min(self.seen_at[rank], closed) if closed is not None else self.seen_at[rank]

    def failed(self) -> bool:
        return any(fate != "ok" for fate, _ in self.seen.values())

    def waiting_for_a_cause(self, now: float) -> bool:
        """Every rank that failed so far lost a peer (its last line says so), within ``CONSEQUENCE_GRACE_S`` of the
        first: the rank that caused it may yet end on its own."""
        failed = [r for r, (fate, _) in self.seen.items() if fate != "ok"]
        if not failed or now - min(self.seen_at[r] for r in failed) > CONSEQUENCE_GRACE_S:
            return False
        # a rank whose stderr is not read to its end yet may still show it lost a peer: waited for too
        return all(r < len(self.tails) and (self.tails[r].closed_at is None
                                            or lost_a_peer(*self.seen[r], self.tails[r].last_line())) for r in failed)

    def running(self) -> list[int]:
        return [r for r in range(len(self.procs)) if r not in self.seen]

    def fates(self) -> tuple[RankFate, ...]:
        ranks = [*sorted(self.seen, key=self._ended_at), *self.running()]
        out = []
        for rank in ranks:
            fate, code = self.seen.get(rank, (self.stopping or "stopped", 0))
            last = self.tails[rank].last_line() if fate != "ok" and rank < len(self.tails) else ""
            out.append(RankFate(rank, self.procs[rank].pid, fate, code if fate in ("exit", "signal") else None, last))
        return tuple(out)


def spawn_ranks(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    deadline_s: float | None = None,
    term_grace_s: float = 5.0,
    stdout: Output = "inherit",
    echo_stderr: IO[str] | None = None,
    cwd: str | None = None,
    handle_signals: bool = True,
    fork_from: Sequence[str] = (),
    started: Callable[[list[int]], None] | None = None,
) -> LaunchReport:
    """Run ``commands[r]`` with environment ``envs[r]`` (complete, not merged) for every rank r; wait for all.

    On the first rank that fails (one that only lost a peer: up to ``CONSEQUENCE_GRACE_S`` later, while the peer
    may end on its own), at ``deadline_s`` (whole run) or on SIGINT/SIGTERM/SIGHUP to this
    process, every running rank's process group gets SIGTERM, then SIGKILL after ``term_grace_s``.
    Every group gets a final SIGKILL (leftover helpers) and every rank is reaped before this
    returns, also when it raises. ``echo_stderr``: where the ranks' stderr lines are echoed as they
    come, a warning that another rank already showed left out (None: only the tails are kept for the report). ``fork_from``: modules to
    import once (with the
    commands' own) in a zygote (``hal.launch.zygote``) that forks every rank, where each command is ``python -m MODULE ...`` and the host
    allows it; otherwise, or if the zygote cannot start (said on stderr), every rank is a fresh interpreter.
    Every rank is named ``hal-rank-R`` (``HAL_PROCESS_NAME``, R its ``RANK``; what ``ps`` and ``top`` show) unless its
    environment names it; ``started``: called with the ranks' pids, in rank order, once every rank has started.
    """
    if len(commands) != len(envs) or not commands:
        raise ValueError(f"{len(commands)} command(s) for {len(envs)} environment(s); give one of each per rank (1 or more)")
    envs = [{**env, PROCESS_NAME_ENV: env.get(PROCESS_NAME_ENV) or rank_name(int(env.get("RANK", i)))}
            for i, env in enumerate(envs)]
    began = time.monotonic()
    echo = _Echo(echo_stderr)
    watch = _Watch()
    stop_at = 0.0
    out = {"inherit": None, "devnull": subprocess.DEVNULL, "merge": subprocess.PIPE}[stdout]
    zygote = _zygote(fork_from, commands, envs, cwd)
    with _Signals(handle_signals) as signals:
        try:
            for command, env in zip(commands, envs):
                if zygote is not None:
                    p, pipe = _forked(zygote, command, env, cwd, stdout)
                else:
                    p = subprocess.Popen(
                        guarded(command), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                        stderr=subprocess.STDOUT if stdout == "merge" else subprocess.PIPE, start_new_session=True,
                    )
                    pipe = p.stdout if stdout == "merge" else p.stderr
                watch.procs.append(p)  # type: ignore[arg-type]
                assert pipe is not None
                watch.tails.append(_Tail(pipe, echo))
            if zygote is not None:
                zygote.close()  # every rank is forked (and ours): the zygote's work is done
                zygote = None
            if started is not None:
                started([p.pid for p in watch.procs])
            while True:
                watch.poll()
                if not watch.running():
                    break
                now = time.monotonic()
                if watch.stopping is None:
                    late = deadline_s is not None and now - began > deadline_s
                    if late or signals.received or (watch.failed() and not watch.waiting_for_a_cause(now)):
                        watch.stopping = "timed out" if late and not watch.failed() and not signals.received else "stopped"
                        stop_at = now
                        _signal_groups([watch.procs[r] for r in watch.running()], signal.SIGTERM)
                elif now - stop_at > term_grace_s:
                    _signal_groups([watch.procs[r] for r in watch.running()], signal.SIGKILL)
                time.sleep(POLL_S)
        except BaseException:
            watch.stopping = watch.stopping or "stopped"
            raise
        finally:
            if zygote is not None:
                zygote.close()
            _signal_groups(watch.procs, signal.SIGKILL)  # helpers left in any group; ranks not seen to end
            for p in watch.procs:
                p.wait()
            for tail in watch.tails:
                tail.join()
    return LaunchReport(
        watch.fates(), time.monotonic() - began, deadline_s, watch.stopping == "timed out", signals.received,
    )
