"""Adapters for the CUDA runtime's odds and ends real scripts use: legacy tensor types, device
properties, CUDA graphs, NVTX ranges, DataParallel and child processes.

Each maps to the target where an exact equivalent exists, or warns once at the script's line
saying what happens instead, or (CUDA graph capture) refuses in one line naming the script's line.
"""
from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from hal.migration.mapping import CUDA, Patch
from hal.migration.session import Session, called_by_torch, cuda_function, is_proxy, replace_callable

# CUDA legacy type name -> dtype, from the real classes ("torch.<cuda>.FloatTensor" -> float32).
_LEGACY_DTYPES: dict[str, torch.dtype] = {}


def _legacy_dtype(value: Any) -> torch.dtype | None:
    """The dtype of a CUDA legacy tensor type given as a string or (proxied) class; None otherwise."""
    if is_proxy(value):
        value = value._hal_original
    name = value if isinstance(value, str) else getattr(value, "__module__", "") + "." + getattr(value, "__name__", "")
    if not name.startswith(f"torch.{CUDA}."):
        return None
    if not _LEGACY_DTYPES:
        from hal.migration.mapping import _LEGACY_TYPES

        real = getattr(torch, CUDA)
        _LEGACY_DTYPES.update({f"torch.{CUDA}.{n}": getattr(real, n).dtype for n in _LEGACY_TYPES})
    return _LEGACY_DTYPES.get(name)


