"""``python -m hal.launch.guard PARENT -- COMMAND...``: become COMMAND, armed to die with the launcher.

A rank started by the launcher must not outlive it: if ``hal train`` or ``hal launch`` is killed with
SIGKILL (or by the OOM killer) it cannot stop its ranks, and they would train on with no parent. On
Linux the kernel's parent-death signal does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` here, then
``exec`` (the setting survives exec), and a check that the launcher had not already gone before it
was armed. Done in this small process rather than in a ``preexec_fn``, which is unsafe while the
launcher runs its stderr reader threads. Elsewhere the command runs unarmed and the guard says so.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn, Sequence

PR_SET_PDEATHSIG = 1


def arm(parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies; False where that does not exist."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(128 + int(signal.SIGKILL))
    return True


def guarded(command: Sequence[str]) -> list[str]:
    """``command`` run through this module: the rank dies with this process (its launcher), even on SIGKILL.

    Started with ``-c``, not ``-m``: ``hal.launch`` imports this module, and runpy warns on stderr of every rank when
    ``-m`` runs a module its package has already imported."""
    return [sys.executable, "-c", "import sys; from hal.launch.guard import main; main(sys.argv[1:])", str(os.getpid()),
            "--", *command]


def main(argv: Sequence[str]) -> NoReturn:
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: python -m hal.launch.guard PARENT_PID -- COMMAND [ARGS...]\n")
        os._exit(2)
    if not arm(int(argv[0])):
        sys.stderr.write(f"hal: warning: {sys.platform} has no parent-death signal: this rank may outlive a killed launcher\n")
    os.execvp(argv[2], list(argv[2:]))


if __name__ == "__main__":
    main(sys.argv[1:])
