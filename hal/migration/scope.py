"""``migrate(backend)``: apply the mapping table's rows on enter, restore every patched attribute on exit.

One scope is active at a time (nested entries for the same backend share it). Each row kind has a
builder here and each adapter named in the table a function in ``adapters`` / ``adapters_runtime``;
the wrappers they make pass through to the CUDA original once the scope has ended, so an alias that
leaks out stays harmless. While a scope is active the patches are process-wide (module
attributes), so every thread sees them.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

from hal.backend import Backend
from hal.errors import ConfigError, UnsupportedError
from hal.migration.mapping import Kind, Patch, _resolve, map_ccl, plan
from hal.migration.session import Session, cuda_function, parse_arguments, relocating_showwarning, replace_callable, rewrite_arguments, swap

from . import adapters, adapters_runtime

_log = logging.getLogger("hal.migration")
# Backend methods whose numbers may not be the device allocator's (Backend.memory_stats_measure).
_MEMORY_STATS = frozenset({"memory_allocated", "max_memory_allocated", "memory_reserved", "mem_get_info"})
_ADAPTERS = {**adapters.ADAPTERS, **adapters_runtime.ADAPTERS}


# --- builders, one per kind --------------------------------------------------------------------
def _build_device_function(row: Patch, session: Session, original: Any) -> Any:
    names = [n for n in row.args.split(",") if n]
    if row.to.startswith("native:"):
        dtype = row.to.partition(":")[2]
        return cuda_function(row, session, original, lambda *a, **k: session.backend.capabilities().is_native(dtype))
    if row.to == "device_count" and session.device_count is not None:
        return cuda_function(row, session, original, lambda: session.device_count)
    signature = inspect.signature(original)
    backend = session.backend
    method = getattr(backend, row.to)
    notes = [f"maps to backend.{row.to} on {backend.name}: {row.note}"] if row.note else []
    if row.to in _MEMORY_STATS and backend.memory_stats_measure:
        notes.append(f"returns {backend.memory_stats_measure} on {backend.name}")

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [session.index(bound.arguments[n]) if n == "device" else bound.arguments[n] for n in names]
        for note in notes:
            session.warn_once(f"{row.where}:{note}", f"{row.name} {note}")
        return method(*values)

    if row.to in ("manual_seed", "manual_seed_all", "set_rng_state") and session.device_type == "cpu":
        return cuda_function(row, session, original, _watching_host_generator(row, session, impl))
    return cuda_function(row, session, original, impl)


def _watching_host_generator(row: Patch, session: Session, call: Callable[..., Any]) -> Callable[..., Any]:
    """On cpu the device generator IS the host generator: reseeding it changes host random numbers too.

    Warned once — unless the call changes nothing (``torch.manual_seed(s)`` then the same seed here).
    """
    import torch

    def impl(*args: Any, **kwargs: Any) -> Any:
        before = torch.random.default_generator.get_state()
        result = call(*args, **kwargs)
        if not torch.equal(before, torch.random.default_generator.get_state()):
            session.warn_once("host-generator", f"{row.name} on cpu sets the host generator (the cpu device's "
                              "own): torch's CPU random numbers drawn after this call change too")
        return result

    return impl


def _build_no_equivalent(row: Patch, session: Session, original: Any) -> Any:
    message = f"{row.name} has no equivalent on {session.backend.name}; calling the CUDA original"

    def impl(*args: Any, **kwargs: Any) -> Any:
        session.warn_once(row.where, message)
        return original(*args, **kwargs)

    return cuda_function(row, session, original, impl)


def _build_device_argument(row: Patch, session: Session, original: Any) -> Any:
    spec = parse_arguments(row.args)

    def impl(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = rewrite_arguments(args, kwargs, spec, session.map_device)
        return original(*args, **kwargs)

    return replace_callable(original, session, impl)


def _build_ccl_name(row: Patch, session: Session, original: Any) -> Any:
    spec = parse_arguments(row.args)

    def impl(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = rewrite_arguments(args, kwargs, spec, lambda name: map_ccl(name, session.backend))
        return original(*args, **kwargs)

    return replace_callable(original, session, impl)


def _build_adapter(row: Patch, session: Session, original: Any) -> Any:
    return _ADAPTERS[row.to](row, session, original)


def _apply_env(row: Patch, session: Session) -> None:
    """Copy a CUDA env var to the backend's name for it (effective before the runtime starts)."""
    source = row.where[4:]
    if source not in os.environ:
        return
    backend = session.backend
    if row.to.startswith("backend."):
        target = getattr(backend, row.to.partition(".")[2])
    else:
        target = None if backend.device_type == "cpu" else row.to.format(DEVICE=backend.device_type.upper())
    if target is None:
        session.warn_once(row.where, f"{source} is set but has no equivalent on {backend.name}; ignored")
    elif target not in os.environ:
        os.environ[target] = os.environ[source]
        session.defer(lambda: os.environ.pop(target, None))


