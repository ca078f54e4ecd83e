"""The host CPU: always available, the reference platform, and the CI default (gloo for collectives).

Memory figures are the process's resident set (the host allocator has no per-tensor accounting):
``memory_allocated`` is RSS, ``max_memory_allocated`` the peak RSS (VmHWM), which
``reset_peak_memory_stats`` resets through /proc/self/clear_refs on Linux.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Any, ContextManager

import torch

from hal.backend import Availability, Backend
from hal.capabilities import DeviceCapabilities, DtypeSupport, ProbedFacts, lookup, merge
from hal.errors import UnsupportedError


class HostEvent:
    """A CPU event: CPU work is synchronous, so recording a wall-clock time is exact."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self._ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self._ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self._ns is not None

    def synchronize(self) -> None:
        """Nothing to wait for: the host already ran everything queued before ``record``."""

    def wait(self, stream: Any = None) -> None:
        """Streams on the host run in order; nothing to wait for."""

    def elapsed_time(self, end: HostEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("both events need enable_timing=True to measure elapsed time")
        if self._ns is None or end._ns is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._ns - self._ns) / 1e6


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _meminfo() -> tuple[int, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
        return values.get("MemAvailable", values.get("MemFree", 0)), values["MemTotal"]
    except (OSError, KeyError, ValueError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return avail * size, pages * size


def _cpu_features() -> dict[str, Any]:
    if hasattr(torch.cpu, "get_capabilities"):
        return dict(torch.cpu.get_capabilities())
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {f: True for f in flags}


def _cpu_name(features: dict[str, Any]) -> str:
    name = str(features.get("cpu_name") or "")
    if not name:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    return name or platform.processor() or platform.machine() or "host CPU"


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    vendor = "host"
    ccl = "gloo"
    visible_devices_env = None
    reduced_precision_matmul_format = None
    hardware_verification = "host CPU: the whole test suite runs here (CI)"
    memory_stats_measure = "the process's resident set size (all host memory of the process, not tensor bytes)"
    # gloo's sums round every partial sum to the tensor's dtype, bf16 and fp16 included (the reduction probe at 4 ranks
    # on a CPU host, torch 2.13, 2026-11-29: bitwise a ring, chunk c summed from rank c - 1 going down the ranks)
    ccl_accumulation = {"float32": "dtype", "bfloat16": "dtype", "float16": "dtype"}

    def availability(self) -> Availability:
        return Availability(True, f"host CPU ({_cpu_name(_cpu_features())}, {os.cpu_count()} logical cores)")

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        if index != 0:
            raise UnsupportedError(f"the cpu backend has one device (index 0), not {index!r}; use device 0")

    def current_device(self) -> int:
        return 0

    def device_name(self, index: int = 0) -> str:
        self.set_device(index)
        return _cpu_name(_cpu_features())

    def device(self, index: int | None = None) -> torch.device:
        if index not in (None, 0):
            self.set_device(index)  # raises with the fix
        return torch.device("cpu")

    def synchronize(self, index: int | None = None) -> None:
        torch.cpu.synchronize()

    def Stream(self, index: int | None = None) -> Any:  # noqa: N802
        return torch.cpu.Stream()

    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802
        return HostEvent(enable_timing)

    def current_stream(self, index: int | None = None) -> Any:
        return torch.cpu.current_stream()

    def stream(self, stream: Any) -> ContextManager[Any]:
        return torch.cpu.stream(stream)

    def memory_allocated(self, index: int | None = None) -> int:
        return _status_kib("VmRSS") or 0

    def memory_reserved(self, index: int | None = None) -> int:
        return _status_kib("VmRSS") or 0

    def max_memory_allocated(self, index: int | None = None) -> int:
        return _status_kib("VmHWM") or 0

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")  # 5 = reset the peak resident set size (VmHWM)
        except OSError as exc:
            raise UnsupportedError(f"cannot reset the host peak-memory counter here ({exc}); read it without resetting") from None

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        return _meminfo()

    def empty_cache(self) -> None:
        """The host allocator keeps no cache of its own."""

    def manual_seed(self, seed: int) -> None:
        # The default generator directly: torch.manual_seed would re-enter device seeding hooks.
        torch.random.default_generator.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return torch.random.default_generator.get_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        torch.random.default_generator.set_state(state)

    def _contract_answers(self) -> dict[str, tuple[bool, str, str]]:
        return {
            "capability": (True, "capabilities(): the CPU's feature flags and /proc/meminfo, merged with the catalog", ""),
            "streams_events": (True, "torch.cpu.Stream; host events timed by the wall clock (CPU work is synchronous)", ""),
            "memory_stats": (True, "the process's resident set (VmRSS, peak VmHWM, reset through clear_refs)", ""),
            "host_cache": (False, "none", "the host is the memory: a pinned host cache stages copies to an accelerator"),
            "rng": (True, "torch's default CPU generator get_state / set_state", ""),
            "graph_capture": (False, "none", "no graph capture on the host: CPU ops run as they are called, with no "
                                             "launch cost a replay would save"),
            "profiler": (True, "torch.profiler with ProfilerActivity.CPU", ""),
        }

    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        if enabled:
            raise UnsupportedError(
                "the cpu backend has no TF32/HF32 mode for fp32 matmuls; use precision fp32 or bf16-mixed"
            )

    def reduced_precision_matmul_enabled(self) -> bool:
        return False

    def set_deterministic(self, enabled: bool) -> None:
        torch.use_deterministic_algorithms(enabled)

    def capabilities(self, index: int = 0) -> DeviceCapabilities:
        self.set_device(index)
        features = _cpu_features()
        has = lambda *names: any(bool(features.get(n)) for n in names)  # noqa: E731
        native_or_emulated = lambda ok: DtypeSupport.NATIVE if ok else DtypeSupport.EMULATED  # noqa: E731
        probe = ProbedFacts(
            name=_cpu_name(features),
            total_memory_bytes=_meminfo()[1],
            dtypes={
                "bf16": native_or_emulated(has("avx512_bf16", "amx_bf16", "bf16")),
                "fp16": native_or_emulated(has("avx512_fp16", "amx_fp16", "fphp")),
            },
            extra={
                "logical_cores": os.cpu_count(),
                "isa": torch.backends.cpu.get_cpu_capability(),
            },
            how="probed from the CPU's feature flags and /proc/meminfo",
        )
        return merge(self.name, lookup(self.name, probe.name), probe)
