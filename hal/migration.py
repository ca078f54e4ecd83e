"""Run an unmodified CUDA-written script on another backend (``hal run --backend X script.py``).

Modelled on Ascend's ``transfer_to_npu`` and Cambricon's ``gpu_migration``, which patch torch
once, globally and for good. This shim differs on purpose:

* **Scoped.** ``migrate(backend)`` patches on enter and restores every attribute on exit, even on
  error; a wrapper that leaks out (a module-level alias) is a pass-through once the scope ends.
* **Table-driven.** ``MAPPING`` lists every patched target; the code below only interprets it.
* **Never changes a dtype.** fp64 stays fp64 (no ``DoubleTensor -> FloatTensor``); CUDA autocast
  keeps CUDA's fp16 default on targets whose own default is bf16.
* **Only the script is translated.** torch's own modules keep seeing the real CUDA module (the
  ``is_cuda``/``is_available`` answers of the CUDA build), so torch never takes a CUDA-only path
  for a host tensor; libraries outside torch are translated like the script.

For a backend whose torch device type is already ``cuda`` (cuda, rocm) nothing differs: the
script's CUDA module is the backend's own, the CCL stays ``nccl`` (RCCL answers to that name) and
HIP honours ``CUDA_VISIBLE_DEVICES`` itself (renaming it would apply the mask twice). ``plan``
is then empty and ``migrate`` patches nothing.

The CUDA module is named only through strings ("cuda.synchronize") and ``getattr`` so that hal's
rule — no direct use of the CUDA module in hal/ — stays checkable by grep. While a scope is
active the patches are process-wide (module attributes), so every thread sees them.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import inspect
import logging
import os
import re
import runpy
import sys
import threading
import traceback
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .backend import Backend
from .errors import HalError, UnsupportedError

__all__ = [
    "MAPPING",
    "CudaLocationMap",
    "Kind",
    "MigrationWarning",
    "Patch",
    "map_ccl",
    "map_device",
    "migrate",
    "plan",
    "rewrite_map_location",
    "run_script",
]

_log = logging.getLogger("hal.migration")

CUDA = "cuda"
_CUDA_STRING = re.compile(r"\s*cuda(?::(\d+))?\s*")
_MISSING = object()
# The real classes, taken from paths the shim never patches.
_REAL_DEVICE: type = torch._C.device
_REAL_AUTOCAST: type = torch.amp.autocast_mode.autocast


class MigrationWarning(UserWarning):
    """A CUDA call the target cannot honour exactly; emitted once per name and scope."""


class Kind(str, enum.Enum):
    DEVICE_FUNCTION = "device-function"  # CUDA-module function -> backend method ``to``
    DEVICE_ARGUMENT = "device-argument"  # rewrite CUDA device arguments named in ``args``
    CCL_NAME = "ccl-name"  # rewrite "nccl" in ``args`` -> backend.process_group_backend()
    ENV_VAR = "env-var"  # copy a CUDA env var to the backend's name for it
    NO_EQUIVALENT = "no-equivalent"  # warn once, then call the CUDA original
    ADAPTER = "adapter"  # a hal adapter named by ``to`` (device class, autocast, torch.load...)


@dataclass(frozen=True)
class Patch:
    """One patched target. ``where`` is a dotted path under ``torch`` or ``env:NAME``.

    ``args`` names the arguments that carry a device or CCL name: ``"1|device="`` is position 1
    (counting ``self`` for methods) or keyword ``device``. For DEVICE_FUNCTION it lists the CUDA
    parameter names passed, in order, to the backend method (``device`` becomes an index), and
    a ``note`` there marks an approximation that is warned about once.
    """

    where: str
    kind: Kind
    to: str = ""
    args: str = ""
    note: str = ""

    @property
    def name(self) -> str:
        """What a user wrote: ``torch.<where>`` or the env var."""
        return self.where[4:] if self.is_env else f"torch.{self.where}"

    @property
    def is_env(self) -> bool:
        return self.where.startswith("env:")


def _fn(name: str, to: str | None = None, args: str = "", note: str = "") -> Patch:
    return Patch(f"{CUDA}.{name}", Kind.DEVICE_FUNCTION, to or name, args, note)


def _dev(where: str, args: str = "device=") -> Patch:
    return Patch(where, Kind.DEVICE_ARGUMENT, "target device", args)


def _adapter(where: str, adapter: str, note: str) -> Patch:
    return Patch(where, Kind.ADAPTER, adapter, note=note)


_MAX_RESERVED_NOTE = "peak allocated bytes: equal to the peak reserved on cpu (both peak RSS), a lower bound elsewhere"

# Factories that take device= (transfer_to_npu's and gpu_migration's lists, public names only).
_FACTORIES: tuple[str, ...] = (
    "tensor", "as_tensor", "asarray", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
    "empty_strided", "empty_permuted", "full", "full_like", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "arange", "range", "linspace", "logspace", "eye", "normal",
    "scalar_tensor", "tril_indices", "triu_indices", "from_file", "sparse_coo_tensor", "sparse_csr_tensor",
    "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor", "sparse_compressed_tensor",
    "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
)  # fmt: skip
_NEW_METHODS: tuple[str, ...] = ("new_tensor", "new_empty", "new_empty_strided", "new_full", "new_ones", "new_zeros")

_EXPLICIT: tuple[Patch, ...] = (
    # --- the CUDA module: functions with a backend equivalent ------------------------------------
    _fn("is_available"),
    _fn("device_count"),
    _fn("set_device", args="device"),
    _fn("current_device"),
    _fn("get_device_name", "device_name", "device"),
    _fn("synchronize", args="device"),
    _fn("manual_seed", args="seed"),
    _fn("manual_seed_all", args="seed"),
    _fn("get_rng_state", args="device"),
    _fn("set_rng_state", args="new_state,device"),
    _fn("memory_allocated", args="device"),
    _fn("max_memory_allocated", args="device"),
    _fn("memory_reserved", args="device"),
    _fn("max_memory_reserved", "max_memory_allocated", "device", _MAX_RESERVED_NOTE),
    _fn("memory_cached", "memory_reserved", "device"),
    _fn("max_memory_cached", "max_memory_allocated", "device", _MAX_RESERVED_NOTE),
    _fn("reset_peak_memory_stats", args="device"),
    _fn("reset_max_memory_allocated", "reset_peak_memory_stats", "device"),
    _fn("reset_max_memory_cached", "reset_peak_memory_stats", "device"),
    _fn("empty_cache"),
    _fn("mem_get_info", args="device"),
    _fn("Stream", args="device"),  # a priority hint is not carried over
    _fn("Event", args="enable_timing"),
    _fn("stream", args="stream"),
    _fn("current_stream", args="device"),
    _fn("is_bf16_supported", "native:bf16"),
    _fn("is_tf32_supported", "native:tf32"),
    _adapter(f"{CUDA}.device", "device_context", "context manager -> backend.set_device / restore"),
    # --- autocast and loss scaling (dtype made explicit: CUDA's fp16 default) ---------------------
    _adapter(f"{CUDA}.amp.autocast", "cuda_autocast", "torch.autocast(target, dtype=float16 unless given)"),
    _adapter(f"{CUDA}.amp.GradScaler", "cuda_grad_scaler", "backend.grad_scaler(...)"),
    _adapter("autocast", "autocast", "device_type cuda -> target; dtype None -> CUDA's autocast dtype"),
    _adapter("amp.autocast", "autocast", "device_type cuda -> target; dtype None -> CUDA's autocast dtype"),
    _adapter("amp.GradScaler", "grad_scaler", "device 'cuda' (the default) -> backend.grad_scaler(...)"),
    _adapter("backends.cuda.matmul", "tf32_switch", "allow_tf32 -> backend.set_reduced_precision_matmul"),
    # --- devices ------------------------------------------------------------------------------
    _adapter("device", "device_class", "class proxy: cuda / cuda:N / int N -> target; isinstance kept"),
    _dev("Generator", "0|device="),
    _dev("set_default_device", "0|device="),
    *(_dev(name) for name in _FACTORIES),
    _adapter("load", "map_location", "map_location rewritten; None -> cuda locations map to the target"),
    _dev("Tensor.to", "1|device="),
    *(_dev(f"Tensor.{name}") for name in _NEW_METHODS),
    _adapter(f"Tensor.{CUDA}", "tensor_to_target", "-> Tensor.to(target)"),
    _adapter(f"Tensor.is_{CUDA}", "is_target", "-> tensor is on the target device type (torch's own code sees the truth)"),
    _adapter("Tensor.pin_memory", "pin_memory", "cpu: a plain host copy; elsewhere device argument rewritten"),
    _dev("nn.Module.to", "1|device="),
    _dev("nn.Module.to_empty", "device="),
    _adapter(f"nn.Module.{CUDA}", "module_to_target", "-> Module.to(target)"),
    _adapter("nn.parallel.DistributedDataParallel.__init__", "ddp_devices", "device_ids/output_device: None on cpu"),
    # --- distributed --------------------------------------------------------------------------
    Patch("distributed.init_process_group", Kind.CCL_NAME, "backend.process_group_backend()", "0|backend="),
    Patch("distributed.new_group", Kind.CCL_NAME, "backend.process_group_backend()", "2|backend="),
    # --- environment variables (read when the runtime initialises) -------------------------------
    Patch("env:CUDA_VISIBLE_DEVICES", Kind.ENV_VAR, "backend.visible_devices_env"),
    Patch("env:PYTORCH_CUDA_ALLOC_CONF", Kind.ENV_VAR, "PYTORCH_{DEVICE}_ALLOC_CONF"),
)


def _resolve(where: str) -> tuple[Any, str]:
    """(owner, attribute) for a dotted path under torch; imports submodules torch loads lazily."""
    *path, attr = where.split(".")
    owner: Any = torch
    for i, part in enumerate(path):
        if not hasattr(owner, part):
            importlib.import_module("torch." + ".".join(path[: i + 1]))
        owner = getattr(owner, part)
    return owner, attr


def _exists(row: Patch) -> bool:
    if row.is_env:
        return True
    try:
        owner, attr = _resolve(row.where)
    except (ImportError, AttributeError):
        return False
    return hasattr(owner, attr)


def _unmapped_cuda_functions(explicit: tuple[Patch, ...]) -> tuple[Patch, ...]:
    """Every other public function of the CUDA module: warn once, call the original.

    Classes (CUDAGraph, legacy ``FloatTensor`` types, ...) are left alone: a wrapper would break
    ``isinstance`` checks, and they cannot be built on a non-CUDA target anyway.
    """
    module = getattr(torch, CUDA)
    known = {row.where for row in explicit}
    names = sorted(getattr(module, "__all__", ()))
    return tuple(
        Patch(f"{CUDA}.{name}", Kind.NO_EQUIVALENT, "CUDA original")
        for name in names
        if f"{CUDA}.{name}" not in known and isinstance(getattr(module, name, None), types.FunctionType)
    )


MAPPING: tuple[Patch, ...] = tuple(
    row for row in _EXPLICIT + _unmapped_cuda_functions(_EXPLICIT) if _exists(row)
)


def plan(backend: Backend) -> tuple[Patch, ...]:
    """The rows ``migrate(backend)`` applies: none for a cuda-type backend (nothing differs)."""
    return () if backend.device_type == CUDA else MAPPING


# --- pure mapping helpers (unit-testable without a session) ------------------------------------
def _target_spec(device_type: str, index: int | None) -> str:
    """cuda:N -> <target>:N; the host has one device, so every ordinal becomes plain "cpu"."""
    if device_type == "cpu" or index is None:
        return device_type
    return f"{device_type}:{index}"


def map_device(value: Any, device_type: str, *, ints: bool = True) -> Any:
    """Rewrite a CUDA device (string, torch.device, or an ordinal when ``ints``) to ``device_type``.

    Strings stay strings and devices stay devices; anything that is not a CUDA device (dtypes,
    tensors, "cpu", "meta") is returned unchanged.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and ints:
        return _REAL_DEVICE(_target_spec(device_type, value))
    if isinstance(value, str):
        match = _CUDA_STRING.fullmatch(value)
        if match is None:
            return value
        return _target_spec(device_type, None if match.group(1) is None else int(match.group(1)))
    if isinstance(value, _REAL_DEVICE) and value.type == CUDA:
        return _REAL_DEVICE(_target_spec(device_type, value.index))
    return value


