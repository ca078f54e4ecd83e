"""A device written in Python over host memory: what the stand-in runtimes (``torch_npu.py``, ``torch_mlu.py``) share.

PyTorch lets a backend be written in Python (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``,
its test ``test/test_privateuseone_python_backend.py``): the PrivateUse1 dispatch key is renamed to the vendor's
device type (``npu``, ``mlu``), a device module answers ``torch.npu.*``, and kernels reach that key through
``torch.library``. Here a tensor on the stand-in device is a ``HostTensor``: a wrapper with the device's type and
index whose data is an ordinary host tensor (``.host``). Every operator on it runs on its host tensor and the
result is wrapped again on the same device (``__torch_dispatch__``); factories that name the device
(``torch.zeros(..., device="npu")``) reach the PrivateUse1 fallback below, which does the same. Autograd,
optimizers, ``Module.to``, ``torch.save`` and autocast then run on the device unchanged.

What the stand-in enforces, because the hardware would refuse it too: tensors of one operator on one device (a
0-dim host tensor excepted, as on CUDA), and the compute dtypes the vendor's device lacks (``Limits``). What it
cannot be: the vendor's kernels (numerics are the host's), its streams (work runs when called: a stream is an
ordering no-op, an event's time is the host clock), a device generator (random numbers come from the host's
default generator: the CPU run's draws), several devices in one process (one index a process, as ranks use).
Everything it produces says "stand-in: host-backed, not hardware".
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hal.backends.standins import constructors, pinned, rnn_cells, storages
from hal.standin import STANDIN_NOTE

# Operators that move data between devices or only describe it: a host tensor may meet the device here, and a
# dtype the device cannot compute with may be held (the real runtimes copy and allocate any dtype).
_MOVEMENT = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "to", "empty", "empty_strided",
             "empty_like", "detach", "alias", "view", "_unsafe_view", "as_strided", "clone", "lift_fresh",
             "_local_scalar_dense", "set_", "resize_", "zero_", "fill_", "equal"}


# Kernels a vendor library registers for its device, by operator name, called with the device tensors (a kernel may
# call the same operator on the device: that call reaches the host's). Empty here; tests plant faulty kernels in it
# (a slightly wrong answer, a silent trip to the host) to prove the operator survey catches them.
DEVICE_KERNELS: dict[str, Callable[..., Any]] = {}
_IN_DEVICE_KERNEL: set[str] = set()


@dataclass(frozen=True)
class Limits:
    """What the vendor's device refuses that host memory would not: compute in these dtypes (with why)."""

    no_compute: frozenset[torch.dtype] = frozenset()
    why: str = ""


@dataclass
class DeviceState:
    """The one stand-in device type of this process: its name, devices, current device and memory counts."""

    vendor: str  # ascend | cambricon
    device_type: str  # npu | mlu
    count: int
    memory_bytes: int  # each device's capacity (the catalog's), for mem_get_info
    limits: Limits
    current: int = 0
    allocated: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    live: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # storage ptr -> (device, bytes, wrappers)
    lock: threading.Lock = field(default_factory=threading.Lock)
    to_host_bytes: int = 0  # bytes copied from the device to host memory so far (a host fallback's trace)

    def __post_init__(self) -> None:
        self.allocated = [0] * self.count
        self.peak = [0] * self.count

    def hold(self, host: torch.Tensor, index: int) -> Callable[[], None]:
        """Count ``host``'s storage against device ``index`` while a wrapper holds it; the release to call at its end."""
        storage = host.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        with self.lock:
            device, size, holders = self.live.get(key, (index, nbytes, 0))
            if holders == 0:
                self.allocated[device] += size
                self.peak[device] = max(self.peak[device], self.allocated[device])
            self.live[key] = (device, size, holders + 1)

        def release() -> None:
            with self.lock:
                got = self.live.get(key)
                if got is None:
                    return
                device, size, holders = got
                if holders <= 1:
                    del self.live[key]
                    self.allocated[device] -= size
                else:
                    self.live[key] = (device, size, holders - 1)

        return release


_STATE: DeviceState | None = None


def state() -> DeviceState:
    """The stand-in device of this process; RuntimeError before one is installed."""
    if _STATE is None:
        raise RuntimeError("no stand-in device is installed in this process")
    return _STATE


