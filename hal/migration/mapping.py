"""The mapping table: which CUDA API, argument or environment variable maps to what on a backend.

``MAPPING`` lists every patched target (one ``Patch`` row each); ``plan(backend)`` picks the rows a
migration applies. The pure value mappings (device strings and ordinals, CCL names,
``map_location``) live here too, testable without patching anything. The patch session
(``hal.migration.session``) only interprets these rows.

The CUDA module is named only through strings ("cuda.synchronize") and ``getattr`` so that hal's
rule — no direct use of the CUDA module in hal/ — stays checkable by grep.
"""
from __future__ import annotations

import enum
import functools
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hal.backend import Backend

CUDA = "cuda"
# The real class, taken from a path the shim never patches.
_REAL_DEVICE: type = torch._C.device


class Kind(str, enum.Enum):
    DEVICE_FUNCTION = "device-function"  # CUDA-module function -> backend method ``to``
    DEVICE_ARGUMENT = "device-argument"  # rewrite CUDA device arguments named in ``args``
    CCL_NAME = "ccl-name"  # rewrite "nccl" in ``args`` -> backend.process_group_backend()
    ENV_VAR = "env-var"  # copy a CUDA env var to the backend's name for it
    NO_EQUIVALENT = "no-equivalent"  # warn once, then call the CUDA original
    ADAPTER = "adapter"  # a hal adapter named by ``to`` (device class, autocast, torch.load...)


@dataclass(frozen=True)
class Patch:
    """One patched target. ``where`` is a dotted path under ``torch`` or ``env:NAME``.

    ``args`` names the arguments that carry a device or CCL name: ``"1|device="`` is position 1
    (counting ``self`` for methods) or keyword ``device``. For DEVICE_FUNCTION it lists the CUDA
    parameter names passed, in order, to the backend method (``device`` becomes an index), and
    a ``note`` there marks an approximation that is warned about once.
    """

    where: str  # dotted path under torch, "py:module.attr" outside torch, or "env:NAME"
    kind: Kind
    to: str = ""
    args: str = ""
    note: str = ""

    @property
    def name(self) -> str:
        """What a user wrote: ``torch.<where>``, a module path outside torch, or the env var."""
        if self.is_env:
            return self.where[4:]
        return self.where[3:] if self.is_python else f"torch.{self.where}"

    @property
    def is_env(self) -> bool:
        return self.where.startswith("env:")

    @property
    def is_python(self) -> bool:
        """A target outside torch (the standard library's process starters)."""
        return self.where.startswith("py:")


def _fn(name: str, to: str | None = None, args: str = "", note: str = "") -> Patch:
    return Patch(f"{CUDA}.{name}", Kind.DEVICE_FUNCTION, to or name, args, note)


def _dev(where: str, args: str = "device=") -> Patch:
    return Patch(where, Kind.DEVICE_ARGUMENT, "target device", args)


def _adapter(where: str, adapter: str, note: str) -> Patch:
    return Patch(where, Kind.ADAPTER, adapter, note=note)


_MAX_RESERVED_NOTE = "peak allocated bytes: equal to the peak reserved on cpu (both peak RSS), a lower bound elsewhere"

# The legacy tensor types of the CUDA module (``torch.<cuda>.FloatTensor(...)``) and their dtypes.
_LEGACY_TYPES: tuple[str, ...] = (
    "DoubleTensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "LongTensor", "IntTensor",
    "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor",
)  # fmt: skip

# Factories that take device= (transfer_to_npu's and gpu_migration's lists, public names only).
_FACTORIES: tuple[str, ...] = (
    "tensor", "as_tensor", "asarray", "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like",
    "empty_strided", "empty_permuted", "full", "full_like", "rand", "rand_like", "randn", "randn_like",
    "randint", "randint_like", "randperm", "arange", "range", "linspace", "logspace", "eye", "normal",
    "scalar_tensor", "tril_indices", "triu_indices", "from_file", "sparse_coo_tensor", "sparse_csr_tensor",
    "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor", "sparse_compressed_tensor",
    "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
)  # fmt: skip
_NEW_METHODS: tuple[str, ...] = ("new_tensor", "new_empty", "new_empty_strided", "new_full", "new_ones", "new_zeros")

