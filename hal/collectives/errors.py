"""The errors a collective raises: each one line naming what happened and what to do.

Kept apart from the code that raises them (validation, failures, communicator) so every module of
the package can import them without importing each other.
"""
from __future__ import annotations

from hal.errors import HalError


class CollectiveError(HalError):
    """A collective call the ranks disagree on, or one that cannot run as asked."""


class CollectiveTimeout(CollectiveError):
    """Not every rank arrived at a collective within its timeout."""


class CollectivePeerLost(CollectiveError):
    """A peer closed its connection mid-call: it exited, was killed, or gave up on the call first."""
