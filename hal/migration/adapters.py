"""The adapters for devices, autocast and loss scaling, checkpoints and DDP: one function per name
in the mapping table's ``to`` column, each returning the replacement for the patched attribute."""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from hal.migration.mapping import _REAL_DEVICE, CUDA, Patch, _location, rewrite_map_location
from hal.migration.session import Session, called_by_torch, cuda_function, replace_callable, rewrite_arguments

# The real objects, taken before any patch (the shim calls them with the target's names).
_REAL_AUTOCAST: type = torch.amp.autocast_mode.autocast
_REAL_GET_AUTOCAST_DTYPE: Callable[[str], torch.dtype] = torch.get_autocast_dtype
_REAL_CUSTOM_FWD: Callable[..., Any] = torch.amp.custom_fwd
_REAL_CUSTOM_BWD: Callable[..., Any] = torch.amp.custom_bwd
Adapter = Callable[[Patch, Session, Any], Any]


def device_class(row: Patch, session: Session, original: Any) -> Any:
    """torch.device becomes a proxy class named ``torch.device``.

    A device pickles as ``(getattr(torch, "device"), args)`` — torch looks the class up at
    pickling time — so the proxy must carry the real module and name for pickle to accept it.
    """
    return replace_callable(_REAL_DEVICE, session, session.make_device)


def device_context(row: Patch, session: Session, original: Any) -> Any:
    return replace_callable(original, session, lambda device: _DeviceContext(session, device))


class _DeviceContext:
    """``with <cuda>.device(i):`` on the backend: select device i, then put the old one back."""

    def __init__(self, session: Session, device: Any) -> None:
        self._backend = session.backend
        self._index = None if device is None or device == -1 else session.index(device)
        self._previous: int | None = None

    def __enter__(self) -> _DeviceContext:
        if self._index is not None:
            self._previous = self._backend.current_device()
            if self._previous != self._index:
                self._backend.set_device(self._index)
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._previous is not None and self._previous != self._index:
            self._backend.set_device(self._previous)
        return False


def _cuda_autocast_dtype() -> torch.dtype:
    """What CUDA autocast would use with no dtype: float16 unless the script changed it."""
    try:
        return _REAL_GET_AUTOCAST_DTYPE(CUDA)
    except (AttributeError, RuntimeError):
        return torch.float16


def autocast(row: Patch, session: Session, original: Any) -> Any:
    signature = inspect.signature(_REAL_AUTOCAST.__init__)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        if bound.arguments.get("device_type") == CUDA:
            bound.arguments["device_type"] = session.device_type
            if bound.arguments.get("dtype") is None:
                bound.arguments["dtype"] = _cuda_autocast_dtype()
        return original(*bound.args[1:], **bound.kwargs)

    return replace_callable(original, session, impl)


def cuda_autocast(row: Patch, session: Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, enabled, dtype=float16, cache_enabled)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        return _REAL_AUTOCAST(session.device_type, dtype=a["dtype"], enabled=a["enabled"], cache_enabled=a["cache_enabled"])

    return replace_callable(original, session, impl)


def autocast_query(row: Patch, session: Session, original: Any) -> Any:
    """is_autocast_enabled / get/set_autocast_dtype / set_autocast_enabled: 'cuda' means the target.

    With no device argument ``is_autocast_enabled()`` is CUDA's state (torch's legacy meaning).
    """

    def impl(*args: Any, **kwargs: Any) -> Any:
        if called_by_torch(2):
            return original(*args, **kwargs)
        if args and args[0] == CUDA:
            args = (session.device_type, *args[1:])
        elif kwargs.get("device_type") == CUDA:
            kwargs = {**kwargs, "device_type": session.device_type}
        elif not args and not kwargs and row.where == "is_autocast_enabled":
            args = (session.device_type,)
        return original(*args, **kwargs)

    return replace_callable(original, session, impl)


def autocast_gpu_query(row: Patch, session: Session, original: Any) -> Any:
    """torch.get_autocast_gpu_dtype() (deprecated CUDA query) -> the target's autocast dtype."""
    return replace_callable(original, session, lambda: _REAL_GET_AUTOCAST_DTYPE(session.device_type))


