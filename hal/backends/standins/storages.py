"""Storages meant for a stand-in device: ``torch.load(map_location="npu")`` and ``storage.npu()`` without an allocator.

A device written in Python has tensors (``HostTensor`` wrappers) but no storages of its own: restoring a checkpoint's
storage "to npu" asks PrivateUse1 for a storage with bytes, and torch crashes (a segmentation fault). So the stand-in
restores such a storage on the host, notes the device it was meant for, and — as torch_npu wraps ``torch.load`` with
its own — the ``torch.load`` it installs moves every loaded tensor whose storage was meant for the device there once
torch's load returns. Outside a load, ``UntypedStorage.npu()`` is refused in one line instead of crashing.

A limit, said here and in docs/hardware.md: tensors that shared one storage in the file arrive as separate copies on
the device (a storage cannot be moved whole), and tensors inside objects other than dicts, lists, tuples and modules
stay on the host.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

PRIORITY = 9  # before torch's own deserializers (cpu is 10, PrivateUse1's 23): the first that answers restores


class _Loading(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.meant: dict[int, str] = {}  # a restored host storage's data_ptr -> the location it was meant for


_LOADING = _Loading()


def install(device_type: str) -> None:
    """Restore ``device_type`` storages on the host during a load, refuse ``storage.<device_type>()`` outside one, and
    wrap ``torch.load`` so the loaded tensors end on the device."""
    torch.serialization.register_package(PRIORITY, _tag, functools.partial(_restore, device_type))
    for cls in (torch.storage._StorageBase, torch.TypedStorage):
        setattr(cls, device_type, _storage_method(device_type))
        if not getattr(cls.to, "_hal_standin", False):
            cls.to = _storage_to(device_type, cls.to)  # type: ignore[method-assign]
    if not getattr(torch.load, "_hal_standin", False):
        torch.load = _wrap_load(torch.load)  # type: ignore[assignment]


_SAVING: dict[int, tuple[weakref.ref[Any], str]] = {}  # host storage data_ptr -> (its device tensor, its location)


def saving(host: torch.Tensor, location: str, owner: torch.Tensor) -> None:
    """``host`` holds the data of ``owner``, a tensor on the stand-in device at ``location``: torch.save tags its
    storage with that location, as the real runtime's storage would be tagged."""
    if len(_SAVING) > 4096:
        for key in [k for k, (ref, _) in _SAVING.items() if ref() is None]:
            del _SAVING[key]
    if host.untyped_storage().nbytes():
        _SAVING[host.untyped_storage().data_ptr()] = (weakref.ref(owner), location)


def _tag(storage: Any) -> str | None:
    """The location of a host storage that holds a living stand-in tensor's data (else another tagger answers)."""
    if storage.device.type != "cpu" or not storage.nbytes():
        return None
    entry = _SAVING.get(storage.data_ptr())
    return entry[1] if entry is not None and entry[0]() is not None else None


def _restore(device_type: str, storage: Any, location: str) -> Any:
    if not location.startswith(device_type):
        return None
    if not _LOADING.depth:
        raise RuntimeError(_refusal(device_type))
    _LOADING.meant[storage.data_ptr()] = location
    return storage


def _refusal(device_type: str) -> str:
    return (f"stand-in {device_type}: a device written in Python has no storages (stand-in: host-backed, not hardware); "
            f"move tensors, not storages (tensor.to('{device_type}')), or load with torch.load(map_location=...)")


def _to_device(device_type: str, storage: Any, device: Any) -> Any:
    """``storage`` moved "to the device" — during a load (a ``map_location`` function): kept on the host and moved with
    its tensors once the load returns; outside a load: refused in one line (torch would crash)."""
    if not _LOADING.depth:
        raise RuntimeError(_refusal(device_type))
    index = device if isinstance(device, int) else (torch.device(device).index if device is not None else None)
    untyped = storage.untyped() if isinstance(storage, torch.TypedStorage) else storage
    _LOADING.meant[untyped.data_ptr()] = f"{device_type}:{index or 0}"
    return storage


def _storage_method(device_type: str) -> Callable[..., Any]:
    def to_device(self: Any, device: Any = None, non_blocking: bool = False) -> Any:
        return _to_device(device_type, self, device)

    to_device.__name__ = device_type
    return to_device


def _storage_to(device_type: str, to: Callable[..., Any]) -> Callable[..., Any]:
    """A storage class's ``to``, sending the stand-in's device type to ``_to_device`` (``storage.cuda()`` and the
    migration shim's mapped devices arrive here)."""
    @functools.wraps(to)
    def standin_to(self: Any, *, device: Any, non_blocking: bool = False) -> Any:
        if torch.device(device).type == device_type:
            return _to_device(device_type, self, device)
        return to(self, device=device, non_blocking=non_blocking)

    standin_to._hal_standin = True  # type: ignore[attr-defined]
    return standin_to


def _wrap_load(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def standin_load(*args: Any, **kwargs: Any) -> Any:
        _LOADING.depth += 1
        try:
            loaded = load(*args, **kwargs)
        finally:
            _LOADING.depth -= 1
        if _LOADING.depth or not _LOADING.meant:
            return loaded
        meant, _LOADING.meant = _LOADING.meant, {}
        return _moved(loaded, meant, {})

    standin_load._hal_standin = True  # type: ignore[attr-defined]
    return standin_load


def _moved(value: Any, meant: dict[int, str], seen: dict[int, Any]) -> Any:
    """``value`` with every host tensor whose storage was meant for the device moved there (one copy per tensor)."""
    if id(value) in seen:
        return seen[id(value)]
    out = value
    if isinstance(value, torch.Tensor):
        where = meant.get(value.untyped_storage().data_ptr()) if value.device.type == "cpu" else None
        if where is not None:
            moved = value.detach().to(where)
            out = torch.nn.Parameter(moved, value.requires_grad) if isinstance(value, torch.nn.Parameter) else \
                moved.requires_grad_(value.requires_grad)
    elif isinstance(value, torch.nn.Module):
        for tensor in [*value.parameters(), *value.buffers()]:
            where = meant.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
            if where is not None:
                value.to(where)  # a module moves whole, as map_location would have left it
                break
    elif isinstance(value, dict):
        items = [(k, _moved(v, meant, seen)) for k, v in value.items()]
        if any(v is not value[k] for k, v in items):
            out = value.copy()  # the same mapping type (OrderedDict, defaultdict ...)
            out.update(items)
    elif isinstance(value, (list, tuple)):
        items = [_moved(v, meant, seen) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            out = type(value)(items) if isinstance(value, list) or not hasattr(value, "_fields") else type(value)(*items)
    seen[id(value)] = out
    return out
