"""Entry-point plumbing shared by the backend registry and the op registry's kernel loader, and the one
"module:callable" resolver (launcher function ranks, conformance jobs).

Both load what hetero-hal's own distribution declares exactly as they load a third party's, and
both report a plug-in that fails to load instead of crashing or dropping it silently.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

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


def resolve(path: str, what: str = "callable") -> Callable[..., Any]:
    """``"package.module:attr"`` → the object; one clear line when it cannot be imported (the launcher's
    function ranks and conformance's jobs name what they run this way)."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{what} {path!r} is not 'module:callable' (e.g. tests.planted_collectives:make)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported ({exc}); put its package on PYTHONPATH") from None
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is not callable")
    return obj
