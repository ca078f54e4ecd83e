"""What a compiled decoder layer runs eagerly between its graphs, on purpose.

A compiled layer (``compile: true``) is traced by Dynamo. Code that reads the host, talks to other ranks
through hal's communicators (their Python bookkeeping and timeouts), or must not be baked into a graph (the
split linear, whose weight gradient waits for a store chosen at run time) is wrapped with
``eager_when_compiled``: Dynamo ends the graph before the call, runs it eagerly and starts the next graph
after it — one clean graph break at a named function, not one inside code it cannot resume from.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

# torch >= 2.1: run eagerly inside a compiled region (older torch compiles nothing here)
eager_when_compiled: Callable[[F], F] = getattr(torch.compiler, "disable", lambda fn: fn)

__all__ = ["eager_when_compiled"]
