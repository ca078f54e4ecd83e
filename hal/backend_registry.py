"""Which backends exist: the built-in five and third-party ones, all from the ``hal.backends`` entry points.

A third-party vendor ships a distribution whose metadata declares, e.g.::

    [project.entry-points."hal.backends"]
    myvendor = "myvendor_hal:MyVendorBackend"

and ``hal devices`` lists it, ``backend: myvendor`` selects it — no change to this repository.
"""
from __future__ import annotations

import functools
import importlib
from importlib import metadata

from hal.backend import Backend
from hal.errors import ConfigError
from hal.plugins import BUILTIN_DISTRIBUTION, LoadProblem, entry_points, is_builtin, origin

ENTRY_POINT_GROUP = "hal.backends"


def _load_class(target: str) -> type[Backend]:
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{target} is not a hal.backend.Backend subclass")
    return cls


BUILTIN_ORDER: tuple[str, ...] = ("cpu", "cuda", "rocm", "ascend", "cambricon")
"""The built-in backends, the one list of their names: listing order, and after cpu, the order ``backend: auto``
tries them (hal.selection). pyproject.toml's ``hal.backends`` entry points declare the same five."""


def _builtin_rank(ep: metadata.EntryPoint) -> tuple[int, str]:
    return (BUILTIN_ORDER.index(ep.name) if ep.name in BUILTIN_ORDER else len(BUILTIN_ORDER), ep.name)


@functools.lru_cache(maxsize=1)
def _discover() -> tuple[dict[str, Backend], tuple[LoadProblem, ...]]:
    """Built-ins and plug-ins both arrive through the entry-point group: this contract layer never
    imports a vendor module by name (hetero-hal's own distribution declares the built-in five)."""
    points = entry_points(ENTRY_POINT_GROUP)
    builtins = sorted((ep for ep in points if is_builtin(ep)), key=_builtin_rank)
    if not builtins:
        raise ConfigError(
            f"no built-in backends registered: the '{ENTRY_POINT_GROUP}' entry points of {BUILTIN_DISTRIBUTION} "
            "are missing; install the package (pip install -e .) instead of running it from the source tree"
        )
    builtin_names = {ep.name: ep.value for ep in builtins}
    found: dict[str, Backend] = {ep.name: _load_class(ep.value)() for ep in builtins}
    problems: list[LoadProblem] = []
    for ep in sorted((ep for ep in points if not is_builtin(ep)), key=lambda e: e.name):
        where = origin(ep)
        if ep.name in builtin_names:
            if ep.value != builtin_names[ep.name]:
                problems.append(LoadProblem(ep.name, where, f"ignored: '{ep.name}' is a built-in backend name"))
            continue
        try:
            instance = _load_class(ep.value)()
        except Exception as exc:  # a broken plug-in must not break hal for everyone else
            problems.append(LoadProblem(ep.name, where, f"failed to load: {type(exc).__name__}: {exc}"))
            continue
        if instance.name != ep.name:
            problems.append(LoadProblem(ep.name, where, f"ignored: class declares name {instance.name!r}"))
            continue
        found[ep.name] = instance
    return found, tuple(problems)


def all_backends() -> dict[str, Backend]:
    """Every registered backend by name, built-ins first (a shared instance per name)."""
    return dict(_discover()[0])


def load_problems() -> tuple[LoadProblem, ...]:
    return _discover()[1]


def backend_names() -> list[str]:
    return list(_discover()[0])


def get_backend(name: str) -> Backend:
    """The backend called ``name``; a ConfigError lists the known names otherwise."""
    backends = _discover()[0]
    if name not in backends:
        raise ConfigError(f"unknown backend {name!r}; use one of: auto, {', '.join(backends)}")
    return backends[name]


@functools.cache
def backend_for_device_type(device_type: str) -> Backend:
    """The backend that owns tensors of ``device_type`` in this process.

    Several backends may share a torch device type (``cuda`` on CUDA and on ROCm builds): the
    available one wins; with none available, the first registered.
    """
    candidates = [b for b in _discover()[0].values() if b.device_type == device_type]
    if not candidates:
        raise ConfigError(f"no hal backend handles torch device type {device_type!r}")
    for backend in candidates:
        if backend.is_available():
            return backend
    return candidates[0]


def reset_for_tests() -> None:
    """Forget discovered backends (tests that install a plug-in distribution call this)."""
    _discover.cache_clear()
    backend_for_device_type.cache_clear()