_BUILDERS: dict[Kind, Callable[[Patch, Session, Any], Any]] = {
    Kind.DEVICE_FUNCTION: _build_device_function,
    Kind.DEVICE_ARGUMENT: _build_device_argument,
    Kind.CCL_NAME: _build_ccl_name,
    Kind.NO_EQUIVALENT: _build_no_equivalent,
    Kind.ADAPTER: _build_adapter,
}


def _apply(session: Session, rows: tuple[Patch, ...]) -> None:
    session.active = True
    try:
        if rows:
            session.defer(swap(warnings, "showwarning", relocating_showwarning(warnings.showwarning)))
        for row in rows:
            if row.is_env:
                _apply_env(row, session)
            else:
                owner, attr = _resolve(row.where)
                replacement = _BUILDERS[row.kind](row, session, getattr(owner, attr))
                session.defer(swap(owner, attr, replacement))
            session.applied.append(row)
    except BaseException:
        session.restore()
        raise


class _LiftedImports(importlib.abc.MetaPathFinder):
    """Runs the import of the torch modules that record torch's classes when they are imported with
    the patches lifted, when the script first needs them: torch.compile's tracer (``torch._dynamo``)
    and DTensor (``torch.distributed.tensor``, which registers DeviceMesh as an opaque type) must see
    the real classes; compiled script code then traces the shim's wrappers without graph breaks.
    Not imported up front: importing the tracer makes gloo's process-group teardown deadlock now and
    then (DDP + torch.multiprocessing.spawn on torch 2.13), a cost only scripts that compile should pay."""

    NAMES = frozenset({"torch._dynamo", "torch.distributed.tensor"})

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in self.NAMES or _current is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _LiftedLoader(spec.loader)
        return spec


class _LiftedLoader(importlib.abc.Loader):
    """The real loader, executing the module with every patch lifted."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with _lifted():
            self.loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks and linecache
        return getattr(self.loader, name)


# --- the context manager -------------------------------------------------------------------------
_lock = threading.RLock()
_current: Session | None = None
_depth = 0
_hook: _LiftedImports | None = None  # installed with the outermost scope, removed with it
_lifted_depth = 0


@contextlib.contextmanager
def _lifted() -> Iterator[None]:
    """Every patch undone for the enclosed block, then applied afresh (warnings given stay given)."""
    global _lifted_depth
    with _lock:
        session = _current
        if session is None or _lifted_depth:  # no scope, or an import nested in a lifted one
            yield
            return
        rows = tuple(session.applied)
        session.restore()
        _lifted_depth += 1
        try:
            yield
        finally:
            _lifted_depth -= 1
            session.applied.clear()
            _apply(session, rows)


class _Migration(contextlib.AbstractContextManager):
    """Enter patches (the outermost entry only); the matching outermost exit restores."""

    def __init__(self, backend: Backend, device_count: int | None = None) -> None:
        if device_count is not None:
            if backend.device_type != "cpu":
                raise ConfigError(f"a device count of {device_count} is only for the cpu target (it has one device, "
                                  f"shown as several); backend '{backend.name}' shows its real devices")
            if device_count < 1:
                raise ConfigError(f"device count {device_count} is not a count; give 1 or more")
        self.backend = backend
        self.device_count = device_count

    @property
    def applied(self) -> tuple[Patch, ...]:
        session = _current
        return tuple(session.applied) if session is not None and session.backend is self.backend else ()

    def __enter__(self) -> _Migration:
        global _current, _depth, _hook
        with _lock:
            if _current is not None:
                if _current.backend is not self.backend:
                    raise UnsupportedError(
                        f"a migration to backend '{_current.backend.name}' is already active; "
                        f"leave it before migrating to '{self.backend.name}'"
                    )
                _depth += 1
                return self
            rows = plan(self.backend)
            session = Session(self.backend, self.device_count)
            _apply(session, rows)
            _current, _depth = session, 1
            if rows and not _LiftedImports.NAMES <= sys.modules.keys():
                _hook = _LiftedImports()
                sys.meta_path.insert(0, _hook)
        _log.info("migrated %d CUDA targets to backend %s", len(session.applied), self.backend.name)
        return self

    def __exit__(self, *exc: Any) -> bool:
        global _current, _depth, _hook
        with _lock:
            _depth -= 1
            if _depth == 0 and _current is not None:
                session, _current = _current, None
                if _hook is not None and _hook in sys.meta_path:
                    sys.meta_path.remove(_hook)
                _hook = None
                try:
                    session.restore()
                finally:
                    session.kept.clear()
        return False


def migrate(backend: Backend, *, device_count: int | None = None) -> _Migration:
    """Run the enclosed CUDA-written code on ``backend``; every patch is undone on exit.

    ``device_count`` (cpu only) is how many CUDA devices the script is told exist — all of them
    the one host device — for scripts that insist on several.
    """
    return _Migration(backend, device_count)
