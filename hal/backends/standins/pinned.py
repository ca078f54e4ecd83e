"""Pinned host memory for a stand-in device: ``Tensor.pin_memory()``, ``is_pinned()`` and DataLoader's pinning.

Pinned memory comes from the runtime's host allocator (``PrivateUse1HooksInterface::getPinnedMemoryAllocator``),
which only a runtime written in C++ can register: without one, ``pin_memory()`` raises. A stand-in's device memory
is host memory, so a pinned tensor is an ordinary host copy, remembered as pinned: ``pin_memory()`` returns a new
host tensor (as torch's does), ``is_pinned()`` answers True for it, and asynchronous copies from it run at once like
every stand-in copy. What this cannot show: the speed of page-locked transfers (not verified on hardware).
``torch.empty(..., pin_memory=True)`` still asks the allocator and is refused in torch's words.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

# a pinned copy's storage data_ptr -> its storage (torch keeps a storage's Python object while any tensor holds it)
_PINNED: dict[int, weakref.ref[Any]] = {}
_LIBRARIES: list[Any] = []  # kept alive: a torch.library registration lasts as long as its Library object


def install() -> None:
    """Host kernels for ``aten::_pin_memory`` and ``aten::is_pinned`` (ahead of torch's, which ask the allocator)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_pin_memory", _pin_memory, "CPU")
    library.impl("is_pinned", _is_pinned, "CPU")
    _LIBRARIES.append(library)


def _pin_memory(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
    pinned = torch.empty_like(tensor, memory_format=torch.preserve_format).copy_(tensor)
    storage = pinned.untyped_storage()
    if storage.nbytes():
        for key in [k for k, ref in _PINNED.items() if ref() is None]:
            del _PINNED[key]
        _PINNED[storage.data_ptr()] = weakref.ref(storage)
    return pinned


def _is_pinned(tensor: torch.Tensor, device: Any = None) -> bool:
    ref = _PINNED.get(tensor.untyped_storage().data_ptr()) if tensor.untyped_storage().nbytes() else None
    return ref is not None and ref() is not None
