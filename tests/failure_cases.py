"""Per-rank bodies for the collective failure tests (run through tests.dist_harness on CPU + gloo).

Each returns what this rank saw — an error as ``"ClassName: message"`` — so the test can check
that every rank got the same one clear line, or that a survivor named what really happened.
"""
from __future__ import annotations

import datetime
import signal
import sys
import time
from typing import Any, Callable

import torch


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def peer_exits(rank: int, world: int, validate: bool) -> dict[str, Any]:
    """Rank 1 leaves at once (its process exits); rank 0's next call must say a peer left, not time out."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=validate)
    comm.barrier()  # both finished connecting their groups: rank 1 leaving now cannot break rank 0's setup
    if rank == 1:
        return {}
    start = time.monotonic()
    error = _error_of(lambda: comm.all_reduce(torch.ones(2)))
    seconds = time.monotonic() - start
    return {"error": error, "seconds": seconds, "after": _error_of(lambda: comm.all_reduce(torch.ones(2)))}


def bad_splits(rank: int, world: int, validate: bool) -> dict[str, str]:
    """One rank passes bad all_to_all split sizes; every rank must raise the same error naming it."""
    from hal.collectives import world_communicator

    comm = world_communicator(validate=validate)
    x = torch.arange(4.0)
    errors = {"input count": _error_of(lambda: comm.all_to_all(x, input_splits=[1, 1, 2] if rank == 1 else [2, 2]))}
    errors["input sum"] = _error_of(lambda: comm.all_to_all(x, input_splits=[1, 2] if rank == 1 else [2, 2]))
    errors["negative"] = _error_of(lambda: comm.all_to_all(x, input_splits=[5, -1] if rank == 1 else [2, 2]))
    if validate:  # these need every rank's lists, which only the validated call exchanges
        errors["output"] = _error_of(lambda: comm.all_to_all(x, input_splits=[1, 3], output_splits=[3, 1] if rank == 1 else None))
        errors["indivisible"] = _error_of(lambda: comm.all_to_all(torch.arange(5.0) if rank == 1 else x))
        errors["uneven ok"] = str(comm.all_to_all(torch.arange(float(2 + 2 * rank)), input_splits=[1, 1 + 2 * rank]).tolist())
    # The group is still usable after every refused call.
    errors["after"] = str(comm.all_to_all(x + 10 * rank, input_splits=[1, 3]).tolist())
    return errors


def sigkilled_peer(rank: int, world: int, validate: bool, pause_s: float) -> str:
    """Rank 1 dies by SIGKILL; rank 0 (ignoring the launcher's SIGTERM meanwhile) then starts a send to it.

    gloo refuses a send to a closed connection while *starting* it: the survivor must still get
    the named error. Its line goes to stdout, which the launcher echoes; it is also returned.
    """
    from hal.collectives import world_communicator

    comm = world_communicator(validate=validate)
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher stops survivors at once; let this one report
    comm.barrier()
    if rank == 1:
        signal.raise_signal(signal.SIGKILL)
    time.sleep(pause_s)  # the kernel has closed rank 1's sockets; gloo has seen it
    seen = _error_of(lambda: comm.send(torch.ones(3), dst=1, timeout=datetime.timedelta(seconds=5)))
    sys.stdout.write(f"SURVIVOR {seen}\n")
    sys.stdout.flush()
    return seen
