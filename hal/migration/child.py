"""The first statement of a spawn/forkserver child started inside a migration scope (see
``adapters_runtime.child_processes``): the child enters the same migration for its whole life,
before multiprocessing imports the script, so it runs the script exactly as the parent does."""
from __future__ import annotations

from hal.migration.scope import migrate

_scope = None


def enter(backend_name: str, device_count: int | None) -> None:
    global _scope
    from hal.backend_registry import get_backend

    _scope = migrate(get_backend(backend_name), device_count=device_count)
    _scope.__enter__()  # left by process exit: the child ends with the script's function
