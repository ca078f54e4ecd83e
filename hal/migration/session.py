"""The state one migration scope shares: the target, warnings already given, the undo stack.

Also the primitives every adapter builds on: class proxies (calling runs the mapping while
``isinstance`` keeps seeing the real class), the "is this torch's own call?" test, and the
location of the script line a warning is about.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable, Iterator

import torch

from hal.backend import Backend
from hal.errors import UnsupportedError
from hal.migration.mapping import _REAL_DEVICE, Patch, map_device

_MISSING = object()
# Modules whose frames are never "the script's line": hal, torch and the standard library's plumbing.
_PLUMBING = ("hal", "torch", "contextlib", "functools", "warnings", "runpy", "importlib", "typing")


class MigrationWarning(UserWarning):
    """A CUDA call the target cannot honour exactly; emitted once per name and scope, at the script's line."""

    names_script_line = True  # the CLI shows the file:line the warning is located at


class MigrationUnsupported(UnsupportedError, RuntimeError):
    """A CUDA feature with no equivalent on the target; a RuntimeError too, as CUDA's own failures are,
    so a script's ``except RuntimeError`` fallback still runs."""


def _from_torch(frame: types.FrameType | None) -> bool:
    """Whether the calling code is torch's (or hal's) own: it must keep seeing the real CUDA module."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.split(".")[0] in ("torch", "hal")


def _compiling() -> bool:
    """True only while torch.compile traces a wrapper (dynamo folds ``is_dynamo_compiling`` to True
    there; run for real it is False): frame inspection there is a graph break, so the traced
    wrapper is treated as script code. Real calls made by torch during compilation still walk."""
    probe = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)
    return bool(probe is not None and probe())


def called_by_torch(depth: int) -> bool:
    """Whether the code that called the shim's wrapper (``depth`` frames above the caller, the shim's
    own frames such as a class proxy's ``__call__`` skipped) is torch's or hal's own."""
    if _compiling():
        return False
    frame: types.FrameType | None = sys._getframe(depth + 1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(__package__ or "hal.migration"):
        frame = frame.f_back
    return _from_torch(frame)


def user_frame() -> types.FrameType | None:
    """The innermost frame outside hal, torch and the standard library's plumbing: the script's line."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] not in _PLUMBING and not frame.f_code.co_filename.startswith("<frozen"):
            return frame
        frame = frame.f_back
    return None


def warn_at_user_line(message: str, category: type[Warning] = None) -> None:  # type: ignore[assignment]
    """Emit ``message`` located at the script's line (``warnings.warn`` would name a hal file)."""
    frame = user_frame()
    category = category or MigrationWarning
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__"))


_SHIM_DIR = os.path.dirname(os.path.abspath(__file__))


def relocating_showwarning(previous: Callable[..., Any]) -> Callable[..., Any]:
    """A ``warnings.showwarning`` that moves warnings torch raises inside the shim's wrappers (their
    location is the wrapper's line) to the script's line. Costs nothing per call: only a warning
    actually shown is looked at."""

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if os.path.abspath(filename).startswith(_SHIM_DIR + os.sep):
            frame = user_frame()
            if frame is not None:
                filename, lineno, line = frame.f_code.co_filename, frame.f_lineno, None
        previous(message, category, filename, lineno, file, line)

    show.hal_relocating = True  # type: ignore[attr-defined]
    return show


_ArgSpec = tuple[frozenset[int], frozenset[str]]


def parse_arguments(spec: str) -> _ArgSpec:
    """"1|device=" -> ({1}, {"device"}): parsed once per row, not per call."""
    parts = [p for p in spec.split("|") if p]
    return (
        frozenset(int(p) for p in parts if p.isdigit()),
        frozenset(p.rstrip("=") for p in parts if p.endswith("=")),
    )


def rewrite_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], spec: _ArgSpec,
                      fn: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    positions, keywords = spec
    new_args = tuple(fn(a) if i in positions else a for i, a in enumerate(args))
    new_kwargs = {k: fn(v) if k in keywords else v for k, v in kwargs.items()}
    return new_args, new_kwargs


# --- class proxies ---------------------------------------------------------------------------
class _ProxyMeta(type):
    """A stand-in class: calling it runs the mapping; isinstance/issubclass see the real class."""

    _hal_original: type
    _hal_factory: Callable[..., Any]
    _hal_instancecheck: Callable[[Any], bool] | None

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any], **kw: Any) -> Any:
        if "_hal_original" in ns:
            return super().__new__(mcls, name, bases, ns, **kw)
        # A script subclassing the proxy gets a subclass of the real class instead.
        real = tuple(b._hal_original if isinstance(b, _ProxyMeta) else b for b in bases)
        return type(real[0])(name, real, ns, **kw)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._hal_factory(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        check = cls._hal_instancecheck
        return check(obj) if check is not None else isinstance(obj, cls._hal_original)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._hal_original)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._hal_original, name)

    # The proxy equals the real class: torch's own ``obj != torch.device`` checks (FX code generation
    # under torch.compile, among others) must hold while torch.device is the proxy.
    def __eq__(cls, other: object) -> bool:
        return other is cls or other is cls._hal_original

    def __ne__(cls, other: object) -> bool:
        return not _ProxyMeta.__eq__(cls, other)

    def __hash__(cls) -> int:
        return hash(cls._hal_original)


