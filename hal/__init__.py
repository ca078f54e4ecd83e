"""hetero-hal: one PyTorch training code base on CUDA, ROCm/DCU, Ascend, Cambricon and CPU.

Start here: ``hal.get_backend("cpu")``, ``hal.selection.select_backend(config)``, ``hal.ops.rms_norm(...)``,
``hal.migration.migrate(backend)``. The ``hal`` command line (``hal devices``, ``hal ops``, ``hal run``)
is built on the same functions. The names below load on first use, so ``import hal`` (and
``hal --help``) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from hal.errors import BackendUnavailable, ConfigError, FallbackRefused, HalError, UnsupportedError  # noqa: F401  (re-exported)

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "NOT_VERIFIED": ".backend",
    "Availability": ".backend",
    "Backend": ".backend",
    "all_backends": ".backend_registry",
    "backend_names": ".backend_registry",
    "get_backend": ".backend_registry",
    "DeviceCapabilities": ".capabilities",
    "DtypeSupport": ".capabilities",
    "Downgrade": ".downgrades",
    "fallback_policy": ".downgrades",
    "recorded_downgrades": ".downgrades",
}

__all__ = sorted([*_LAZY, "BackendUnavailable", "ConfigError", "FallbackRefused", "HalError", "UnsupportedError"])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
