"""A rank's process name: what ``ps -o comm``, ``top`` and ``pgrep`` show, so a person can tell the ranks apart.

Why: forked ranks all show their zygote's command line, and fresh ones the same ``python -m ...`` line, so "which
process is rank 3?" (to ``py-spy dump`` a hung one, to kill one in a drill) had no answer. The launcher puts the name
in ``HAL_PROCESS_NAME``; the rank takes it as its first act (the kernel's name survives until the next ``exec``).
"""
from __future__ import annotations

import os
import sys

PROCESS_NAME_ENV = "HAL_PROCESS_NAME"
PR_SET_NAME = 15
MAX_NAME = 15  # the kernel keeps 15 bytes of a process name


def rank_name(rank: int) -> str:
    """The name a launcher gives rank ``rank``."""
    return f"hal-rank-{rank}"


def take_name() -> str | None:
    """Name this process after ``HAL_PROCESS_NAME``, else after torchrun's ``RANK`` (``hal-rank-N``) (Linux; elsewhere
    nothing); the name taken, or None."""
    given = os.environ.get(PROCESS_NAME_ENV) or (rank_name(int(os.environ["RANK"])) if os.environ.get("RANK", "").isdigit()
                                                  else "")
    name = given[:MAX_NAME]
    if not name or not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return name if libc.prctl(PR_SET_NAME, name.encode(), 0, 0, 0) == 0 else None


__all__ = ["MAX_NAME", "PROCESS_NAME_ENV", "rank_name", "take_name"]