_EXPLICIT: tuple[Patch, ...] = (
    # --- the CUDA module: functions with a backend equivalent ------------------------------------
    _fn("is_available"),
    _fn("device_count"),
    _fn("set_device", args="device"),
    _fn("current_device"),
    _fn("get_device_name", "device_name", "device"),
    _fn("synchronize", args="device"),
    _fn("manual_seed", args="seed"),
    _fn("manual_seed_all", args="seed"),
    _fn("get_rng_state", args="device"),
    _fn("set_rng_state", args="new_state,device"),
    _fn("memory_allocated", args="device"),
    _fn("max_memory_allocated", args="device"),
    _fn("memory_reserved", args="device"),
    _fn("max_memory_reserved", "max_memory_allocated", "device", _MAX_RESERVED_NOTE),
    _fn("memory_cached", "memory_reserved", "device"),
    _fn("max_memory_cached", "max_memory_allocated", "device", _MAX_RESERVED_NOTE),
    _fn("reset_peak_memory_stats", args="device"),
    _fn("reset_max_memory_allocated", "reset_peak_memory_stats", "device"),
    _fn("reset_max_memory_cached", "reset_peak_memory_stats", "device"),
    _fn("empty_cache"),
    _fn("mem_get_info", args="device"),
    _fn("Stream", args="device"),  # a priority hint is not carried over
    _fn("Event", args="enable_timing"),
    _fn("stream", args="stream"),
    _fn("current_stream", args="device"),
    _adapter(f"{CUDA}.is_bf16_supported", "bf16_supported", "native bf16, or emulated too when including_emulation (the default)"),
    _fn("is_tf32_supported", "native:tf32"),
    _adapter(f"{CUDA}.get_device_properties", "device_properties", "name, total_memory, cores; major/minor from the native dtypes (warned)"),
    _adapter(f"{CUDA}.get_device_capability", "device_capability", "the CUDA capability whose dtypes the target has natively (warned)"),
    _adapter(f"{CUDA}.is_current_stream_capturing", "never_capturing", "False: nothing is ever captured on the target"),
    _adapter(f"{CUDA}.make_graphed_callables", "graphed_callables", "the callables returned as they are: they run eagerly (warned)"),
    _adapter(f"{CUDA}.CUDAGraph", "graph_capture", "refused in one line: a captured graph cannot be replayed on the target"),
    _adapter(f"{CUDA}.graph", "graph_capture", "refused in one line: a captured graph cannot be replayed on the target"),
    _adapter(f"{CUDA}.graph_pool_handle", "graph_capture", "refused in one line: graph memory pools belong to CUDA graphs"),
    *(_adapter(f"{CUDA}.nvtx.{name}", "nvtx", "-> torch.profiler.record_function ranges (warned)")
      for name in ("range_push", "range_pop", "range_start", "range_end", "range", "mark")),
    *(_adapter(f"{CUDA}.{name}", "legacy_tensor_type", "class proxy: builds the tensor on the target; isinstance by dtype and device")
      for name in _LEGACY_TYPES),
    _adapter(f"{CUDA}.device", "device_context", "context manager -> backend.set_device / restore"),
    # --- autocast and loss scaling (dtype made explicit: CUDA's fp16 default) ---------------------
    _adapter(f"{CUDA}.amp.autocast", "cuda_autocast", "torch.autocast(target, dtype=float16 unless given)"),
    _adapter(f"{CUDA}.amp.GradScaler", "cuda_grad_scaler", "backend.grad_scaler(...)"),
    _adapter("autocast", "autocast", "device_type cuda -> target; dtype None -> CUDA's autocast dtype"),
    _adapter("amp.autocast", "autocast", "device_type cuda -> target; dtype None -> CUDA's autocast dtype"),
    _adapter("amp.GradScaler", "grad_scaler", "device 'cuda' (the default) -> backend.grad_scaler(...)"),
    _adapter(f"{CUDA}.amp.custom_fwd", "cuda_custom_fwd", "-> torch.amp.custom_fwd(device_type=target): cast_inputs keeps casting"),
    _adapter(f"{CUDA}.amp.custom_bwd", "cuda_custom_bwd", "-> torch.amp.custom_bwd(device_type=target)"),
    _dev("amp.custom_fwd", "device_type="),
    _dev("amp.custom_bwd", "device_type="),
    _adapter("is_autocast_enabled", "autocast_query", "'cuda' or no argument -> the target's autocast state"),
    _adapter("get_autocast_dtype", "autocast_query", "'cuda' -> the target's autocast dtype"),
    _adapter("set_autocast_dtype", "autocast_query", "'cuda' -> the target's autocast dtype"),
    _adapter("set_autocast_enabled", "autocast_query", "'cuda' -> the target's autocast state"),
    _adapter("get_autocast_gpu_dtype", "autocast_gpu_query", "-> the target's autocast dtype"),
    _adapter("backends.cuda.matmul", "tf32_switch", "allow_tf32 -> backend.set_reduced_precision_matmul"),
    _adapter("backends.cudnn", "cudnn_switch", "allow_tf32 = True warned where convolutions have no such mode"),
    # --- devices ------------------------------------------------------------------------------
    _adapter("device", "device_class", "class proxy: cuda / cuda:N / int N -> target; isinstance kept"),
    _dev("Generator", "0|device="),
    _dev("set_default_device", "0|device="),
    *(_dev(name) for name in _FACTORIES),
    _adapter("load", "map_location", "map_location rewritten; None -> cuda locations map to the target"),
    _dev("Tensor.to", "1|device="),
    *(_dev(f"Tensor.{name}") for name in _NEW_METHODS),
    _adapter(f"Tensor.{CUDA}", "tensor_to_target", "-> Tensor.to(target)"),
    _adapter(f"Tensor.is_{CUDA}", "is_target", "-> tensor is on the target device type (torch's own code sees the truth)"),
    _adapter("Tensor.get_device", "get_device", "cpu target: a host tensor is on device 0 (as is_cuda says True)"),
    _adapter("Tensor.type", "tensor_type", "'torch.<cuda>.XTensor' (string or class) -> .to(target, dtype); no argument -> the CUDA name"),
    _adapter("set_default_tensor_type", "default_tensor_type", "a CUDA tensor type -> default dtype + default device = target"),
    _adapter("Tensor.pin_memory", "pin_memory", "cpu: a plain host copy; elsewhere device argument rewritten"),
    _adapter("Tensor.record_stream", "record_stream", "cpu: nothing to record (host memory is not stream-ordered)"),
    _adapter("utils.data.DataLoader.__init__", "loader_pinning", "cpu: pin_memory off (host batches need no staging); pin_memory_device mapped"),
    _dev("nn.Module.to", "1|device="),
    _dev("nn.Module.to_empty", "device="),
    _adapter(f"nn.Module.{CUDA}", "module_to_target", "-> Module.to(target)"),
    _adapter("nn.parallel.DistributedDataParallel.__init__", "ddp_devices", "device_ids/output_device: None on cpu"),
    *(_adapter(where, "data_parallel", "cpu: the module runs unreplicated on the one host device (warned)")
      for where in ("nn.DataParallel", "nn.parallel.DataParallel", "nn.parallel.data_parallel.DataParallel")),
    _adapter("nn.parallel.data_parallel", "data_parallel_function", "cpu: module(*inputs) on the one host device (warned)"),
    # --- distributed --------------------------------------------------------------------------
    Patch("distributed.init_process_group", Kind.CCL_NAME, "backend.process_group_backend()", "0|backend="),
    Patch("distributed.new_group", Kind.CCL_NAME, "backend.process_group_backend()", "2|backend="),
    _adapter("distributed.destroy_process_group", "kept_process_groups",
             "destroyed, their objects kept until the script ends (a DDP model dropped later cannot hang its rank)"),
    _dev("distributed.device_mesh.init_device_mesh", "0|device_type="),
    _dev("distributed.init_device_mesh", "0|device_type="),
    _dev("distributed.device_mesh.DeviceMesh", "0|device_type="),
    # --- child processes: spawn and forkserver children start a fresh interpreter -----------------
    _adapter("py:multiprocessing.util.spawnv_passfds", "child_processes", "spawn and forkserver children enter the same migration first"),
    # --- environment variables (read when the runtime initialises) -------------------------------
    Patch("env:CUDA_VISIBLE_DEVICES", Kind.ENV_VAR, "backend.visible_devices_env"),
    Patch("env:PYTORCH_CUDA_ALLOC_CONF", Kind.ENV_VAR, "PYTORCH_{DEVICE}_ALLOC_CONF"),
)