def cuda_custom_fwd(row: Patch, session: Session, original: Any) -> Any:
    """The CUDA module's amp.custom_fwd -> torch.amp.custom_fwd(device_type=target): cast_inputs keeps casting."""

    def impl(fwd: Any = None, *, cast_inputs: Any = None) -> Any:
        return _REAL_CUSTOM_FWD(fwd, device_type=session.device_type, cast_inputs=cast_inputs)

    return replace_callable(original, session, impl)


def cuda_custom_bwd(row: Patch, session: Session, original: Any) -> Any:
    def impl(bwd: Any = None) -> Any:
        return _REAL_CUSTOM_BWD(bwd, device_type=session.device_type)

    return replace_callable(original, session, impl)


def grad_scaler(row: Patch, session: Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, device="cuda", init_scale, ...)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        options.pop("self", None)
        device = options.pop("device")
        if not (isinstance(device, str) and device.startswith(CUDA)):
            return original(device, **options)
        return session.backend.grad_scaler(**options)

    return replace_callable(original, session, impl)


def cuda_grad_scaler(row: Patch, session: Session, original: Any) -> Any:
    signature = inspect.signature(original.__init__)  # (self, init_scale, growth_factor, ...)

    def impl(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k != "self"}
        return session.backend.grad_scaler(**options)

    return replace_callable(original, session, impl)


def bf16_supported(row: Patch, session: Session, original: Any) -> Any:
    """CUDA's answer: native bf16, or (including_emulation, the default) bf16 computed some other way."""
    from hal.capabilities import DtypeSupport

    def impl(including_emulation: bool = True) -> bool:
        support = session.backend.capabilities().support("bf16")
        return support is DtypeSupport.NATIVE or (bool(including_emulation) and support is DtypeSupport.EMULATED)

    return cuda_function(row, session, original, impl)


