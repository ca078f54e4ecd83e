"""Entry-point plumbing shared by the backend registry and the op registry's kernel loader.

Both load what hetero-hal's own distribution declares exactly as they load a third party's, and
both report a plug-in that fails to load instead of crashing or dropping it silently.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

BUILTIN_DISTRIBUTION = "hetero-hal"


@dataclass(frozen=True)
class LoadProblem:
    """A plug-in (backend or kernel module) that could not be loaded; shown instead of crashing."""

    name: str
    origin: str
    reason: str


def entry_points(group: str) -> list[metadata.EntryPoint]:
    return list(metadata.entry_points(group=group))


def is_builtin(ep: metadata.EntryPoint) -> bool:
    """Declared by hetero-hal's own distribution (not a third-party plug-in)."""
    return ep.dist is not None and ep.dist.name.replace("_", "-").lower() == BUILTIN_DISTRIBUTION


def origin(ep: metadata.EntryPoint) -> str:
    """'entry point NAME = VALUE (DISTRIBUTION)': where a plug-in came from, for its load problem."""
    return f"entry point {ep.name} = {ep.value}" + (f" ({ep.dist.name})" if ep.dist else "")