def map_ccl(name: Any, backend: Backend) -> Any:
    """"nccl" -> the backend's process-group string; "cuda:nccl" pairs -> "<type>:<ccl>"."""
    if not isinstance(name, str) or "nccl" not in name.lower():
        return name
    if ":" not in name:
        return backend.process_group_backend()
    parts: list[str] = []
    for pair in (p.strip() for p in name.split(",") if p.strip()):
        _, _, ccl = pair.partition(":")
        if ccl.strip().lower() == "nccl":
            if backend.device_type == "cpu":
                continue  # host tensors are served by the cpu:gloo part
            pair = f"{backend.device_type}:{backend.ccl}"
        parts.append(pair)
    return ",".join(parts) if parts else backend.process_group_backend()


class CudaLocationMap(dict):
    """A ``map_location`` dict that also sends every unlisted CUDA location tag to the target.

    Keys are the *saved* location tags, so they are never rewritten (transfer_to_npu rewrites
    them, which stops ``{"cuda:1": "cuda:0"}`` from matching anything); values are.
    """

    def __init__(self, entries: dict[str, Any], device_type: str) -> None:
        super().__init__({key: _location(map_device(value, device_type, ints=False)) for key, value in entries.items()})
        self.device_type = device_type

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        mapped = map_device(key, self.device_type, ints=False)
        return mapped if mapped != key else default


