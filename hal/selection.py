"""Choose the backend and devices a run uses, and say why.

``auto`` walks a fixed preference — cuda, rocm, ascend, cambricon, then third-party backends in
name order, then cpu — and takes the first whose probe says available. The reason names every
backend it passed over in one short line; why each is unavailable is ``hal devices``' per-backend line.
"""
from __future__ import annotations

from dataclasses import dataclass

from hal.backend import Backend
from hal.backend_registry import BUILTIN_ORDER, all_backends, get_backend
from hal.config import HalConfig
from hal.downgrades import set_fallback_mode
from hal.errors import BackendUnavailable, ConfigError
from hal.precision import PrecisionPlan, resolve_precision
from hal.standin import requested

BUILTIN_PREFERENCE: tuple[str, ...] = tuple(name for name in BUILTIN_ORDER if name != "cpu")  # accelerators first


def auto_preference() -> list[str]:
    """The order ``backend: auto`` tries: built-in accelerators, plug-ins by name, cpu last."""
    names = list(all_backends())
    plugins = sorted(n for n in names if n not in BUILTIN_PREFERENCE and n != "cpu")
    return [n for n in BUILTIN_PREFERENCE if n in names] + plugins + ["cpu"]


def choose_backend(name: str) -> tuple[Backend, str]:
    """The backend for ``name`` ('auto' or a backend name) and the reason it was chosen."""
    if name != "auto":
        backend = get_backend(name)
        status = backend.availability()
        if not status.available:
            raise BackendUnavailable(f"backend '{name}' is not available: {status.reason}; choose another backend (see 'hal devices')")
        return backend, f"requested explicitly; {status.reason}"
    passed: list[str] = []
    standins = requested()
    for candidate in auto_preference():
        if candidate in standins:  # a stand-in runs only where it is named
            passed.append(f"{candidate} (a stand-in: name it to use it)")
            continue
        backend = get_backend(candidate)
        status = backend.availability()
        if status.available:
            skipped = f"; passed over {', '.join(passed)} (unavailable here; 'hal devices' says why)" if passed else ""
            return backend, f"auto: first available of {' > '.join(auto_preference())}{skipped}"
        passed.append(candidate)
    raise BackendUnavailable("no backend is available, not even cpu; reinstall hetero-hal")  # pragma: no cover


@dataclass(frozen=True)
class Selection:
    backend: Backend
    devices: tuple[int, ...]
    reason: str
    precision: PrecisionPlan
    config: HalConfig

    def activate(self) -> None:
        """Make this selection current: fallback policy, current device, precision switches."""
        set_fallback_mode(self.config.fallback)  # type: ignore[arg-type]
        self.backend.set_device(self.devices[0])
        self.backend.prepare_autograd(self.devices[0])
        self.precision.apply(self.backend)


def _resolve_devices(backend: Backend, wanted: str | tuple[int, ...], origin: str) -> tuple[int, ...]:
    count = backend.device_count()
    if wanted == "all":
        return tuple(range(count))
    missing = [i for i in wanted if i >= count]
    if missing:
        raise ConfigError(
            f"{origin}: key 'devices' asks for {list(missing)} but backend '{backend.name}' has {count} device(s); "
            f"use indices 0..{count - 1}"
        )
    return tuple(wanted)


def select_backend(config: HalConfig) -> Selection:
    """Backend, devices and precision plan for ``config``; raises one clear HalError otherwise."""
    backend, reason = choose_backend(config.backend)
    devices = _resolve_devices(backend, config.devices, config.origins.get("devices", "config"))
    caps = backend.capabilities(devices[0])
    plan = resolve_precision(config.precision, backend, caps, config.fallback)  # type: ignore[arg-type]
    return Selection(backend, devices, reason, plan, config)
