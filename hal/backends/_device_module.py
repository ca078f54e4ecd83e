"""Shared machinery for backends driven through a ``torch.<x>`` device module.

``torch.cuda`` (CUDA and ROCm/HIP builds), ``torch.npu`` (torch_npu) and ``torch.mlu``
(torch_mlu) expose the same function names, so one class delegates to whichever module the
subclass loads. Subclasses supply identity, how to load the module (lazily, importing the vendor
package only there), and the vendor-specific switches (reduced-precision matmul, determinism,
probed dtype facts).
"""
from __future__ import annotations

import abc
import os
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager

import torch

from hal.backend import Availability, Backend
from hal.capabilities import DeviceCapabilities, ProbedFacts, lookup, merge
from hal.errors import BackendUnavailable, UnsupportedError

if TYPE_CHECKING:
    from .standins.elsewhere import Answers


class RuntimeMissing(Exception):
    """Raised by ``_load_module`` with the human reason the vendor runtime cannot be used."""


class RuntimeElsewhere(RuntimeMissing):
    """Raised by ``_load_module`` where another vendor runtime owns this process's PrivateUse1 device: the runtime
    asked for runs in other processes (one vendor runtime per process)."""


_ANSWERED_ELSEWHERE: weakref.WeakSet[DeviceModuleBackend] = weakref.WeakSet()


def _forget_elsewhere_answers() -> None:
    """In a forked child (a rank forked from its launcher): a runtime the parent asked a child about may load here."""
    for backend in list(_ANSWERED_ELSEWHERE):
        backend._elsewhere, backend._availability = None, None
    _ANSWERED_ELSEWHERE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_elsewhere_answers)


