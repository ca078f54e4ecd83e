"""The patch session: ``migrate(backend)`` applies the mapping table's rows on enter and restores
every patched attribute on exit, even on error.

One scope is active at a time (nested entries for the same backend share it). Each row kind has a
builder and each adapter named in the table has a function here; the wrappers they make pass
through to the CUDA original once the scope has ended, so an alias that leaks out stays harmless.
While a scope is active the patches are process-wide (module attributes), so every thread sees them.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable, Iterator

import torch

from ..backend import Backend
from ..errors import UnsupportedError
from .mapping import (CUDA, _REAL_DEVICE, Kind, Patch, _location, _resolve, map_ccl, map_device, plan,
                      rewrite_map_location)

_log = logging.getLogger("hal.migration")
_MISSING = object()
# The real class, taken from a path the shim never patches.
_REAL_AUTOCAST: type = torch.amp.autocast_mode.autocast


class MigrationWarning(UserWarning):
    """A CUDA call the target cannot honour exactly; emitted once per name and scope."""


_ArgSpec = tuple[frozenset[int], frozenset[str]]


def _parse_args(spec: str) -> _ArgSpec:
    """"1|device=" -> ({1}, {"device"}): parsed once per row, not per call."""
    parts = [p for p in spec.split("|") if p]
    return (
        frozenset(int(p) for p in parts if p.isdigit()),
        frozenset(p.rstrip("=") for p in parts if p.endswith("=")),
    )


def _rewrite(args: tuple[Any, ...], kwargs: dict[str, Any], spec: _ArgSpec, fn: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    positions, keywords = spec
    new_args = tuple(fn(a) if i in positions else a for i, a in enumerate(args))
    new_kwargs = {k: fn(v) if k in keywords else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _from_torch(frame: types.FrameType | None) -> bool:
    """Whether the calling code is torch's own (it must keep seeing the real CUDA module)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "torch" or name.startswith("torch.")


# --- class proxies ---------------------------------------------------------------------------
class _ProxyMeta(type):
    """A stand-in class: calling it runs the mapping; isinstance/issubclass see the real class."""

    _hal_original: type
    _hal_factory: Callable[..., Any]

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> Any:
        if "_hal_original" in ns:
            return super().__new__(mcls, name, bases, ns, **kw)
        # A script subclassing the proxy gets a subclass of the real class instead.
        real = tuple(b._hal_original if isinstance(b, _ProxyMeta) else b for b in bases)
        return type(real[0])(name, real, ns, **kw)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._hal_factory(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._hal_original)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._hal_original)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._hal_original, name)


def _class_proxy(original: type, factory: Callable[..., Any]) -> type:
    ns = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "_hal_original": original,
        "_hal_factory": staticmethod(factory),
    }
    return _ProxyMeta(original.__name__, (), ns)


def _replace_callable(original: Any, session: "_Session", impl: Callable[..., Any]) -> Any:
    """A class gets a proxy class, anything else a function; both pass through when inactive."""

    def factory(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, **kwargs) if session.active else original(*args, **kwargs)

    if isinstance(original, type):
        return _class_proxy(original, factory)
    return functools.wraps(original)(factory)


