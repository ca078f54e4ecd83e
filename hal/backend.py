"""The backend contract: the one abstract class every vendor implements.

Names follow PyTorch (``torch.accelerator`` and the CUDA device module) so that a reader who
knows ``max_memory_allocated`` there knows ``backend.max_memory_allocated``. Discovery is a real
device probe (``availability()``), never "the vendor package imports". Instantiating a backend
must not import its vendor package or touch a device: that happens lazily, inside methods.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Iterator, Mapping

import torch

from hal.capabilities import DeviceCapabilities
from hal.errors import BackendUnavailable, UnsupportedError

if TYPE_CHECKING:
    from hal.ops.registry import OpRegistry

NOT_VERIFIED = "not verified on hardware"
# What a backend answers for beyond compute (torch.accelerator's and the accelerator-integration guide's list):
# each is exercised by the ``contract`` conformance suite and shown by ``hal devices``.
CONTRACT_ITEMS: tuple[str, ...] = ("capability", "streams_events", "memory_stats", "host_cache", "rng",
                                   "graph_capture", "profiler")


@dataclass(frozen=True)
class ContractItem:
    """How a backend answers one contract item: ``state`` is supported, unsupported or unavailable (the runtime
    is not here); ``api`` is what serves it (or would); ``reason`` why not, empty when supported."""

    item: str
    state: str
    api: str
    reason: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"item": self.item, "state": self.state, "api": self.api, "reason": self.reason}


@dataclass(frozen=True)
class CclGap:
    """Something a vendor CCL cannot do, and how hal handles it (capability data, not code paths).

    ``handling``: ``"host"`` — stage through host memory and run the op on gloo, then copy back
    (lossless, slower, recorded as a downgrade); ``"refuse"`` — a clear error.
    """

    dtype: str | None  # torch dtype name ("float64"), or None for every dtype
    op: str | None  # hal collective name ("all_reduce") or reduce op ("product"), or None for all
    handling: str
    source: str


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and the human reason either way."""

    available: bool
    reason: str