def _resolve(where: str) -> tuple[Any, str]:
    """(owner, attribute) for a dotted path under torch (or ``py:`` outside it); imports lazy submodules."""
    if where.startswith("py:"):
        module, _, attr = where[3:].rpartition(".")
        return importlib.import_module(module), attr
    *path, attr = where.split(".")
    owner: Any = torch
    for i, part in enumerate(path):
        if not hasattr(owner, part):
            importlib.import_module("torch." + ".".join(path[: i + 1]))
        owner = getattr(owner, part)
    return owner, attr


def _exists(row: Patch) -> bool:
    if row.is_env:
        return True
    try:
        owner, attr = _resolve(row.where)
    except (ImportError, AttributeError):
        return False
    return hasattr(owner, attr)


def _unmapped_cuda_functions(explicit: tuple[Patch, ...]) -> tuple[Patch, ...]:
    """Every other public function of the CUDA module: warn once, call the original.

    Classes not listed above (ExternalStream, allocator classes, ...) are left alone: they cannot
    be built on a non-CUDA target anyway, and CUDA's own error names them.
    """
    module = getattr(torch, CUDA)
    known = {row.where for row in explicit}
    names = sorted(getattr(module, "__all__", ()))
    return tuple(
        Patch(f"{CUDA}.{name}", Kind.NO_EQUIVALENT, "CUDA original")
        for name in names
        if f"{CUDA}.{name}" not in known and isinstance(getattr(module, name, None), types.FunctionType)
    )