def class_proxy(original: type, factory: Callable[..., Any], instancecheck: Callable[[Any], bool] | None = None) -> type:
    ns = {
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
        "_hal_original": original,
        "_hal_factory": staticmethod(factory),
        "_hal_instancecheck": staticmethod(instancecheck) if instancecheck is not None else None,
    }
    return _ProxyMeta(original.__name__, (), ns)


def is_proxy(value: Any) -> bool:
    return isinstance(value, _ProxyMeta)


def replace_callable(original: Any, session: Session, impl: Callable[..., Any],
                     instancecheck: Callable[[Any], bool] | None = None) -> Any:
    """A class gets a proxy class, anything else a function; both pass through when inactive."""

    def factory(*args: Any, **kwargs: Any) -> Any:
        return impl(*args, **kwargs) if session.active else original(*args, **kwargs)

    if isinstance(original, type):
        return class_proxy(original, factory, instancecheck)
    return functools.wraps(original)(factory)


# --- the session: one active migration scope --------------------------------------------------
class Session:
    """The state a scope's wrappers share: target, warnings already given, undo stack."""

    def __init__(self, backend: Backend, device_count: int | None = None) -> None:
        self.backend = backend
        self.device_type: str = backend.device_type
        # cpu only: how many CUDA devices the script is told exist (all of them are the host).
        self.device_count = device_count
        self.active = False
        self.applied: list[Patch] = []
        self._undo: list[Callable[[], None]] = []
        self._warned: set[str] = set()
        self._ordinals: set[int] = set()
        self._local = threading.local()
        self.kept: list[Any] = []  # objects the script dropped that must outlive it (``kept_process_groups``)

    # --- warnings and re-entrancy ---------------------------------------------------------------
    def warn_once(self, key: str, message: str) -> None:
        """Warn about ``key`` once per scope, at the script's line that made the call."""
        if key in self._warned:
            return
        self._warned.add(key)
        warn_at_user_line(message)

    def unsupported(self, name: str, why: str) -> MigrationUnsupported:
        """The one-line error for a CUDA feature the target cannot run, naming the script's line."""
        frame = user_frame()
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}: " if frame is not None else ""
        return MigrationUnsupported(f"{where}{name} has no equivalent on {self.backend.name}: {why}")

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
        if self.device_type == "cpu" and "ordinal" not in self._warned:
            self._note_ordinal(value)
        return map_device(value, self.device_type, ints=ints)

    def _note_ordinal(self, value: Any) -> None:
        """On cpu every CUDA ordinal is the one host device: say so once a process uses two of them
        (model parallelism gains nothing); one ordinal per process (a DDP rank's) is exact."""
        index: int | None = None
        if isinstance(value, _REAL_DEVICE) and value.type == "cuda":
            index = value.index
        elif isinstance(value, int) and not isinstance(value, bool):
            index = value
        elif isinstance(value, str) and value.strip().startswith("cuda:") and value.strip()[5:].isdigit():
            index = int(value.strip()[5:])
        if index is None:
            return
        self._ordinals.add(index)
        if len(self._ordinals) > 1:
            shown = ", ".join(f"cuda:{i}" for i in sorted(self._ordinals))
            self.warn_once("ordinal", f"{shown} all map to the one cpu device: they share host memory and cores "
                           "(the model runs, with no model-parallel speed-up)")

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
                               "matmul mode); ignored, fp32 matmuls stay full precision")
            return
        try:
            backend.set_reduced_precision_matmul(enabled)
        except UnsupportedError as exc:
            self.warn_once(name, f"{name} = {enabled} ignored on {backend.name}: {exc}")

    # --- applying and undoing ----------------------------------------------------------------------
    def defer(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

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


def swap(owner: Any, attr: str, value: Any) -> Callable[[], None]:
    """Set ``owner.attr``; the undo puts back the owner's own entry (or removes the shadow)."""
    own = vars(owner).get(attr, _MISSING)
    setattr(owner, attr, value)

    def undo() -> None:
        if own is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)

    return undo


def cuda_function(row: Patch, session: Session, original: Any, impl: Callable[..., Any]) -> Any:
    """Wrap a CUDA-module callable: torch's own callers and re-entrant calls get the original."""

    def translated(*args: Any, **kwargs: Any) -> Any:
        if called_by_torch(2):
            return original(*args, **kwargs)
        with session.guard(row.where) as busy:
            return original(*args, **kwargs) if busy else impl(*args, **kwargs)

    return replace_callable(original, session, translated)
