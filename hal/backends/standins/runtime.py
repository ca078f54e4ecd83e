"""A vendor runtime's Python surface over the stand-in device: the ``torch.npu`` / ``torch.mlu`` device module
(torch.cuda's shape, as torch_npu and torch_mlu mirror it) and the package module that holds it.

The calls answer from ``host_device.state()``: device count and names from the stand-in's model, the current
device, memory that counts the stand-in's own bytes (``DeviceState.hold``), streams and events without a queue,
and the host's generator as the device's (no device generator from Python: the CPU run's draws).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import host_device
from .ccl import register_ccl
from .host_device import STANDIN_NOTE, DeviceState, Event, Limits, Stream


@dataclass(frozen=True)
class Model:
    """One device model a stand-in can be: the name its runtime reports, its memory and generation."""

    name: str  # as torch.<device>.get_device_name() reports it (the catalog's ``match`` finds it)
    memory_gb: int
    major: int = 0  # torch_mlu's get_device_properties().major (MLU500+: 5)
    minor: int = 0


@dataclass(frozen=True)
class Vendor:
    """A stand-in runtime: the vendor backend it serves, the package it stands for and what its device is."""

    backend: str  # ascend | cambricon
    package: str  # torch_npu | torch_mlu
    device_type: str  # npu | mlu
    models: dict[str, Model]  # by the name a user gives (HAL_STANDIN=cambricon:MLU370-X8), the first the default
    limits: Limits
    ccl: str  # hccl | cncl: the process-group backend name registered for the device
    ccl_lacks: frozenset[str]  # collectives the library does not have (HCCL: gather, scatter)
    ccl_no_reduce: frozenset[torch.dtype]  # dtypes its reductions refuse
    extend: Callable[[types.ModuleType, types.ModuleType, Model], None]  # the vendor's extras (switches, fused ops)

    def model(self, name: str | None) -> Model:
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise KeyError(name)
        return self.models[name]


def device_module(vendor: Vendor, model: Model) -> types.ModuleType:
    """``torch.<device_type>``: torch.cuda's calls over the stand-in device."""
    dev = types.ModuleType(f"{vendor.package}.{vendor.device_type}")
    dev.__doc__ = f"torch.{vendor.device_type} of the {vendor.package} stand-in ({STANDIN_NOTE})"
    dev.standin = STANDIN_NOTE  # what the backend says of it (``DeviceModuleBackend.standin``)
    state = host_device.state
    dev.host_transfer_bytes = lambda: state().to_host_bytes  # what DeviceModuleBackend.host_transfer_bytes reads

    def check(index: Any) -> int:
        chosen = host_device._index(index)
        if not 0 <= chosen < state().count:
            raise RuntimeError(f"{vendor.device_type}:{chosen} is not a device of this stand-in "
                               f"({state().count} devices; HAL_STANDIN_COUNT sets them)")
        return chosen

    def set_device(index: Any) -> None:
        state().current = check(index)

    def properties(index: Any = None) -> Any:
        check(index)
        return types.SimpleNamespace(name=model.name, total_memory=model.memory_gb * 2**30, major=model.major,
                                     minor=model.minor, multi_processor_count=1, standin=STANDIN_NOTE)

    def mem_get_info(index: Any = None) -> tuple[int, int]:
        total = model.memory_gb * 2**30
        return total - state().allocated[check(index)], total

    def reset_peak(index: Any = None) -> None:
        i = check(index)
        state().peak[i] = state().allocated[i]

    @contextlib.contextmanager
    def device(index: Any) -> Iterator[None]:
        before = state().current
        set_device(index)
        try:
            yield
        finally:
            state().current = before

    calls: dict[str, Any] = {
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": lambda: None,
        "_is_in_bad_fork": lambda: False, "init": lambda: None,
        "device_count": lambda: state().count, "current_device": lambda: state().current, "set_device": set_device,
        "device": device, "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: properties(device).name, "get_device_properties": properties,
        "get_device_capability": lambda device=None: (model.major, model.minor),
        "Stream": Stream, "Event": Event, "current_stream": host_device.current_stream,
        "default_stream": host_device.current_stream, "stream": host_device.stream_context,
        "memory_allocated": lambda device=None: state().allocated[check(device)],
        "max_memory_allocated": lambda device=None: state().peak[check(device)],
        "memory_reserved": lambda device=None: state().allocated[check(device)],
        "max_memory_reserved": lambda device=None: state().peak[check(device)],
        "reset_peak_memory_stats": reset_peak, "reset_max_memory_allocated": reset_peak,
        "mem_get_info": mem_get_info, "empty_cache": lambda: None,
        # the host's generator is the device's (torch.manual_seed calls manual_seed_all: seeding the generator
        # itself, not through torch.manual_seed, keeps that from going round)
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "seed": lambda: torch.default_generator.seed(), "initial_seed": lambda: torch.default_generator.initial_seed(),
        "get_rng_state": lambda device=None: torch.get_rng_state(),
        "set_rng_state": lambda new_state, device=None: torch.set_rng_state(new_state),
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        "is_bf16_supported": lambda: True,
    }
    for name, fn in calls.items():
        setattr(dev, name, fn)
    return dev


def package_module(vendor: Vendor, model: Model, dev: types.ModuleType) -> types.ModuleType:
    """The importable package (``torch_npu`` / ``torch_mlu``) holding the device module, marked a stand-in."""
    package = types.ModuleType(vendor.package)
    package.__doc__ = f"{vendor.package} stand-in over host memory ({STANDIN_NOTE}): hal.backends.standins"
    package.__version__ = "0.0+standin"
    package.__spec__ = importlib.machinery.ModuleSpec(vendor.package, None)
    package.__path__ = []  # a package: ``import torch_npu.npu`` finds the submodule in sys.modules
    package.STANDIN = STANDIN_NOTE
    setattr(package, vendor.device_type, dev)
    dev.__spec__ = importlib.machinery.ModuleSpec(dev.__name__, None)
    vendor.extend(package, dev, model)
    return package


def register(vendor: Vendor, model: Model, count: int) -> types.ModuleType:
    """Install the stand-in device for ``vendor`` in this process and make its package importable; the package."""
    state = DeviceState(vendor.backend, vendor.device_type, count, model.memory_gb * 2**30, vendor.limits)
    host_device._STATE = state
    dev = device_module(vendor, model)
    host_device.install(state, dev)
    package = package_module(vendor, model, dev)
    register_ccl(vendor.ccl, vendor.device_type, vendor.ccl_lacks, vendor.ccl_no_reduce)
    sys.modules[vendor.package] = package
    sys.modules[dev.__name__] = dev
    return package


__all__ = ["Model", "Vendor", "device_module", "package_module", "register"]