# --- the session: one active migration scope --------------------------------------------------
class _Session:
    """The state a scope's wrappers share: target, warnings already given, undo stack."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.device_type: str = backend.device_type
        self.active = False
        self.applied: list[Patch] = []
        self._undo: list[Callable[[], None]] = []
        self._warned: set[str] = set()
        self._local = threading.local()

    # --- warnings and re-entrancy ---------------------------------------------------------------
    def warn_once(self, key: str, message: str, stacklevel: int = 4) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, MigrationWarning, stacklevel=stacklevel)

    @contextlib.contextmanager
    def guard(self, key: str) -> Iterator[bool]:
        """Yields True when ``key`` is already running on this thread (call the original then)."""
        busy: set[str] = self._local.__dict__.setdefault("busy", set())
        if key in busy:
            yield True
            return
        busy.add(key)
        try:
            yield False
        finally:
            busy.discard(key)

    # --- devices ---------------------------------------------------------------------------------
    def map_device(self, value: Any, ints: bool = True) -> Any:
        return map_device(value, self.device_type, ints=ints)

    def make_device(self, *args: Any, **kwargs: Any) -> Any:
        """torch.device(...) with CUDA meaning: a bare int is a CUDA ordinal."""
        if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
            return self.map_device(args[0])
        return self.map_device(_REAL_DEVICE(*args, **kwargs))

    def index(self, device: Any) -> int:
        """A CUDA device argument as the backend's ordinal (None = current device)."""
        if self.device_type == "cpu":
            return 0
        if isinstance(device, (str, _REAL_DEVICE)):
            device = _REAL_DEVICE(self.map_device(device)).index
        return self.backend.current_device() if device is None else int(device)

    def set_reduced_precision(self, enabled: bool, name: str) -> None:
        backend = self.backend
        if backend.reduced_precision_matmul_format is None:
            if enabled:
                self.warn_once(name, f"{name} has no equivalent on {backend.name} (no reduced-precision fp32 "
                               "matmul mode); ignored, fp32 matmuls stay full precision", stacklevel=4)
            return
        try:
            backend.set_reduced_precision_matmul(enabled)
        except UnsupportedError as exc:
            self.warn_once(name, f"{name} = {enabled} ignored on {backend.name}: {exc}", stacklevel=4)

    # --- applying and undoing ----------------------------------------------------------------------
    def defer(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def apply(self, rows: tuple[Patch, ...]) -> None:
        self.active = True
        try:
            for row in rows:
                if row.is_env:
                    _apply_env(row, self)
                else:
                    owner, attr = _resolve(row.where)
                    replacement = _BUILDERS[row.kind](row, self, getattr(owner, attr))
                    self.defer(_swap(owner, attr, replacement))
                self.applied.append(row)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        """Undo everything, newest first; every undo runs even if one fails."""
        self.active = False
        errors: list[BaseException] = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep restoring the rest; report the first failure after
                errors.append(exc)
        if errors:
            raise errors[0]


def _swap(owner: Any, attr: str, value: Any) -> Callable[[], None]:
    """Set ``owner.attr``; the undo puts back the owner's own entry (or removes the shadow)."""
    own = vars(owner).get(attr, _MISSING)
    setattr(owner, attr, value)

    def undo() -> None:
        if own is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)

    return undo


# --- builders, one per kind --------------------------------------------------------------------
def _cuda_function(row: Patch, session: _Session, original: Any, impl: Callable[..., Any]) -> Any:
    """Wrap a CUDA-module callable: torch's own callers and re-entrant calls get the original."""

    def translated(*args: Any, **kwargs: Any) -> Any:
        if _from_torch(sys._getframe(2)):
            return original(*args, **kwargs)
        with session.guard(row.where) as busy:
            return original(*args, **kwargs) if busy else impl(*args, **kwargs)

    return _replace_callable(original, session, translated)


def _build_device_function(row: Patch, session: _Session, original: Any) -> Any:
    names = [n for n in row.args.split(",") if n]
    if row.to.startswith("native:"):
        dtype = row.to.partition(":")[2]
        return _cuda_function(row, session, original, lambda *a, **k: session.backend.capabilities().is_native(dtype))
    signature = inspect.signature(original)
    method = getattr(session.backend, row.to)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = [session.index(bound.arguments[n]) if n == "device" else bound.arguments[n] for n in names]
        if row.note:
            session.warn_once(row.where, f"{row.name} maps to backend.{row.to} on {session.backend.name}: {row.note}", 5)
        return method(*values)

    return _cuda_function(row, session, original, impl)


def _build_no_equivalent(row: Patch, session: _Session, original: Any) -> Any:
    message = f"{row.name} has no equivalent on {session.backend.name}; calling the CUDA original"

    def impl(*args: Any, **kwargs: Any) -> Any:
        session.warn_once(row.where, message, stacklevel=5)
        return original(*args, **kwargs)

    return _cuda_function(row, session, original, impl)


