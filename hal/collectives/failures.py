"""A collective that fails mid-flight: one named error that says what happened, and nothing left holding the process.

Measured on torch 2.13 (CPU, gloo): a gloo op runs in its group's worker thread bounded by the
*group's* timeout (300 s by default), whatever the caller waits with; ``ProcessGroup.abort()`` does
not stop it; and interpreter exit joins that thread. So a rank that raised ``CollectiveTimeout``
after a 10 s per-call timeout lived on until 300 s, ``shutdown()`` or not. Every place that starts
or waits for CCL work (communicator, signature and peer checks, bridge) therefore goes through:

- ``starting``: ops are started with their call's timeout (plus ``GRACE``) as their group's CCL
  timeout when it differs from the group's, so the CCL gives up with the caller; and an error
  raised while *starting* an op (gloo raises at once on a send to a peer that is gone) is
  translated like one raised while waiting;
- ``wait_all``: an error while waiting becomes the same named error;
- ``fail``: the error says what happened — ``CollectiveTimeout`` (not every rank arrived in time),
  ``CollectivePeerLost`` (a peer closed its connection: it exited, was killed or gave up first) or
  ``CollectiveError`` (the CCL failed otherwise) — and every process group of this process is
  aborted (``process_groups.abort_all``): the rank cannot go on, and later calls say so at once.
"""
from __future__ import annotations

import datetime
import re
from typing import Any, Sequence

import torch.distributed as dist
from torch.distributed import distributed_c10d

from .errors import CollectiveError, CollectivePeerLost, CollectiveTimeout
from .process_groups import abort_all, group_timeout

# The CCL op outlives the caller's wait by this much, so ranks that start the same call a moment
# later still see their own timeout, not a connection closed by the first rank to give up (gloo
# closes a pair when an op on it times out). A rank that gave up is gone at most GRACE later.
GRACE = datetime.timedelta(seconds=2)

# What the CCLs say when the other end went away (gloo's tcp transport; NCCL's remote error).
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
             "remote process exited", "ncclremoteerror")
TIMED_OUT = ("timed out", "timeout")


def cause(exc: BaseException) -> str:
    """The CCL's own words, short: its first meaningful line without the source location."""
    for line in str(exc).strip().splitlines():
        text = re.sub(r"^\[[^\]]*\]\s*", "", line.strip())
        if text:
            return text.split(". This is typically")[0][:160]
    return type(exc).__name__


def _who(peers: Sequence[int]) -> str:
    others = sorted(set(peers))
    if len(others) == 1:
        return f"rank {others[0]}"
    return f"a peer among ranks {', '.join(map(str, others))}" if others else "a peer"


def _within(timeout: datetime.timedelta | None) -> str:
    if timeout is None:
        return f"the group timeout ({group_timeout().total_seconds():g} s)"
    return f"{timeout.total_seconds():g} s"


def translate(
    exc: BaseException, what: str, timeout: datetime.timedelta | None, peers: Sequence[int], late: str = "did not complete",
) -> CollectiveError:
    """The named error for a CCL failure: a lost peer, a timeout (``late`` says what was late), or else."""
    text = str(exc).lower()
    if any(marker in text for marker in PEER_LOST):
        return CollectivePeerLost(
            f"{what}: {_who(peers)} closed the connection — it exited, was killed or gave up on this call ({cause(exc)}); "
            "this rank cannot go on: the first error is in the other ranks' logs"
        )
    if any(marker in text for marker in TIMED_OUT):
        return CollectiveTimeout(
            f"{what}: {late} within {_within(timeout)} ({cause(exc)}); a rank crashed, hung or skipped this call "
            "— check the other ranks' logs"
        )
    return CollectiveError(f"{what}: the collective failed ({cause(exc)}); this rank cannot go on — check every rank's log for the first error")


def fail(
    exc: BaseException, what: str, timeout: datetime.timedelta | None, peers: Sequence[int], late: str = "did not complete",
) -> CollectiveError:
    """``translate``, after aborting every group of this process (see the module doc); the caller raises it."""
    error = translate(exc, what, timeout, peers, late)
    abort_all(str(error))
    return error


def wait_all(
    works: Sequence[Any], timeout: datetime.timedelta | None, what: str, peers: Sequence[int], late: str = "did not complete",
) -> None:
    """Wait for every work item (``timeout`` None: the CCL's own wait); a failure raises ``fail``'s error."""
    for work in works:
        try:
            work.wait() if timeout is None else work.wait(timeout=timeout)
        except RuntimeError as exc:
            raise fail(exc, what, timeout, peers, late) from None


class starting:  # noqa: N801 — used as a context manager, like contextlib's
    """Start CCL ops on ``groups`` inside this block: bounded by ``timeout`` + GRACE, start errors translated.

    A lost peer or a timeout while starting aborts the groups like one while waiting; any other
    start error (the CCL refused the arguments) leaves them usable. A small class rather than a
    generator: it wraps every op a communicator starts, so it stays cheap (about a microsecond).
    """

    __slots__ = ("_bounded", "_late", "_peers", "_timeout", "_what")

    def __init__(
        self, groups: Sequence[dist.ProcessGroup | None], timeout: datetime.timedelta, what: str, peers: Sequence[int],
        late: str = "did not complete",
    ) -> None:
        self._timeout, self._what, self._peers, self._late = timeout, what, peers, late
        self._bounded: list[dist.ProcessGroup] = []
        if timeout != group_timeout():  # the groups' own timeout needs no bracket (the hot path: no per-call timeout)
            resolved = dict.fromkeys(_resolve(g) for g in groups)
            self._bounded = [g for g in resolved if g is not None and _set_timeout(g, timeout + GRACE)]

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _tb: Any) -> bool:
        for group in self._bounded:
            _set_timeout(group, group_timeout())
        if exc is None or not isinstance(exc, RuntimeError):
            return False
        error = translate(exc, self._what, self._timeout, self._peers, self._late)
        if type(error) is not CollectiveError:
            abort_all(str(error))
        raise error from None


def _resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group object an op on ``group`` uses (None: the default group, if there is one)."""
    if group is not None:
        return group
    return distributed_c10d._get_default_group() if dist.is_initialized() else None


def _set_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> bool:
    """Set the CCL timeout of ops started on ``group`` from now on; False where the backend cannot.

    ``ProcessGroup.set_timeout`` (torch's ``_set_pg_timeout`` on releases without it): measured on
    gloo, where each op keeps the timeout it was started with, so setting it back right after the
    start cannot shorten an op in flight; torch documents it for NCCL too. A CCL that cannot take
    it keeps its group timeout for the op itself: the caller's wait is bounded all the same, and
    ``abort_all`` is what releases such a process.
    """
    setter = getattr(group, "set_timeout", None)
    try:
        if setter is not None:
            setter(timeout)
        elif hasattr(distributed_c10d, "_set_pg_timeout"):
            distributed_c10d._set_pg_timeout(timeout, group)
        else:
            return False
    except (RuntimeError, ValueError):
        return False
    return True
