"""The operator registry: named ops with a reference implementation and per-backend ones.

Callers write ``ops.rms_norm(x, w, eps)``; the registry picks the implementation for the
tensor's backend and dtype by priority (vendor fused op, Triton kernel, reference). The choice is
cached per (device type, dtype, fallback policy), so a call costs a dict lookup. When a better
implementation is registered but cannot run here (vendor op missing, Triton absent), the
registry falls back to the next one and records the downgrade under the user's fallback policy.

Implementations beyond the reference live in kernel modules (``hal.kernels.*``), each declared in the
``hal.kernels`` entry-point group as ``name = "module:register"``; this contract layer loads them from
that group, never by module name, once, before the first listing or dispatch. A kernel module that
fails to load is kept in ``load_problems()`` and warned about; the other kernels still load.
"""
from __future__ import annotations

import importlib
import threading
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable

import torch

from hal.downgrades import Downgrade, fallback_state, record_downgrade
from hal.errors import ConfigError
from hal.plugins import LoadProblem, entry_points, is_builtin, origin

KERNEL_ENTRY_POINT_GROUP = "hal.kernels"
REFERENCE = "reference"
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

Requirement = Callable[[], "str | None"]  # returns why it cannot run here, or None
BackendOf = Callable[[str], str]  # torch device type -> name of the hal backend that owns it
Contributor = Callable[["OpRegistry"], None]  # adds implementations to a registry
Contributors = Callable[[], Iterable[tuple[str, Contributor]]]  # (who, contributor) pairs


class KernelLoadWarning(UserWarning):
    """A kernel module declared in the ``hal.kernels`` entry points could not be loaded."""


@dataclass(frozen=True)
class OpImpl:
    op: str
    name: str
    fn: Callable[..., Any]
    backends: frozenset[str] | None  # None: every backend (the reference)
    dtypes: frozenset[torch.dtype] | None  # None: every dtype the op is defined for
    priority: int
    requires: Requirement | None = None
    source: str = ""

    def serves(self, backend: str, dtype: torch.dtype) -> bool:
        return (self.backends is None or backend in self.backends) and (self.dtypes is None or dtype in self.dtypes)

    def missing(self) -> str | None:
        return None if self.requires is None else self.requires()


@dataclass(frozen=True)
class Choice:
    """The implementation an op resolves to, and what was passed over on the way."""

    impl: OpImpl
    skipped: tuple[tuple[str, str], ...] = ()  # (impl name, why it cannot run)

    @property
    def is_fallback(self) -> bool:
        return bool(self.skipped)


@dataclass
class OpDef:
    name: str
    doc: str
    dispatch_arg: int  # which positional argument's device/dtype picks the implementation
    dtypes: tuple[torch.dtype, ...]
    impls: list[OpImpl] = field(default_factory=list)


class Op:
    """A callable handle for one named op; dispatches on its dispatch argument's device and dtype."""

    __slots__ = ("name", "doc", "_registry", "_arg", "_cache")

    def __init__(self, registry: OpRegistry, definition: OpDef) -> None:
        self.name = definition.name
        self._registry = registry
        self._arg = definition.dispatch_arg
        self._cache: dict[tuple[torch.device, torch.dtype, str], Callable[..., Any]] = {}
        self.doc = definition.doc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensor = args[self._arg]
        # torch.device objects hash cheaply; reading .type would build a new string each call.
        key = (tensor.device, tensor.dtype, fallback_state.mode)
        fn = self._cache.get(key)
        if fn is None:
            fn = self._registry._dispatch_target(self.name, key[0].type, key[1])
            self._cache[key] = fn
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<hal op {self.name}>"