class DeviceModuleBackend(Backend):
    """A backend whose device API is a ``torch.cuda``-shaped module."""

    # The device module's graph class and capture context (torch.cuda.CUDAGraph / torch.cuda.graph); None: none.
    graph_names: ClassVar[tuple[str, str] | None] = None
    # The torch.profiler.ProfilerActivity member that records this device's kernels (CUDA, MLU ...).
    profiler_activity: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._availability: Availability | None = None
        self._module: ModuleType | None = None
        self._elsewhere: tuple[Answers, str] | None = None  # a child's answers, and why the device is not here

    # --- what subclasses provide --------------------------------------------------------------
    @abc.abstractmethod
    def _load_module(self) -> ModuleType:
        """Import the vendor runtime (lazily) and return its device module, or raise RuntimeMissing."""

    def _probe_facts(self, index: int) -> ProbedFacts:
        """Facts measured on the device; subclasses add dtype facts they can read off the device."""
        mod = self._mod()
        total = None
        try:
            total = int(mod.get_device_properties(index).total_memory)
        except Exception:  # some vendor modules lack get_device_properties; catalog memory then applies
            total = None
        standin = f" ({self.standin})" if self.standin else ""
        return ProbedFacts(name=self.device_name(index), total_memory_bytes=total,
                           how=f"probed via torch.{self.device_type}{standin}")

    # --- discovery ----------------------------------------------------------------------------
    def availability(self) -> Availability:
        if self._availability is None:
            self._availability = self._probe()
        return self._availability

    def _probe(self) -> Availability:
        try:
            mod = self._load_module()
        except RuntimeElsewhere as exc:  # answered by a child that holds the runtime; the device stays over there
            return self._probe_elsewhere(str(exc))
        except RuntimeMissing as exc:
            return Availability(False, str(exc))
        try:
            count = int(mod.device_count())
        except Exception as exc:  # driver missing, runtime init failure
            return Availability(False, f"torch.{self.device_type}.device_count() failed: {_one_line(exc)}")
        if count == 0:
            env = self.visible_devices_env
            shown = f"{env}={os.environ[env]!r}" if env and env in os.environ else f"{env} unset"
            return Availability(False, f"the {self.vendor} runtime loaded but sees no device ({shown})")
        try:  # a real probe: allocate, compute, synchronize on device 0
            probe = torch.ones(4, device=torch.device(self.device_type, 0))
            ok = float((probe * 2).sum().item()) == 8.0
            mod.synchronize()
        except Exception as exc:
            return Availability(False, f"device probe on {self.device_type}:0 failed: {_one_line(exc)}")
        if not ok:
            return Availability(False, f"device probe on {self.device_type}:0 computed a wrong result")
        self._module = mod
        names = sorted({self._safe_name(mod, i) for i in range(count)})
        standin = f" ({self.standin})" if self.standin else ""
        return Availability(True, f"{count} device(s): {', '.join(names)}{standin}")

    def _probe_elsewhere(self, why: str) -> Availability:
        """Availability, devices, capabilities and memory as a child process holding the runtime sees them
        (``standins.elsewhere``): a launcher checks every stage before its ranks start; using the device here is
        refused by ``_mod`` with ``why``."""
        from .standins.elsewhere import probe

        answers = probe(self.name)
        if not answers.available:
            return Availability(False, answers.reason)
        self._elsewhere = (answers, why)
        _ANSWERED_ELSEWHERE.add(self)
        return Availability(True, f"{answers.reason}, probed in a child process ({why})")

    @staticmethod
    def _safe_name(mod: ModuleType, index: int) -> str:
        try:
            return str(mod.get_device_name(index))
        except Exception:
            return f"device {index}"

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory; a stand-in's device memory is host memory already, and PyTorch pins through the
        vendor runtime's C++ allocator, which a device written in Python has not: its host tensor as it is."""
        return tensor if self.standin else super().pinned(tensor)

    def host_transfer_bytes(self) -> int | None:
        """The stand-in counts its device-to-host copies; a vendor runtime has no such counter (None): there the
        survey relies on the runtime's own fallback warning."""
        count = getattr(self._module, "host_transfer_bytes", None) if self._module is not None else None
        return int(count()) if callable(count) else None

    @property
    def standin(self) -> str | None:
        """What the loaded runtime is when it is a stand-in over host memory (``backends.standins``), else None."""
        if self._elsewhere is not None:
            return self._elsewhere[0].standin
        return getattr(self._module, "standin", None) if self._module is not None else None

    def _mod(self) -> ModuleType:
        self.require_available()
        if self._elsewhere is not None:
            raise UnsupportedError(f"backend '{self.name}' cannot run in this process: {self._elsewhere[1]}")
        assert self._module is not None
        return self._module

    def device_count(self) -> int:
        if self.is_available() and self._elsewhere is not None:
            return self._elsewhere[0].count
        return int(self._module.device_count()) if self.is_available() and self._module else 0

    def set_device(self, index: int) -> None:
        self._check_index(index)
        self._mod().set_device(index)

    def current_device(self) -> int:
        return int(self._mod().current_device())

    def device_name(self, index: int = 0) -> str:
        self._check_index(index)
        if self._elsewhere is not None:
            return self._elsewhere[0].names[index]
        return str(self._mod().get_device_name(index))

    def synchronize(self, index: int | None = None) -> None:
        self._mod().synchronize(index)

    def _check_index(self, index: int) -> None:
        count = self.device_count()
        if not self.is_available():
            self.require_available()
        if not isinstance(index, int) or not 0 <= index < count:
            raise BackendUnavailable(
                f"device index {index!r} is out of range for backend '{self.name}' with {count} device(s); "
                f"use 0..{count - 1}"
            )

    # --- streams and events ----------------------------------------------------------------------
    def Stream(self, index: int | None = None) -> Any:  # noqa: N802
        mod = self._mod()
        return mod.Stream() if index is None else mod.Stream(device=index)

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802
        return self._mod().Event(enable_timing=enable_timing)

    def current_stream(self, index: int | None = None) -> Any:
        return self._mod().current_stream(index)

    def stream(self, stream: Any) -> ContextManager[Any]:
        return self._mod().stream(stream)

    # --- memory ----------------------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        return int(self._mod().memory_allocated(index))

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self._mod().memory_reserved(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self._mod().max_memory_allocated(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._mod().reset_peak_memory_stats(index)

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        if self.is_available() and self._elsewhere is not None:
            return self._elsewhere[0].memory[index or 0]
        free, total = self._mod().mem_get_info(index)
        return int(free), int(total)

    def empty_cache(self) -> None:
        self._mod().empty_cache()

    # --- RNG ---------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._mod().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._mod().manual_seed_all(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self._mod().get_rng_state(self.current_device() if index is None else index)

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self._mod().set_rng_state(state, self.current_device() if index is None else index)

    # --- host cache, graphs, profiler ------------------------------------------------------------------
    def host_memory_stats(self) -> dict[str, Any]:
        stats = getattr(self._mod(), "host_memory_stats", None)
        if stats is None:
            raise UnsupportedError(self._why_not("host_cache"))
        return dict(stats())

    def empty_host_cache(self) -> None:
        mod = self._mod()
        if getattr(mod, "host_memory_stats", None) is None:
            raise UnsupportedError(self._why_not("host_cache"))
        # the device module's own, else torch 2.12+'s torch.accelerator.empty_host_cache (the current accelerator)
        empty = getattr(mod, "empty_host_cache", None) or getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is None:
            raise UnsupportedError(f"backend '{self.name}': this torch ({torch.__version__}) has no empty_host_cache for "
                                   f"torch.{self.device_type} (torch 2.12+ has torch.accelerator.empty_host_cache)")
        empty()

    def Graph(self) -> Any:  # noqa: N802
        return getattr(self._mod(), self._graph_api()[0])()

    def graph(self, graph: Any, stream: Any = None) -> ContextManager[Any]:
        return getattr(self._mod(), self._graph_api()[1])(graph, stream=stream)

    def _graph_api(self) -> tuple[str, str]:
        mod = self._mod()
        if self.graph_names is None or not all(hasattr(mod, n) for n in self.graph_names):
            raise UnsupportedError(self._why_not("graph_capture"))
        return self.graph_names

    def profiler(self, **kwargs: Any) -> ContextManager[Any]:
        from torch.profiler import ProfilerActivity, profile

        self.require_available()
        device = getattr(ProfilerActivity, self.profiler_activity or "", None)
        if device is None:
            raise UnsupportedError(self._why_not("profiler"))
        return profile(activities=[ProfilerActivity.CPU, device], **kwargs)

    def _contract_answers(self) -> dict[str, tuple[bool, str, str]]:
        """What the device module offers, read off it where it is loaded (a vendor build may lack a piece)."""
        from torch.profiler import ProfilerActivity

        answers = super()._contract_answers()
        mod, dev = self._module, f"torch.{self.device_type}"
        present = lambda name: mod is not None and hasattr(mod, name)  # noqa: E731
        answers["capability"] = (True, f"{dev}.get_device_properties merged with the catalog", "")
        answers["streams_events"] = (True, f"{dev}.Stream / Event / stream", "")
        answers["memory_stats"] = (True, f"{dev}.memory_allocated / max_memory_allocated / mem_get_info", "")
        answers["rng"] = (True, f"{dev}.get_rng_state / set_rng_state", "")
        answers["host_cache"] = (present("host_memory_stats"), f"{dev}.host_memory_stats",
                                 f"this {dev} has no host_memory_stats (no pinned-cache statistics to read)")
        if self.graph_names is None:
            answers["graph_capture"] = (False, "none", f"no graph capture is known for {dev}")
        else:
            names = " / ".join(f"{dev}.{n}" for n in self.graph_names)
            answers["graph_capture"] = (all(present(n) for n in self.graph_names), names,
                                        f"this {dev} lacks {names} (a vendor build older than its graph support)")
        activity = self.profiler_activity or "none"
        answers["profiler"] = (hasattr(ProfilerActivity, activity),
                               f"torch.profiler with ProfilerActivity.CPU + {activity}",
                               f"torch.profiler.ProfilerActivity has no {activity} here")
        return answers

    # --- capabilities --------------------------------------------------------------------------
    def capabilities(self, index: int = 0) -> DeviceCapabilities:
        self._check_index(index)
        if self._elsewhere is not None:
            return DeviceCapabilities.from_dict(self._elsewhere[0].capabilities[index])
        probe = self._probe_facts(index)
        return merge(self.name, lookup(self.name, probe.name), probe)


def registered_device_module(package: ModuleType, device_type: str) -> ModuleType:
    """The ``torch.<device_type>`` module a vendor package registers on import, or RuntimeMissing."""
    module = getattr(torch, device_type, None) or getattr(package, device_type, None)
    if module is None or not callable(getattr(module, "device_count", None)):
        version = getattr(package, "__version__", "?")
        raise RuntimeMissing(
            f"{package.__name__} {version} imported but torch.{device_type} is missing; "
            f"install the {package.__name__} build made for torch {torch.__version__}"
        )
    return module


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
