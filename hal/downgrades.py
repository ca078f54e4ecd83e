"""The one place where every downgrade (dtype, op, device, CCL path) is decided and recorded.

No silent fallbacks: code that wants to use something other than what was asked for calls
``record_downgrade``. The user's ``fallback`` policy decides what happens next:

* ``error`` – raise ``FallbackRefused`` (nothing is downgraded);
* ``warn``  – record it and emit a ``DowngradeWarning``;
* ``allow`` – record it quietly; it still shows in ``hal ops``, ``hal devices`` and reports.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Iterator, Literal

from hal.errors import FallbackRefused

FallbackMode = Literal["error", "warn", "allow"]
FALLBACK_MODES: tuple[str, ...] = ("error", "warn", "allow")
DowngradeKind = Literal["dtype", "op", "device", "ccl", "precision"]

_log = logging.getLogger("hal.downgrades")


class DowngradeWarning(UserWarning):
    """Emitted once per distinct downgrade when ``fallback: warn``."""


@dataclass(frozen=True)
class Downgrade:
    kind: DowngradeKind
    subject: str  # what was downgraded, e.g. "precision" or "op rms_norm on ascend/bfloat16"
    requested: str
    used: str
    reason: str

    def describe(self) -> str:
        return f"{self.kind} downgrade: {self.subject}: {self.requested} -> {self.used} ({self.reason})"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class _State(threading.local):
    def __init__(self) -> None:
        self.mode: FallbackMode = "warn"


fallback_state = _State()  # this thread's policy; the op dispatch reads .mode directly (a hot path)
_records: list[Downgrade] = []
_records_lock = threading.Lock()


def fallback_mode() -> FallbackMode:
    """The policy in force for this thread (default ``warn``)."""
    return fallback_state.mode


def set_fallback_mode(mode: FallbackMode) -> None:
    if mode not in FALLBACK_MODES:
        raise ValueError(f"fallback must be one of {', '.join(FALLBACK_MODES)}, got {mode!r}")
    fallback_state.mode = mode


@contextlib.contextmanager
def fallback_policy(mode: FallbackMode) -> Iterator[None]:
    """Temporarily run under another fallback policy."""
    previous = fallback_state.mode
    set_fallback_mode(mode)
    try:
        yield
    finally:
        fallback_state.mode = previous


def record_downgrade(downgrade: Downgrade, mode: FallbackMode | None = None) -> Downgrade:
    """Apply the fallback policy to ``downgrade``: raise, or record (and maybe warn)."""
    mode = mode or fallback_state.mode
    if mode == "error":
        raise FallbackRefused(
            f"{downgrade.describe()}; refused because fallback is 'error' — "
            "set fallback: warn (or allow) to accept it, or pick a setting the device supports"
        )
    with _records_lock:
        is_new = downgrade not in _records
        if is_new:
            _records.append(downgrade)
    if is_new:
        if mode == "warn":
            warnings.warn(downgrade.describe(), DowngradeWarning, stacklevel=3)
        _log.info(downgrade.describe())
    return downgrade


def recorded_downgrades() -> list[Downgrade]:
    """Every downgrade accepted so far in this process, oldest first."""
    with _records_lock:
        return list(_records)


def clear_downgrades() -> None:
    with _records_lock:
        _records.clear()