class OpRegistry:
    """Named ops → implementations, chosen by backend, dtype and priority.

    What lies above the contract floor comes in as arguments, so this module imports neither
    backends nor kernels: ``backend_of`` maps a tensor's device type to its hal backend (dispatch),
    ``kernels`` lists the kernel entry points (default: the ``hal.kernels`` group) and
    ``contributors`` yields further (who, contributor) pairs, e.g. plug-in backends' ``register_ops``.
    """

    def __init__(
        self,
        *,
        backend_of: BackendOf | None = None,
        kernels: Callable[[], Iterable[metadata.EntryPoint]] | None = None,
        contributors: Contributors | None = None,
    ) -> None:
        self._defs: dict[str, OpDef] = {}
        self._handles: dict[str, Op] = {}
        self._lock = threading.RLock()
        self._backend_of = backend_of
        self._kernels = kernels or kernel_entry_points
        self._contributors = contributors
        self._extensions_loaded = False
        self._load_problems: tuple[LoadProblem, ...] = ()

    # --- building the registry -----------------------------------------------------------------
    def define(
        self,
        name: str,
        reference: Callable[..., Any],
        *,
        dispatch_arg: int = 0,
        dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    ) -> Op:
        """Declare an op with its reference (plain PyTorch) implementation."""
        with self._lock:
            if name in self._defs:
                raise ValueError(f"op {name!r} is already defined")
            definition = OpDef(name, (reference.__doc__ or "").strip(), dispatch_arg, tuple(dtypes))
            definition.impls.append(OpImpl(name, REFERENCE, reference, None, None, priority=0, source="PyTorch"))
            self._defs[name] = definition
            self._handles[name] = Op(self, definition)
            return self._handles[name]

    def register(
        self,
        op: str,
        name: str,
        *,
        backends: Iterable[str],
        dtypes: Iterable[torch.dtype] | None = None,
        priority: int = 10,
        requires: Requirement | None = None,
        source: str = "",
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: add ``fn`` as implementation ``name`` of ``op`` for ``backends`` (and ``dtypes``)."""

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            with self._lock:
                definition = self._definition(op)
                if any(i.name == name for i in definition.impls):
                    raise ValueError(f"op {op!r} already has an implementation named {name!r}")
                if priority <= 0:
                    raise ValueError("priority must be > 0 (0 is the reference)")
                impl = OpImpl(
                    op, name, fn, frozenset(backends), None if dtypes is None else frozenset(dtypes),
                    priority, requires, source,
                )
                definition.impls.append(impl)
                definition.impls.sort(key=lambda i: -i.priority)
                self._handles[op]._cache.clear()
            return fn

        return add

    def unregister(self, op: str, name: str) -> None:
        """Remove an implementation (used by tests that plant deliberately wrong ones)."""
        with self._lock:
            definition = self._definition(op)
            if name == REFERENCE:
                raise ValueError("the reference implementation cannot be removed")
            definition.impls = [i for i in definition.impls if i.name != name]
            self._handles[op]._cache.clear()

    # --- asking it ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        self._load_extensions()
        return list(self._defs)

    def op(self, name: str) -> Op:
        self._definition(name)
        return self._handles[name]

    def definition(self, name: str) -> OpDef:
        self._load_extensions()
        return self._definition(name)

    def implementations(self, op: str) -> list[OpImpl]:
        return list(self.definition(op).impls)

    def reference(self, op: str) -> Callable[..., Any]:
        """The op's reference (plain PyTorch) implementation: what a kernel runs instead where it cannot serve an
        input (and records the downgrade). Loads no kernel module, so a kernel module may ask while it loads."""
        return next(impl.fn for impl in self._definition(op).impls if impl.name == REFERENCE)

    def choose(self, op: str, backend: str, dtype: torch.dtype) -> Choice:
        """The implementation ``op`` uses on ``backend`` for ``dtype`` — no policy applied."""
        definition = self.definition(op)
        skipped: list[tuple[str, str]] = []
        for impl in definition.impls:
            if not impl.serves(backend, dtype):
                continue
            why_not = impl.missing()
            if why_not is None:
                return Choice(impl, tuple(skipped))
            skipped.append((impl.name, why_not))
        raise AssertionError("the reference serves every backend and dtype")  # pragma: no cover

    def select(self, op: str, backend: str, dtype: torch.dtype) -> OpImpl:
        """Like ``choose``, but a fallback goes through the fallback policy (error/warn/allow)."""
        choice = self.choose(op, backend, dtype)
        if choice.is_fallback:
            wanted, why = choice.skipped[0]
            record_downgrade(
                Downgrade("op", f"{op} on {backend}/{_dtype_name(dtype)}", wanted, choice.impl.name, why)
            )
        return choice.impl

    def load_problems(self) -> tuple[LoadProblem, ...]:
        """Kernel modules (and contributors) that failed to load, in load order."""
        self._load_extensions()
        return self._load_problems

    def _dispatch_target(self, op: str, device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
        if self._backend_of is None:
            raise ConfigError("this op registry was built without backend_of: it cannot dispatch on a tensor's device")
        return self.select(op, self._backend_of(device_type), dtype).fn

    def clear_caches(self) -> None:
        for handle in self._handles.values():
            handle._cache.clear()

    # --- internals --------------------------------------------------------------------------
    def _definition(self, op: str) -> OpDef:
        try:
            return self._defs[op]
        except KeyError:
            raise ConfigError(f"unknown op {op!r}; known ops: {', '.join(self._defs)}") from None

    def _load_extensions(self) -> None:
        """Let every kernel module, then every contributor, add its implementations, once, on first use."""
        if self._extensions_loaded:
            return
        with self._lock:
            if self._extensions_loaded:
                return
            self._extensions_loaded = True
            problems = list(load_kernels(self, self._kernels()))
            for who, contribute in self._contributors() if self._contributors else ():
                try:
                    contribute(self)
                except Exception as exc:  # one broken plug-in must not take the registry down
                    problems.append(LoadProblem(who, who, f"failed to register ops: {type(exc).__name__}: {exc}"))
            for problem in problems:
                warnings.warn(f"{problem.name}: {problem.reason} ({problem.origin})", KernelLoadWarning, stacklevel=3)
            self._load_problems = tuple(problems)


def kernel_entry_points() -> list[metadata.EntryPoint]:
    """The ``hal.kernels`` group: hetero-hal's own kernel modules first, then third parties', by name."""
    return sorted(entry_points(KERNEL_ENTRY_POINT_GROUP), key=lambda ep: (not is_builtin(ep), ep.name))


def load_kernels(registry: OpRegistry, points: Iterable[metadata.EntryPoint]) -> list[LoadProblem]:
    """Import each kernel module and call its ``register(registry)``; a failure becomes a LoadProblem."""
    problems: list[LoadProblem] = []
    for ep in points:
        try:
            module_name, _, attr = ep.value.partition(":")
            register = getattr(importlib.import_module(module_name), attr)
            if not callable(register):
                raise TypeError(f"{ep.value} is not callable")
            register(registry)
        except Exception as exc:  # a broken kernel module must not break every op for everyone
            problems.append(LoadProblem(ep.name, origin(ep), f"failed to load: {type(exc).__name__}: {exc}"))
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