def _build_device_argument(row: Patch, session: _Session, original: Any) -> Any:
    spec = _parse_args(row.args)

    def impl(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _rewrite(args, kwargs, spec, session.map_device)
        return original(*args, **kwargs)

    return _replace_callable(original, session, impl)


def _build_ccl_name(row: Patch, session: _Session, original: Any) -> Any:
    spec = _parse_args(row.args)

    def impl(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _rewrite(args, kwargs, spec, lambda name: map_ccl(name, session.backend))
        return original(*args, **kwargs)

    return _replace_callable(original, session, impl)


def _build_adapter(row: Patch, session: _Session, original: Any) -> Any:
    return _ADAPTERS[row.to](row, session, original)


def _apply_env(row: Patch, session: _Session) -> None:
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
        session.warn_once(row.where, f"{source} is set but has no equivalent on {backend.name}; ignored", 5)
    elif target not in os.environ:
        os.environ[target] = os.environ[source]
        session.defer(lambda: os.environ.pop(target, None))


# --- adapters ----------------------------------------------------------------------------------
def _adapt_device_class(row: Patch, session: _Session, original: Any) -> Any:
    """torch.device becomes a proxy class named ``torch.device``.

    A device pickles as ``(getattr(torch, "device"), args)`` — torch looks the class up at
    pickling time — so the proxy must carry the real module and name for pickle to accept it.
    """
    return _replace_callable(_REAL_DEVICE, session, session.make_device)


def _adapt_device_context(row: Patch, session: _Session, original: Any) -> Any:
    return _replace_callable(original, session, lambda device: _DeviceContext(session, device))


class _DeviceContext:
    """``with <cuda>.device(i):`` on the backend: select device i, then put the old one back."""

    def __init__(self, session: _Session, device: Any) -> None:
        self._backend = session.backend
        self._index = None if device is None or device == -1 else session.index(device)
        self._previous: int | None = None

    def __enter__(self) -> "_DeviceContext":
        if self._index is not None:
            self._previous = self._backend.current_device()
            if self._previous != self._index:
                self._backend.set_device(self._index)
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._previous is not None and self._previous != self._index:
            self._backend.set_device(self._previous)
        return False


def _cuda_autocast_dtype() -> torch.dtype:
    """What CUDA autocast would use with no dtype: float16 unless the script changed it."""
    try:
        return torch.get_autocast_dtype(CUDA)
    except (AttributeError, RuntimeError):
        return torch.float16


def _adapt_autocast(row: Patch, session: _Session, original: Any) -> Any:
    signature = inspect.signature(_REAL_AUTOCAST.__init__)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        if bound.arguments.get("device_type") == CUDA:
            bound.arguments["device_type"] = session.device_type
            if bound.arguments.get("dtype") is None:
                bound.arguments["dtype"] = _cuda_autocast_dtype()
        return original(*bound.args[1:], **bound.kwargs)

    return _replace_callable(original, session, impl)


def _adapt_cuda_autocast(row: Patch, session: _Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, enabled, dtype=float16, cache_enabled)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return _REAL_AUTOCAST(session.device_type, dtype=a["dtype"], enabled=a["enabled"], cache_enabled=a["cache_enabled"])

    return _replace_callable(original, session, impl)


def _adapt_grad_scaler(row: Patch, session: _Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, device="cuda", init_scale, ...)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        options.pop("self", None)
        device = options.pop("device")
        if not (isinstance(device, str) and device.startswith(CUDA)):
            return original(device, **options)
        return session.backend.grad_scaler(**options)

    return _replace_callable(original, session, impl)


def _adapt_cuda_grad_scaler(row: Patch, session: _Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, init_scale, growth_factor, ...)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k != "self"}
        return session.backend.grad_scaler(**options)

    return _replace_callable(original, session, impl)


class _MatmulSwitch:
    """Stands in for the CUDA matmul settings object: TF32 requests go to the backend's switch."""

    def __init__(self, original: Any, session: _Session, name: str) -> None:
        object.__setattr__(self, "_hal", (original, session, name))

    def __getattr__(self, attr: str) -> Any:
        original, session, _ = object.__getattribute__(self, "_hal")
        if session.active and attr == "allow_tf32":
            return session.backend.reduced_precision_matmul_enabled()
        return getattr(original, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        original, session, name = object.__getattribute__(self, "_hal")
        if session.active and attr in ("allow_tf32", "fp32_precision"):
            enabled = bool(value) if attr == "allow_tf32" else value == "tf32"
            session.set_reduced_precision(enabled, f"{name}.{attr}")
        else:
            setattr(original, attr, value)


def _adapt_tf32_switch(row: Patch, session: _Session, original: Any) -> Any:
    return _MatmulSwitch(original, session, row.name)


def _adapt_map_location(row: Patch, session: _Session, original: Any) -> Any:
    def impl(*args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            args = (args[0], rewrite_map_location(args[1], session.device_type), *args[2:])
        else:
            kwargs["map_location"] = rewrite_map_location(kwargs.get("map_location"), session.device_type)
        return original(*args, **kwargs)

    return _replace_callable(original, session, impl)


def _adapt_tensor_to_target(row: Patch, session: _Session, original: Any) -> Any:
    def impl(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        return self.to(session.map_device(CUDA if device is None else device), non_blocking=non_blocking, **kwargs)

    return _replace_callable(original, session, impl)


def _adapt_module_to_target(row: Patch, session: _Session, original: Any) -> Any:
    def impl(self: torch.nn.Module, device: Any = None) -> Any:
        return self.to(session.map_device(CUDA if device is None else device))

    return _replace_callable(original, session, impl)


def _adapt_is_target(row: Patch, session: _Session, original: Any) -> Any:
    def fget(tensor: torch.Tensor) -> bool:
        if not session.active or _from_torch(sys._getframe(1)):
            return bool(original.__get__(tensor, type(tensor)))
        return tensor.device.type == session.device_type

    return property(fget, doc=f"True when the tensor is on the migration target ({session.device_type}).")


_FIRST_OR_DEVICE = _parse_args("0|device=")


def _adapt_pin_memory(row: Patch, session: _Session, original: Any) -> Any:
    """Pinning stages host memory for device copies; on the host target a plain copy is exact."""

    def impl(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if session.device_type == "cpu":
            return self.clone()
        args, kwargs = _rewrite(args, kwargs, _FIRST_OR_DEVICE, session.map_device)
        return original(self, *args, **kwargs)

    return _replace_callable(original, session, impl)


def _adapt_ddp_devices(row: Patch, session: _Session, original: Any) -> Any:
    """DDP takes no device_ids for host modules; elsewhere CUDA devices map, ordinals stay."""

    def impl(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if session.device_type == "cpu":
            device_ids, output_device = None, None
        else:
            device_ids = None if device_ids is None else [_location(session.map_device(d, ints=False)) for d in device_ids]
            output_device = session.map_device(output_device, ints=False)
        return original(self, module, device_ids, output_device, *args, **kwargs)

    return _replace_callable(original, session, impl)


_BUILDERS: dict[Kind, Callable[[Patch, _Session, Any], Any]] = {
    Kind.DEVICE_FUNCTION: _build_device_function,
    Kind.DEVICE_ARGUMENT: _build_device_argument,
    Kind.CCL_NAME: _build_ccl_name,
    Kind.NO_EQUIVALENT: _build_no_equivalent,
    Kind.ADAPTER: _build_adapter,
}

_ADAPTERS: dict[str, Callable[[Patch, _Session, Any], Any]] = {
    "device_class": _adapt_device_class,
    "device_context": _adapt_device_context,
    "autocast": _adapt_autocast,
    "cuda_autocast": _adapt_cuda_autocast,
    "grad_scaler": _adapt_grad_scaler,
    "cuda_grad_scaler": _adapt_cuda_grad_scaler,
    "tf32_switch": _adapt_tf32_switch,
    "map_location": _adapt_map_location,
    "tensor_to_target": _adapt_tensor_to_target,
    "module_to_target": _adapt_module_to_target,
    "is_target": _adapt_is_target,
    "pin_memory": _adapt_pin_memory,
    "ddp_devices": _adapt_ddp_devices,
}


# --- the context manager -------------------------------------------------------------------------
_lock = threading.RLock()
_current: _Session | None = None
_depth = 0


class _Migration(contextlib.AbstractContextManager):
    """Enter patches (the outermost entry only); the matching outermost exit restores."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def applied(self) -> tuple[Patch, ...]:
        session = _current
        return tuple(session.applied) if session is not None and session.backend is self.backend else ()

    def __enter__(self) -> "_Migration":
        global _current, _depth
        with _lock:
            if _current is not None:
                if _current.backend is not self.backend:
                    raise UnsupportedError(
                        f"a migration to backend '{_current.backend.name}' is already active; "
                        f"leave it before migrating to '{self.backend.name}'"
                    )
                _depth += 1
                return self
            session = _Session(self.backend)
            session.apply(plan(self.backend))
            _current, _depth = session, 1
        _log.info("migrated %d CUDA targets to backend %s", len(session.applied), self.backend.name)
        return self

    def __exit__(self, *exc: Any) -> bool:
        global _current, _depth
        with _lock:
            _depth -= 1
            if _depth == 0 and _current is not None:
                session, _current = _current, None
                session.restore()
        return False


def migrate(backend: Backend) -> _Migration:
    """Run the enclosed CUDA-written code on ``backend``; every patch is undone on exit."""
    return _Migration(backend)
