"""What a compiled decoder layer runs eagerly between its graphs, on purpose.

A compiled layer (``compile: true``) is traced by Dynamo. Code that reads the host, talks to other ranks
through hal's communicators (their Python bookkeeping and timeouts), or must not be baked into a graph (the
split linear, whose weight gradient waits for a store chosen at run time) is wrapped with
``eager_when_compiled``: Dynamo ends the graph before the call, runs it eagerly and starts the next graph
after it — one clean graph break at a named function, not one inside code it cannot resume from.

The mark (``torch.compiler.disable``) is applied when a stage is about to compile (``before_compiling``, called
by ``pipeline.compile_stage``), not at import: marking imports Dynamo, about 3 s of CPU that every rank, every
``hal`` command and every test interpreter would pay for a run that compiles nothing.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_WRAPPED: list[list[Callable[..., Any]]] = []  # each wrapped function's cell: [the function, marked or not]
_MARKED = False


def eager_when_compiled(fn: F) -> F:
    """``fn``, run eagerly inside a compiled region once ``before_compiling`` marked it (plain ``fn`` before)."""
    cell: list[Callable[..., Any]] = [fn]
    if _MARKED:
        cell[0] = _mark(fn)
    _WRAPPED.append(cell)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return cell[0](*args, **kwargs)

    return call  # type: ignore[return-value]


def before_compiling() -> None:
    """Mark every ``eager_when_compiled`` function for Dynamo (once a process; torch >= 2.1, older compiles nothing)."""
    global _MARKED
    if _MARKED:
        return
    for cell in _WRAPPED:
        cell[0] = _mark(cell[0])
    _MARKED = True


def _mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    disable: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(torch.compiler, "disable", lambda f: f)
    return disable(fn)


__all__ = ["before_compiling", "eager_when_compiled"]
