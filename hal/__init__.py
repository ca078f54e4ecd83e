"""hetero-hal: one PyTorch training code base on CUDA, ROCm/DCU, Ascend, Cambricon and CPU.

Start here: ``hal.get_backend("cpu")``, ``hal.select_backend(config)``, ``hal.ops.rms_norm(...)``,
``hal.migration.migrate(backend)``. The ``hal`` command line (``hal devices``, ``hal ops``, ``hal run``)
is built on the same functions.
"""
from __future__ import annotations

from .backend import NOT_VERIFIED, Availability, Backend
from .backend_registry import all_backends, backend_names, get_backend
from .capabilities import DeviceCapabilities, DtypeSupport
from .downgrades import Downgrade, fallback_policy, recorded_downgrades
from .errors import BackendUnavailable, ConfigError, FallbackRefused, HalError, UnsupportedError

__version__ = "0.1.0"

__all__ = [
    "NOT_VERIFIED",
    "Availability",
    "Backend",
    "BackendUnavailable",
    "ConfigError",
    "DeviceCapabilities",
    "Downgrade",
    "DtypeSupport",
    "FallbackRefused",
    "HalError",
    "UnsupportedError",
    "all_backends",
    "backend_names",
    "fallback_policy",
    "get_backend",
    "recorded_downgrades",
]