def _location(value: Any) -> Any:
    return str(value) if isinstance(value, _REAL_DEVICE) else value


def rewrite_map_location(map_location: Any, device_type: str) -> Any:
    """The ``map_location`` that loads a CUDA-saved checkpoint onto ``device_type``."""
    if map_location is None or isinstance(map_location, dict):
        return CudaLocationMap(map_location or {}, device_type)
    if isinstance(map_location, bytes):
        map_location = map_location.decode()
    if isinstance(map_location, (str, _REAL_DEVICE)):
        return map_device(map_location, device_type, ints=False)
    if callable(map_location):
        return _fallback_restore(map_location, device_type)
    return map_location


def _fallback_restore(fn: Callable[[Any, str], Any], device_type: str) -> Callable[[Any, str], Any]:
    """A callable map_location returning None means "default restore" — which would target CUDA."""

    @functools.wraps(fn)
    def restore(storage: Any, location: str) -> Any:
        result = fn(storage, location)
        if result is None:
            target = map_device(location, device_type, ints=False)
            result = torch.serialization.default_restore_location(storage, target)
        return result

    return restore


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


# --- running a script ----------------------------------------------------------------------------
def run_script(backend: Backend, path: str, argv: list[str]) -> int:
    """Run ``path`` as ``__main__`` under ``migrate(backend)``; its exit code, like ``python path``.

    hal errors (e.g. the backend is unavailable) propagate for the CLI to print as one line;
    any other uncaught exception prints its traceback and gives 1, as Python does.
    """
    script = os.path.abspath(path)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(script))
    try:
        with migrate(backend):
            backend.require_available()
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc.code)
    except HalError:
        raise
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        sys.stdout.flush()
        sys.stderr.flush()


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
