"""Leaving a rank: its process groups torn down first, while the interpreter is whole, then ``os._exit``.

Why: a script that never calls ``destroy_process_group`` (most do not) leaves its groups to the interpreter's
finalization, where torch 2.13's gloo now and then aborts the process ("terminate called without an active
exception": a worker thread still joinable while its group is destroyed, exit 134 after the script printed its
result) or its destructor waits for the interpreter lock a finalizing interpreter no longer hands out (the
deadlock class of pytorch/pytorch#56297: the rank hangs after its work is done). And a rank that failed is then
reported by what its teardown did (SIGABRT), not by its own exit status.

So the rank's own code ends, then: its groups are destroyed (aborted after a failure: peers may be gone, and an
abort waits for nobody), its ``atexit`` handlers run, stdout and stderr are flushed, and the process leaves with
``os._exit(code)`` — no finalizer of torch's runs. A watchdog bounds all of it: past ``grace_s`` the rank says so
in one line and leaves with the same code.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

GRACE_S = 60.0  # for teardown and atexit handlers together; a healthy teardown takes milliseconds
GRACE_ENV = "HAL_RANK_EXIT_GRACE_S"  # another bound, in seconds


def teardown_groups(failed: bool) -> str | None:
    """Destroy (after a failure: abort) every process group of this process; what went wrong, or None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None) if failed else None
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except Exception as exc:  # the groups are dropped either way; the exit status stays the rank's own
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return None


def _grace() -> float:
    try:
        value = float(os.environ.get(GRACE_ENV, GRACE_S))
    except ValueError:
        return GRACE_S
    return value if value > 0 else GRACE_S


def exit_rank(code: int, grace_s: float | None = None) -> NoReturn:
    """Tear this rank down in the safe order and leave with ``code`` (see the module's docstring); ``grace_s``:
    the watchdog's bound (default ``HAL_RANK_EXIT_GRACE_S``, else ``GRACE_S``)."""
    grace_s = _grace() if grace_s is None else grace_s
    def overdue() -> None:
        sys.stderr.write(f"hal: warning: tearing this rank down took over {grace_s:g} s (a process group or an atexit "
                         f"handler hung); leaving with exit status {code}\n")
        sys.stderr.flush()
        os._exit(code)

    watchdog = threading.Timer(grace_s, overdue)
    watchdog.daemon = True
    watchdog.start()
    problem = teardown_groups(failed=code != 0)
    if problem:
        print(f"hal: warning: tearing the process groups down: {problem}", file=sys.stderr)
    try:
        atexit._run_exitfuncs()  # the script's own handlers (os._exit skips them)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


__all__ = ["GRACE_ENV", "GRACE_S", "exit_rank", "teardown_groups"]