def legacy_tensor_type(row: Patch, session: Session, original: Any) -> Any:
    """``torch.<cuda>.FloatTensor(...)`` builds the host type's tensor, then moves it to the target."""
    host_type = getattr(torch, row.where.rpartition(".")[2])
    dtype = original.dtype

    def build(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = host_type(*args, **kwargs)
        return tensor if session.device_type == "cpu" else tensor.to(session.device_type)

    def instancecheck(obj: Any) -> bool:
        if not session.active:
            return isinstance(obj, original)
        return isinstance(obj, torch.Tensor) and obj.dtype == dtype and obj.device.type == session.device_type

    return replace_callable(original, session, build, instancecheck)


def tensor_type(row: Patch, session: Session, original: Any) -> Any:
    """``x.type('torch.<cuda>.FloatTensor')`` -> ``x.to(target, float32)``; ``x.type()`` names the CUDA type."""

    def impl(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if called_by_torch(2):
            return original(self, dtype, non_blocking, **kwargs)
        if dtype is None:
            name = original(self)
            if self.device.type == session.device_type:
                return f"torch.{CUDA}.{name.rpartition('.')[2]}"
            return name
        wanted = _legacy_dtype(dtype)
        if wanted is None:
            return original(self, dtype, non_blocking, **kwargs)
        return self.to(session.device_type, wanted, non_blocking=non_blocking)

    return replace_callable(original, session, impl)


def default_tensor_type(row: Patch, session: Session, original: Any) -> Any:
    """``set_default_tensor_type(torch.<cuda>.FloatTensor)``: default dtype and default device = target."""

    def impl(t: Any) -> None:
        wanted = _legacy_dtype(t)
        if wanted is None:
            return original(t)
        torch.set_default_dtype(wanted)
        torch.set_default_device(session.device_type)
        return None

    return replace_callable(original, session, impl)


# --- device properties ---------------------------------------------------------------------------
def _equivalent_capability(session: Session) -> tuple[int, int]:
    """The CUDA compute capability whose dtypes the target has natively: 8.0 bf16, 7.0 fp16, else 6.0."""
    caps = session.backend.capabilities()
    if caps.is_native("bf16"):
        return (8, 0)
    return (7, 0) if caps.is_native("fp16") else (6, 0)


@dataclass(frozen=True)
class TargetDeviceProperties:
    """What ``torch.<cuda>.get_device_properties`` returns, filled from the target device."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 0  # noqa: N815 - CUDA's field name
    uuid: str = ""


def device_properties(row: Patch, session: Session, original: Any) -> Any:
    def impl(device: Any = None) -> TargetDeviceProperties:
        backend = session.backend
        index = session.index(device)
        caps = backend.capabilities(index)
        major, minor = _equivalent_capability(session)
        cores = int(caps.extra.get("multi_processor_count") or caps.extra.get("logical_cores") or os.cpu_count() or 1)
        memory = caps.memory_bytes or backend.mem_get_info(index)[1]
        session.warn_once(row.where, f"{row.name} on {backend.name}: name and total_memory are the {backend.name} "
                          f"device's, multi_processor_count = {cores} compute units, major.minor = {major}.{minor} "
                          "(the CUDA capability whose dtypes the device has natively)")
        return TargetDeviceProperties(backend.device_name(index), int(memory), major, minor, cores)

    return cuda_function(row, session, original, impl)


def device_capability(row: Patch, session: Session, original: Any) -> Any:
    def impl(device: Any = None) -> tuple[int, int]:
        session.index(device)
        major, minor = _equivalent_capability(session)
        session.warn_once(row.where, f"{row.name} on {session.backend.name} returns ({major}, {minor}): the CUDA "
                          "capability whose dtypes the device has natively, not a CUDA device's")
        return (major, minor)

    return cuda_function(row, session, original, impl)


# --- CUDA graphs -------------------------------------------------------------------------------
def never_capturing(row: Patch, session: Session, original: Any) -> Any:
    return cuda_function(row, session, original, lambda: False)


def graphed_callables(row: Patch, session: Session, original: Any) -> Any:
    """make_graphed_callables -> the callables themselves: the same numbers, run eagerly."""

    def impl(callables: Any, sample_args: Any, *args: Any, **kwargs: Any) -> Any:
        session.warn_once(row.where, f"{row.name} on {session.backend.name}: nothing is captured; "
                          "the callables run eagerly (same results, no graph replay)")
        return callables

    return cuda_function(row, session, original, impl)


def graph_capture(row: Patch, session: Session, original: Any) -> Any:
    """CUDAGraph / graph / graph_pool_handle: refused, naming the script's line (nothing to replay)."""

    def impl(*args: Any, **kwargs: Any) -> Any:
        raise session.unsupported(row.name, "a CUDA graph is captured once and replayed, and the target cannot "
                                  f"capture; run the captured code eagerly (torch.{CUDA}.make_graphed_callables is "
                                  "mapped and runs eagerly)")

    return replace_callable(original, session, impl)


# --- NVTX -> profiler ranges ---------------------------------------------------------------------
class _ProfilerRanges:
    """NVTX's push/pop and start/end ranges as torch.profiler record_function ranges."""

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.open: dict[int, Any] = {}
        self.ids = itertools.count(1)

    @staticmethod
    def begin(message: str) -> Any:
        scope = torch.autograd.profiler.record_function(str(message))
        scope.__enter__()
        return scope

    def push(self, message: str) -> int:
        self.stack.append(self.begin(message))
        return len(self.stack) - 1

    def pop(self) -> int:
        if self.stack:
            self.stack.pop().__exit__(None, None, None)
        return len(self.stack)

    def start(self, message: str) -> int:
        handle = next(self.ids)
        self.open[handle] = self.begin(message)
        return handle

    def end(self, handle: int) -> None:
        scope = self.open.pop(handle, None)
        if scope is not None:
            scope.__exit__(None, None, None)


def nvtx(row: Patch, session: Session, original: Any) -> Any:
    ranges: _ProfilerRanges = session.__dict__.setdefault("_nvtx_ranges", _ProfilerRanges())
    name = row.where.rpartition(".")[2]

    @contextlib.contextmanager
    def as_range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        with torch.autograd.profiler.record_function(msg.format(*args, **kwargs)):
            yield

    calls: dict[str, Callable[..., Any]] = {
        "range_push": ranges.push, "range_pop": ranges.pop, "range_start": ranges.start,
        "range_end": ranges.end, "range": as_range, "mark": lambda msg: None,
    }

    def impl(*args: Any, **kwargs: Any) -> Any:
        session.warn_once("nvtx", f"torch.{CUDA}.nvtx ranges become torch.profiler record_function ranges on "
                          f"{session.backend.name} (seen by torch.profiler, not Nsight); nvtx.mark is dropped")
        return calls[name](*args, **kwargs)

    return replace_callable(original, session, impl)


# --- DataParallel ----------------------------------------------------------------------------
_DATA_PARALLEL_NOTE = ("runs the module unreplicated on the one cpu device (same results, no replicas); "
                       "data parallelism on hal goes through DistributedDataParallel: hal launch --nproc N")


def data_parallel(row: Patch, session: Session, original: Any) -> Any:
    """nn.DataParallel on cpu: a real DataParallel whose forward is the module's (its no-device path)."""

    def impl(module: torch.nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0) -> Any:
        if session.device_type != "cpu":
            ids = None if device_ids is None else [session.index(d) for d in device_ids]
            return original(module, ids, None if output_device is None else session.index(output_device), dim)
        session.warn_once("DataParallel", f"torch.nn.DataParallel {_DATA_PARALLEL_NOTE}")
        wrapper = original.__new__(original)
        torch.nn.Module.__init__(wrapper)
        wrapper.module, wrapper.device_ids, wrapper.dim = module, [], dim
        wrapper.output_device, wrapper.src_device_obj = None, None
        return wrapper

    return replace_callable(original, session, impl)


def data_parallel_function(row: Patch, session: Session, original: Any) -> Any:
    def impl(module: torch.nn.Module, inputs: Any, device_ids: Any = None, output_device: Any = None,
             dim: int = 0, module_kwargs: Any = None) -> Any:
        if session.device_type != "cpu":
            return original(module, inputs, device_ids, output_device, dim, module_kwargs)
        session.warn_once("data_parallel", f"torch.nn.parallel.data_parallel {_DATA_PARALLEL_NOTE}")
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return module(*inputs, **(module_kwargs or {}))

    return replace_callable(original, session, impl)


# --- child processes ---------------------------------------------------------------------------
# The programs multiprocessing runs in a fresh interpreter (spawn children, the forkserver).
_CHILD_PROGRAMS = ("from multiprocessing.spawn import", "from multiprocessing.forkserver import")


def child_processes(row: Patch, session: Session, original: Any) -> Any:
    """spawn/forkserver children (torch.multiprocessing.spawn, DataLoader workers) enter the migration
    before multiprocessing imports the script, so they run it exactly as the parent does."""

    def impl(path: Any, args: Any, passfds: Any) -> Any:
        args = list(args)
        if "-c" in args[:-1]:
            at = args.index("-c") + 1
            if args[at].startswith(_CHILD_PROGRAMS):
                enter = (f"import hal.migration.child as _hal_child; "
                         f"_hal_child.enter({session.backend.name!r}, {session.device_count!r}); ")
                args[at] = enter + args[at]
        return original(path, args, passfds)

    return replace_callable(original, session, impl)


# --- process groups ------------------------------------------------------------------------------
def kept_process_groups(row: Patch, session: Session, original: Any) -> Any:
    """``destroy_process_group`` destroys the groups, and the scope keeps their objects until it ends.

    Why: a ``DistributedDataParallel`` model holds its group too. When the script's last reference to the model goes
    (its ``main`` returns) after the group was destroyed, the group's destructor runs from the model's, holding the
    interpreter lock, and waits for gloo's worker thread — which may still be dropping the last collective's tensors
    and waits for that lock (pytorch/pytorch#56297; seen as a DDP rank hanging after its result). Kept here, the group
    outlives the model; the scope's end drops it through its own binding, which releases the lock first."""

    def impl(group: Any = None) -> Any:
        from torch.distributed import distributed_c10d

        world = getattr(getattr(distributed_c10d, "_world", None), "pg_map", {})
        session.kept.extend(list(world) if group is None else [group])
        return original(group)

    return replace_callable(original, session, impl)


ADAPTERS: dict[str, Callable[[Patch, Session, Any], Any]] = {
    "legacy_tensor_type": legacy_tensor_type,
    "tensor_type": tensor_type,
    "default_tensor_type": default_tensor_type,
    "device_properties": device_properties,
    "device_capability": device_capability,
    "never_capturing": never_capturing,
    "graphed_callables": graphed_callables,
    "graph_capture": graph_capture,
    "nvtx": nvtx,
    "data_parallel": data_parallel,
    "data_parallel_function": data_parallel_function,
    "child_processes": child_processes,
    "kept_process_groups": kept_process_groups,
}