MAPPING: tuple[Patch, ...] = tuple(
    row for row in _EXPLICIT + _unmapped_cuda_functions(_EXPLICIT) if _exists(row)
)


def plan(backend: Backend) -> tuple[Patch, ...]:
    """The rows ``migrate(backend)`` applies: none for a cuda-type backend (nothing differs)."""
    return () if backend.device_type == CUDA else MAPPING


# --- pure mapping helpers (unit-testable without a session) ------------------------------------
def _target_spec(device_type: str, index: int | None) -> str:
    """cuda:N -> <target>:N; the host has one device, so every ordinal becomes plain "cpu"."""
    if device_type == "cpu" or index is None:
        return device_type
    return f"{device_type}:{index}"


def map_device(value: Any, device_type: str, *, ints: bool = True) -> Any:
    """Rewrite a CUDA device (string, torch.device, or an ordinal when ``ints``) to ``device_type``.

    Strings stay strings and devices stay devices; anything that is not a CUDA device (dtypes,
    tensors, "cpu", "meta") is returned unchanged.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and ints:
        return _REAL_DEVICE(_target_spec(device_type, value))
    if isinstance(value, str):
        # String methods, not a regex: torch.compile traces this without a graph break.
        text = value.strip()
        if text == CUDA:
            return _target_spec(device_type, None)
        if text.startswith(CUDA + ":") and text[len(CUDA) + 1:].isdigit():
            return _target_spec(device_type, int(text[len(CUDA) + 1:]))
        return value
    if isinstance(value, _REAL_DEVICE) and value.type == CUDA:
        return _REAL_DEVICE(_target_spec(device_type, value.index))
    return value


def map_ccl(name: Any, backend: Backend) -> Any:
    """"nccl" -> the backend's process-group string; "cuda:nccl" pairs -> "<type>:<ccl>"."""
    if not isinstance(name, str) or "nccl" not in name.lower():
        return name
    if ":" not in name:
        return backend.process_group_backend()
    parts: list[str] = []
    for pair in (p.strip() for p in name.split(",") if p.strip()):
        _, _, ccl = pair.partition(":")
        if ccl.strip().lower() == "nccl":
            if backend.device_type == "cpu":
                continue  # host tensors are served by the cpu:gloo part
            pair = f"{backend.device_type}:{backend.ccl}"
        parts.append(pair)
    return ",".join(parts) if parts else backend.process_group_backend()


class CudaLocationMap(dict):
    """A ``map_location`` dict that also sends every unlisted CUDA location tag to the target.

    Keys are the *saved* location tags, so they are never rewritten (transfer_to_npu rewrites
    them, which stops ``{"cuda:1": "cuda:0"}`` from matching anything); values are.
    """

    def __init__(self, entries: dict[str, Any], device_type: str) -> None:
        super().__init__({key: _location(map_device(value, device_type, ints=False)) for key, value in entries.items()})
        self.device_type = device_type

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        mapped = map_device(key, self.device_type, ints=False)
        return mapped if mapped != key else default


def _location(value: Any) -> Any:
    return str(value) if isinstance(value, _REAL_DEVICE) else value


def rewrite_map_location(map_location: Any, device_type: str) -> Any:
    """The ``map_location`` that loads a CUDA-saved checkpoint onto ``device_type``."""
    if map_location is None or isinstance(map_location, dict):
        return CudaLocationMap(map_location or {}, device_type)
    if isinstance(map_location, bytes):
        map_location = map_location.decode()
    if isinstance(map_location, (str, _REAL_DEVICE)):
        return map_device(map_location, device_type, ints=False)
    if callable(map_location):
        return _fallback_restore(map_location, device_type)
    return map_location


def _fallback_restore(fn: Callable[[Any, str], Any], device_type: str) -> Callable[[Any, str], Any]:
    """A callable map_location returning None means "default restore" — which would target CUDA."""

    @functools.wraps(fn)
    def restore(storage: Any, location: str) -> Any:
        result = fn(storage, location)
        if result is None:
            target = map_device(location, device_type, ints=False)
            result = torch.serialization.default_restore_location(storage, target)
        return result

    return restore