class _FlagSwitch:
    """Stands in for a CUDA settings object; ``handle(attr, value)`` takes the writes it maps."""

    def __init__(self, original: Any, session: Session, name: str,
                 read: Callable[[str], Any], write: Callable[[str, Any], bool]) -> None:
        object.__setattr__(self, "_hal", (original, session, name, read, write))

    def __getattr__(self, attr: str) -> Any:
        original, session, _, read, _ = object.__getattribute__(self, "_hal")
        if session.active:
            value = read(attr)
            if value is not NotImplemented:
                return value
        return getattr(original, attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        original, session, _, _, write = object.__getattribute__(self, "_hal")
        if not (session.active and write(attr, value)):
            setattr(original, attr, value)


def tf32_switch(row: Patch, session: Session, original: Any) -> Any:
    """torch.backends.cuda.matmul: TF32 requests go to the backend's reduced-precision switch."""

    def read(attr: str) -> Any:
        return session.backend.reduced_precision_matmul_enabled() if attr == "allow_tf32" else NotImplemented

    def write(attr: str, value: Any) -> bool:
        if attr not in ("allow_tf32", "fp32_precision"):
            return False
        enabled = bool(value) if attr == "allow_tf32" else value == "tf32"
        session.set_reduced_precision(enabled, f"{row.name}.{attr}")
        return True

    return _FlagSwitch(original, session, row.name, read, write)


def cudnn_switch(row: Patch, session: Session, original: Any) -> Any:
    """torch.backends.cudnn: TF32 convolutions have no mapped mode on the target; enabling them is warned.

    benchmark / deterministic / enabled pass through: they are cuDNN's own and change no numbers here.
    """

    def read(attr: str) -> Any:
        return False if attr == "allow_tf32" else NotImplemented

    def write(attr: str, value: Any) -> bool:
        if attr not in ("allow_tf32", "fp32_precision"):
            return False
        if bool(value) and value != "ieee":
            session.warn_once(f"{row.where}.{attr}", f"torch.backends.cudnn.{attr} = {value!r} has no equivalent on "
                              f"{session.backend.name}; ignored, convolutions keep the target's own fp32 precision")
        return True

    return _FlagSwitch(original, session, row.name, read, write)


def map_location(row: Patch, session: Session, original: Any) -> Any:
    def impl(*args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:
            args = (args[0], rewrite_map_location(args[1], session.device_type), *args[2:])
        else:
            kwargs["map_location"] = rewrite_map_location(kwargs.get("map_location"), session.device_type)
        return original(*args, **kwargs)

    return replace_callable(original, session, impl)


def tensor_to_target(row: Patch, session: Session, original: Any) -> Any:
    def impl(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        return self.to(session.map_device(CUDA if device is None else device), non_blocking=non_blocking, **kwargs)

    return replace_callable(original, session, impl)


def module_to_target(row: Patch, session: Session, original: Any) -> Any:
    def impl(self: torch.nn.Module, device: Any = None) -> Any:
        return self.to(session.map_device(CUDA if device is None else device))

    return replace_callable(original, session, impl)


def is_target(row: Patch, session: Session, original: Any) -> Any:
    def fget(tensor: torch.Tensor) -> bool:
        if not session.active or called_by_torch(1):
            return bool(original.__get__(tensor, type(tensor)))
        return tensor.device.type == session.device_type

    return property(fget, doc=f"True when the tensor is on the migration target ({session.device_type}).")


def get_device(row: Patch, session: Session, original: Any) -> Any:
    """On the cpu target a host tensor is "on device 0", as ``is_cuda`` says it is on the device."""

    def impl(self: torch.Tensor) -> int:
        index = original(self)
        if index == -1 and session.device_type == "cpu" and not called_by_torch(2):
            return 0
        return index

    return replace_callable(original, session, impl)


_FIRST_OR_DEVICE = (frozenset({0}), frozenset({"device"}))


def pin_memory(row: Patch, session: Session, original: Any) -> Any:
    """Pinning stages host memory for device copies; on the host target a plain copy is exact."""
    def impl(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if session.device_type == "cpu":
            return self.clone()
        args, kwargs = rewrite_arguments(args, kwargs, _FIRST_OR_DEVICE, session.map_device)
        return original(self, *args, **kwargs)

    return replace_callable(original, session, impl)


def record_stream(row: Patch, session: Session, original: Any) -> Any:
    def impl(self: torch.Tensor, stream: Any) -> None:
        if session.device_type == "cpu":
            return None
        return original(self, stream)

    return replace_callable(original, session, impl)


def loader_pinning(row: Patch, session: Session, original: Any) -> Any:
    """DataLoader(pin_memory=True): pinned host batches only speed up copies to a device; on the cpu
    target the batches are already where they are used, so pinning is off (same batches, no warning
    from torch that no accelerator was found)."""
    signature = inspect.signature(original)

    def impl(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        if session.device_type == "cpu":
            bound.arguments["pin_memory"] = False
            bound.arguments.pop("pin_memory_device", None)
        elif bound.arguments.get("pin_memory_device"):
            bound.arguments["pin_memory_device"] = _location(session.map_device(bound.arguments["pin_memory_device"], ints=False))
        original(*bound.args, **bound.kwargs)

    return replace_callable(original, session, impl)


def ddp_devices(row: Patch, session: Session, original: Any) -> Any:
    """DDP takes no device_ids for host modules; elsewhere CUDA devices map, ordinals stay."""

    def impl(self: Any, module: Any, device_ids: Any = None, output_device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if session.device_type == "cpu":
            device_ids, output_device = None, None
        else:
            device_ids = None if device_ids is None else [_location(session.map_device(d, ints=False)) for d in device_ids]
            output_device = session.map_device(output_device, ints=False)
        return original(self, module, device_ids, output_device, *args, **kwargs)

    return replace_callable(original, session, impl)


ADAPTERS: dict[str, Adapter] = {
    "device_class": device_class,
    "device_context": device_context,
    "autocast": autocast,
    "cuda_autocast": cuda_autocast,
    "autocast_query": autocast_query,
    "autocast_gpu_query": autocast_gpu_query,
    "cuda_custom_fwd": cuda_custom_fwd,
    "cuda_custom_bwd": cuda_custom_bwd,
    "grad_scaler": grad_scaler,
    "cuda_grad_scaler": cuda_grad_scaler,
    "bf16_supported": bf16_supported,
    "tf32_switch": tf32_switch,
    "cudnn_switch": cudnn_switch,
    "map_location": map_location,
    "tensor_to_target": tensor_to_target,
    "module_to_target": module_to_target,
    "is_target": is_target,
    "get_device": get_device,
    "pin_memory": pin_memory,
    "ddp_devices": ddp_devices,
    "record_stream": record_stream,
    "loader_pinning": loader_pinning,
}