class HostTensor(torch.Tensor):
    """A tensor on the stand-in device: its metadata is the device's, its data ``host`` lives in host memory."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls: type[HostTensor], host: torch.Tensor, index: int) -> HostTensor:
        device = torch.device(state().device_type, index)
        wrapper: HostTensor = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, host.size(), strides=host.stride(), storage_offset=host.storage_offset(), dtype=host.dtype,
            device=device, requires_grad=host.requires_grad)
        wrapper.host = host
        weakref.finalize(wrapper, state().hold(host, index))
        return wrapper

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"{self.host!r} on {self.device} ({STANDIN_NOTE})"

    def tolist(self) -> Any:  # type: ignore[override]
        return self.host.tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if not force:
            raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        return self.host.numpy(force=True)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved as torch saves a tensor of the real device: its storage tagged with the device ("npu:0"), so the
        file is the one the hardware would write (``storages`` restores it through the stand-in's ``torch.load``)."""
        host = self.host.detach()
        storages.saving(host, str(self.device), self)
        return torch._utils._rebuild_tensor_v2, (host._typed_storage(), host.storage_offset(), tuple(host.size()),
                                                 host.stride(), self.requires_grad, collections.OrderedDict())

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in DEVICE_KERNELS and name not in _IN_DEVICE_KERNEL:
            _IN_DEVICE_KERNEL.add(name)
            try:
                return DEVICE_KERNELS[name](*args, **kwargs)
            finally:
                _IN_DEVICE_KERNEL.discard(name)
        if func.namespace == "c10d":  # collectives: to the group's library for this device (ccl.py), tensors whole
            with torch._C._DisableTorchDispatch():
                return func(*args, **kwargs)
        if name == "record_stream":  # host memory lives while a tensor holds it: no stream to wait for
            return None
        leaves = _leaves(args, kwargs)
        index = _one_device(func, name, leaves, kwargs)
        _check_dtypes(name, leaves, func)
        target = kwargs.get("device")
        kernel = rnn_cells.HOST_KERNELS.get(name, func)  # operators only a device library implements
        out = kernel(*_each(_unwrap, args), **{k: _one(_unwrap, v) for k, v in kwargs.items()})
        if name in ("_to_copy", "to") and target is not None and torch.device(target).type != state().device_type:
            state().to_host_bytes += out.numel() * out.element_size()
            return out  # to another device: the host result is that device's tensor (cpu)
        if name == "copy_" and not isinstance(args[0], HostTensor):  # into a host tensor, from the device
            state().to_host_bytes += args[0].numel() * args[0].element_size()
        given = {id(a.host): a for a in leaves if isinstance(a, HostTensor)}
        if name.endswith("_") or "out" in kwargs:  # in place: the host tensor's shape may have changed (transpose_)
            for wrapper in given.values():
                _sync_metadata(wrapper, name)
        return _one(lambda o: (given[id(o)] if id(o) in given else _wrap(o, index)) if isinstance(o, torch.Tensor) else o,
                    out)


_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def _sync_metadata(wrapper: HostTensor, name: str) -> None:
    """Give ``wrapper`` its host tensor's sizes, strides and offset after an operator changed them in place
    (``transpose_``, an ``out=`` resized, as ATen's own ``arange`` does): a wrapper's metadata is its own, set when it
    was made. Through ``set_``'s Meta kernel, which sets them on a storage without data (growing its byte count)."""
    host = wrapper.host
    if wrapper.shape == host.shape and wrapper.stride() == host.stride() and wrapper.storage_offset() == host.storage_offset():
        return
    with torch._C._DisableTorchDispatch():
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _META, wrapper, wrapper.untyped_storage(), host.storage_offset(), host.size(), host.stride())


