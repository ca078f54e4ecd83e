"""Errors a user sees. Each one is a single line that names the problem and the fix.

The CLI prints ``str(error)`` and exits 2 for every ``HalError``; nothing else is shown.
"""
from __future__ import annotations


class HalError(Exception):
    """Base class: a one-line, user-facing message (problem; fix)."""

    def __init__(self, message: str) -> None:
        # Collapse newlines so every message really is one line.
        super().__init__(" ".join(str(message).split()))


class ConfigError(HalError):
    """A config file, environment variable or CLI flag holds a value we cannot use."""


class BackendUnavailable(HalError):
    """The requested backend cannot run here; the message carries the probe's reason."""


class UnsupportedError(HalError):
    """The device or backend lacks a capability (dtype, op, switch) the caller asked for."""


class FallbackRefused(HalError):
    """A downgrade was needed but the user's ``fallback`` setting is ``error``."""