class Backend(abc.ABC):
    """One vendor's way to run PyTorch work: devices, streams, memory, RNG, precision, CCL."""

    # --- identity (class attributes; every backend sets them) ---------------------------------
    name: ClassVar[str]  # hal's name, used in configs: "cuda", "ascend", ...
    device_type: ClassVar[str]  # torch device type: "cuda", "npu", "mlu", "cpu"
    vendor: ClassVar[str]  # "NVIDIA", "AMD / Hygon", "Huawei", "Cambricon", "host"
    ccl: ClassVar[str]  # torch.distributed backend name for device tensors: "nccl", "hccl", ...
    visible_devices_env: ClassVar[str | None]  # "CUDA_VISIBLE_DEVICES", ... (None for cpu)
    reduced_precision_matmul_format: ClassVar[str | None] = None  # "tf32" | "hf32" | None
    # Reduce ops the CCL runs natively; others (avg) are composed from sum by hal collectives.
    ccl_reduce_ops: ClassVar[frozenset[str]] = frozenset({"sum", "max", "min", "product"})
    # Whether the CCL runs the ops started inside torch's coalescing block as one grouped launch (NCCL's
    # ncclGroupStart/End): Communicator.all_to_all_blocks then starts its all-to-alls as one.
    ccl_coalesces: ClassVar[bool] = False
    # Known CCL gaps (dtypes or ops the vendor library cannot do) and their handling.
    ccl_gaps: ClassVar[tuple[CclGap, ...]] = ()
    # How the CCL's sum accumulates, per dtype name, where it is known (documented or measured): "dtype" — every
    # partial sum rounded to the tensor's dtype (a ring or tree in the dtype); "wide" — a wider accumulator, rounded
    # once. The collectives suite's reduction probe fails a declared dtype whose sums show the other kind; two
    # vendors' all-reduces can agree bitwise only where they sum alike. Empty: undeclared (the probe only states it).
    ccl_accumulation: ClassVar[Mapping[str, str]] = {}
    # What real hardware this backend was verified on, and how; None = not verified.
    hardware_verification: ClassVar[str | None] = None
    # What memory_allocated & co. measure when it is not the device allocator's tensor bytes
    # (the migration shim warns with this text); None = the device allocator's own counters.
    memory_stats_measure: ClassVar[str | None] = None

    # --- discovery ----------------------------------------------------------------------------
    @abc.abstractmethod
    def availability(self) -> Availability:
        """Probe the runtime and a device; say why not when unavailable. Cheap after the first call."""

    def is_available(self) -> bool:
        return self.availability().available

    def require_available(self) -> None:
        """Raise ``BackendUnavailable`` (with the probe's reason) unless this backend can run."""
        status = self.availability()
        if not status.available:
            raise BackendUnavailable(f"backend '{self.name}' is not available: {status.reason}")

    @property
    def verification(self) -> str:
        return self.hardware_verification or NOT_VERIFIED

    @property
    def standin(self) -> str | None:
        """"stand-in: host-backed, not hardware" where this backend runs on a stand-in of its runtime
        (``hal.standin``), else None: results made on it say so."""
        return None

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of visible devices (0 when unavailable; never raises)."""

    @abc.abstractmethod
    def set_device(self, index: int) -> None: ...

    def prepare_autograd(self, index: int) -> None:
        """Ready autograd's worker thread for device ``index`` before this process computes there (a process that
        takes a device for its training calls it once). Nothing to do on most backends."""

    @abc.abstractmethod
    def current_device(self) -> int: ...

    @abc.abstractmethod
    def device_name(self, index: int = 0) -> str: ...

    def device(self, index: int | None = None) -> torch.device:
        """The torch device for ``index`` (the current device when None)."""
        if index is None:
            index = self.current_device()
        return torch.device(self.device_type, index)

    @abc.abstractmethod
    def synchronize(self, index: int | None = None) -> None:
        """Wait for all queued work on the device."""

    # --- streams and events ----------------------------------------------------------------
    @abc.abstractmethod
    def Stream(self, index: int | None = None) -> Any:  # noqa: N802 - mirrors the device modules' Stream
        """A new stream on the device."""

    @abc.abstractmethod
    def Event(self, enable_timing: bool = False) -> Any:  # noqa: N802 - mirrors the device modules' Event
        """A new event; with timing, ``a.elapsed_time(b)`` is in milliseconds."""

    @abc.abstractmethod
    def current_stream(self, index: int | None = None) -> Any: ...

    @abc.abstractmethod
    def stream(self, stream: Any) -> ContextManager[Any]:
        """Context manager that makes ``stream`` current."""

    # --- memory (bytes) ------------------------------------------------------------------------
    @abc.abstractmethod
    def memory_allocated(self, index: int | None = None) -> int: ...

    @abc.abstractmethod
    def memory_reserved(self, index: int | None = None) -> int: ...

    @abc.abstractmethod
    def max_memory_allocated(self, index: int | None = None) -> int: ...

    @abc.abstractmethod
    def reset_peak_memory_stats(self, index: int | None = None) -> None: ...

    @abc.abstractmethod
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) bytes of device memory."""

    def total_memory(self, index: int | None = None) -> int:
        return self.mem_get_info(index)[1]

    @abc.abstractmethod
    def empty_cache(self) -> None: ...

    # --- RNG --------------------------------------------------------------------------------
    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""

    @abc.abstractmethod
    def get_rng_state(self, index: int | None = None) -> torch.Tensor: ...

    @abc.abstractmethod
    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None: ...

    # --- precision ------------------------------------------------------------------------------
    def autocast(self, dtype: torch.dtype, enabled: bool = True) -> ContextManager[Any]:
        """``torch.autocast`` for this device type with an explicit dtype (never a silent default)."""
        return torch.autocast(self.device_type, dtype=dtype, enabled=enabled)

    def grad_scaler(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> Any:
        """A dynamic loss scaler for this device type: ``torch.amp.GradScaler``, or on a device without float64 compute
        one that takes the scale's reciprocal in float32 (``hal.loss_scaler``; torch's takes it in float64
        on the device)."""
        from hal.capabilities import DtypeSupport

        scaler: type[torch.amp.GradScaler] = torch.amp.GradScaler
        if self.device_type != "cpu" and self.capabilities().support("fp64") is DtypeSupport.ABSENT:
            from hal.loss_scaler import Fp32ReciprocalGradScaler

            scaler = Fp32ReciprocalGradScaler
        return scaler(
            self.device_type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    @abc.abstractmethod
    def set_reduced_precision_matmul(self, enabled: bool) -> None:
        """Allow TF32 (CUDA) / HF32 (Ascend) for fp32 matmuls; raises UnsupportedError where none exists."""

    @abc.abstractmethod
    def reduced_precision_matmul_enabled(self) -> bool: ...

    @abc.abstractmethod
    def set_deterministic(self, enabled: bool) -> None:
        """Make kernels deterministic (``torch.use_deterministic_algorithms`` plus vendor switches)."""

    # --- capabilities -----------------------------------------------------------------------
    @abc.abstractmethod
    def capabilities(self, index: int = 0) -> DeviceCapabilities:
        """Catalog facts for the device at ``index`` merged with a run-time probe."""

    # --- host cache, graphs, profiler, and the contract's answers ------------------------------------
    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (a host tensor) where this device copies from it without blocking: page-locked for an
        accelerator, itself on the host backend (no device to copy to)."""
        return tensor if self.device_type == "cpu" else tensor.pin_memory()

    def host_memory_stats(self) -> dict[str, Any]:
        """Statistics of the pinned host-memory cache the device copies stage through (CUDA's keys:
        ``allocated_bytes.current`` ...). Raises UnsupportedError with the reason where there is none."""
        raise UnsupportedError(self._why_not("host_cache"))

    def empty_host_cache(self) -> None:
        """Give the pinned host cache's unused blocks back (UnsupportedError where there is no such cache)."""
        raise UnsupportedError(self._why_not("host_cache"))

    def Graph(self) -> Any:  # noqa: N802 - mirrors CUDAGraph and torch.accelerator.Graph
        """A new capture/replay graph (CUDA graphs on cuda); UnsupportedError with the reason elsewhere."""
        raise UnsupportedError(self._why_not("graph_capture"))

    def graph(self, graph: Any, stream: Any = None) -> ContextManager[Any]:
        """Context manager capturing the device work queued inside it into ``graph`` (replay: ``graph.replay()``)."""
        raise UnsupportedError(self._why_not("graph_capture"))

    def runtime_versions(self) -> dict[str, str]:
        """The versions of what computes here beside torch (the CUDA runtime and driver, torch_npu and CANN, ...):
        recorded in every conformance result, so a report says what exactly was qualified. Empty on the host."""
        return {}

    def device_uuid(self, index: int = 0) -> str | None:
        """The device's own identity (a GPU's UUID) where the runtime tells it; None elsewhere."""
        return None

    def host_transfer_bytes(self) -> int | None:
        """Bytes this runtime has copied from its device to host memory so far, where it counts them; None where it
        does not (the host itself; runtimes without a counter). The operator survey reads it around each op: an op
        that copies its inputs to the host ran there (``hal.conformance.survey.host_watch``)."""
        return None

    def profiler(self, **kwargs: Any) -> ContextManager[Any]:
        """A profiler recording host and device activity (``torch.profiler.profile`` with this device's
        activity, or the vendor's own profiler); ``kwargs`` go to it. Default: host activity only."""
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU], **kwargs)

    def contract(self) -> dict[str, ContractItem]:
        """Every CONTRACT_ITEMS entry: the API that serves it here, or why not (runtime absent: unavailable)."""
        status = self.availability()
        answers = self._contract_answers()
        out = {}
        for item in CONTRACT_ITEMS:
            supported, api, why = answers[item]
            if not status.available:
                out[item] = ContractItem(item, "unavailable", api, status.reason)
            else:
                out[item] = ContractItem(item, "supported" if supported else "unsupported", api, "" if supported else why)
        return out

    def _contract_answers(self) -> dict[str, tuple[bool, str, str]]:
        """item -> (supported, api, why not): what this backend class can say; the base serves the items every
        backend implements above and none of the optional ones."""
        return {
            "capability": (True, "capabilities(): catalog merged with a device probe", ""),
            "streams_events": (True, "Stream / Event / stream()", ""),
            "memory_stats": (True, "memory_allocated / max_memory_allocated / mem_get_info", ""),
            "host_cache": (False, "host_memory_stats", f"backend '{self.name}' declares no pinned host cache"),
            "rng": (True, "get_rng_state / set_rng_state", ""),
            "graph_capture": (False, "Graph / graph()", f"backend '{self.name}' declares no graph capture"),
            "profiler": (True, "torch.profiler (host activity only)", ""),
        }

    def _why_not(self, item: str) -> str:
        answer = self.contract()[item]
        return f"backend '{self.name}' cannot serve {item.replace('_', ' ')} ({answer.api}): {answer.reason}"

    # --- distributed --------------------------------------------------------------------------
    def process_group_backend(self) -> str:
        """torch.distributed backend string: device tensors on our CCL, CPU tensors on gloo."""
        if self.device_type == "cpu":
            return "gloo"
        return f"cpu:gloo,{self.device_type}:{self.ccl}"

    # --- operators ---------------------------------------------------------------------------
    def register_ops(self, registry: OpRegistry) -> None:
        """Add a plug-in backend's own operator implementations. Default: none; the built-in backends'
        fused ops are kernel modules in ``hal.kernels`` (entry-point group ``hal.kernels``)."""

    # --- helpers for subclasses ----------------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r}>"


@contextlib.contextmanager
def null_stream_context(stream: Any) -> Iterator[Any]:
    """For devices whose streams are a no-op (CPU)."""
    yield stream