# An operator's arguments are values and lists of values (TensorList, int[], Tensor?[]), never deeper: these walk
# them without the general pytree (the dispatch runs for every operator; pytree was most of its cost).
def _leaves(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    leaves: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            leaves.extend(value)
        else:
            leaves.append(value)
    return leaves


def _one(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` on a value, or on each item of a list / tuple of values (the same container type back)."""
    if isinstance(value, list):
        return [fn(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(fn(v) for v in value)
    return fn(value)


def _each(fn: Callable[[Any], Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_one(fn, a) for a in args)


def _unwrap(value: Any) -> Any:
    if isinstance(value, HostTensor):
        return value.host
    if isinstance(value, torch.device) and value.type == state().device_type:
        return torch.device("cpu")
    return value


def _wrap(value: torch.Tensor, index: int) -> torch.Tensor:
    return value if isinstance(value, HostTensor) else HostTensor(value, index)


def _one_device(func: Any, name: str, leaves: list[Any], kwargs: Any) -> int:
    """The device index of the operator's stand-in tensors; RuntimeError, as CUDA words it, for two devices or a
    host tensor of more than 0 dims among them (copies excepted)."""
    mine = {t.device.index or 0 for t in leaves if isinstance(t, HostTensor)}
    wanted = kwargs.get("device")
    device_type = state().device_type
    if wanted is not None and torch.device(wanted).type == device_type:
        mine.add(torch.device(wanted).index or 0)
    if len(mine) > 1:
        a, b = sorted(mine)[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{device_type}:{a} and {device_type}:{b}! ({func})")
    index = mine.pop() if mine else state().current
    if name not in _MOVEMENT:
        host = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, HostTensor) and t.dim() > 0]
        if host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{device_type}:{index} and {host[0].device}! ({func})")
    return index


def _check_dtypes(name: str, leaves: list[Any], func: Any) -> None:
    """The device's missing compute dtypes: an operator that computes in one is refused, as the hardware does."""
    limits = state().limits
    if not limits.no_compute or name in _MOVEMENT:
        return
    for t in leaves:
        if isinstance(t, HostTensor) and t.dtype in limits.no_compute:
            raise RuntimeError(f"{func} on {t.device} in {t.dtype}: {limits.why} ({STANDIN_NOTE}; the device would "
                               f"refuse it too)")


def _factory(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The PrivateUse1 fallback: an operator that names the device but holds none of its tensors (a factory)."""
    index = _one_device(op, op.overloadpacket.__name__, _leaves(args, kwargs), kwargs)
    out = op(*_each(_unwrap, args), **{k: _one(_unwrap, v) for k, v in kwargs.items()})
    return _one(lambda o: _wrap(o, index) if isinstance(o, torch.Tensor) else o, out)


# --- autocast on the device ---------------------------------------------------------------------------------
# CUDA's documented autocast lists (torch.amp, "CUDA Ops that can autocast to float16" / "to float32"), which the
# vendors' runtimes follow: matmuls and convolutions in the autocast dtype, reductions and norms in float32.
LOWER_PRECISION = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "matmul", "conv1d", "conv2d", "conv3d",
                   "_scaled_dot_product_attention_math", "scaled_dot_product_attention", "prelu", "addmv", "mv")
FLOAT32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
           "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "norm", "nuclear_norm",
           "frobenius_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
           "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
           "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
           "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
           "softmax", "log_softmax", "cross_entropy_loss", "cumprod", "cumsum", "sum", "prod")


def _autocast_kernel(op: Any, to_lower: bool) -> Callable[..., Any]:
    key = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        device_type = state().device_type
        dtype = torch.get_autocast_dtype(device_type) if to_lower else torch.float32

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device_type:
                return x.to(dtype)
            return x

        with torch._C._ExcludeDispatchKeyGuard(key):
            return op(*_each(cast, args), **{k: _one(cast, v) for k, v in kwargs.items()})

    return kernel


# --- install -------------------------------------------------------------------------------------------------
_LIBRARIES: list[Any] = []  # kept alive: a torch.library registration lasts as long as its Library object


def install(device: DeviceState, module: Any) -> None:
    """Rename PrivateUse1 to ``device.device_type`` and register ``module`` as ``torch.<device_type>``, the factory
    fallback and the autocast kernels. Once a process (PyTorch allows one rename)."""
    global _STATE
    from torch.utils import backend_registration

    _STATE = device
    # torch's (experimental) route for a device written in Python; standin_package checked that it exists
    backend_registration._setup_privateuseone_for_python_backend(device.device_type, backend_module=module)
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(_factory, "PrivateUse1")
    everything.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    casts = torch.library.Library("aten", "IMPL")
    for names, lower in ((LOWER_PRECISION, True), (FLOAT32, False)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                casts.impl(op, _autocast_kernel(op, lower), "AutocastPrivateUse1")
    _LIBRARIES.extend((everything, casts))
    storages.install(device.device_type)
    pinned.install()
    constructors.install(device.device_type)


# --- streams and events: orderings without a device queue -----------------------------------------------------
PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1, the device type a torch.Stream of the stand-in device carries
_STREAM_IDS = itertools.count()


class Stream(torch.Stream):
    """A stand-in stream: work runs when it is called, so every stream is already in order (``synchronize`` and
    ``wait_stream`` return at once). A ``torch.Stream`` of the device, as the real runtime's streams are, so operators
    that take one (``Tensor.record_stream``) accept it."""

    def __new__(cls, device: Any = None, priority: int = 0) -> Stream:
        return super().__new__(cls, stream_id=next(_STREAM_IDS), device_index=_index(device), device_type=PRIVATEUSE1)

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing is queued."""

    def wait_stream(self, stream: Stream) -> None:
        """Already in order."""

    def wait_event(self, event: Event) -> None:
        """Already in order."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True


class Event:
    """A stand-in event: ``record`` notes the host clock, so ``elapsed_time`` is host time in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing is queued."""

    def wait(self, stream: Stream | None = None) -> None:
        """Already in order."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Event) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end.at - self.at) * 1000.0


_CURRENT_STREAMS: dict[int, Stream] = {}


def current_stream(device: Any = None) -> Stream:
    index = _index(device)
    if index not in _CURRENT_STREAMS:
        _CURRENT_STREAMS[index] = Stream(index)
    return _CURRENT_STREAMS[index]


@contextlib.contextmanager
def stream_context(stream: Stream | None) -> Iterator[Stream | None]:
    """``torch.<device>.stream(s)``: makes ``s`` current for the block (work still runs when called)."""
    if stream is None:
        yield None
        return
    index = stream.device.index or 0
    before = current_stream(index)
    _CURRENT_STREAMS[index] = stream
    try:
        yield stream
    finally:
        _CURRENT_STREAMS[index] = before


def _index(device: Any) -> int:
    """A device given as None (the current one), an index, a string or a torch.device."""
    if device is None:
        return state().current
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return state().current if index is None else index


__all__ = ["DeviceState", "Event", "HostTensor", "Limits", "STANDIN_NOTE", "Stream", "current_stream", "install",
           "state", "stream_context"]
