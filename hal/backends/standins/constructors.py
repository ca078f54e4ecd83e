"""``torch.tensor(data, device=npu)`` and ``torch.as_tensor`` on a stand-in device.

torch builds a tensor from Python data in C++ (``internal_new_from_data``) with the Python dispatch key excluded,
so the copy to a device written in Python reaches no kernel and torch's own assert fires ("func != nullptr",
python_dispatch.cpp) — ``torch.tensor([1.0], device="npu")``, in model code and in OpInfo's sample inputs, failed
on the stand-in (found by ``hal conformance survey``, 2026-12-08). The vendors' runtimes build there in C++; the
stand-in builds the tensor on the host and copies it to the device, which is what the hardware's path computes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_ORIGINAL: dict[str, Callable[..., Any]] = {}


def _on_device(device_type: str, build: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(build)
    def constructor(data: Any, *args: Any, device: Any = None, requires_grad: bool = False, **kwargs: Any) -> Any:
        target = torch.device(device) if device is not None else None
        if target is None or target.type != device_type:
            extra = {"requires_grad": requires_grad} if requires_grad else {}
            return build(data, *args, device=device, **kwargs, **extra)
        if isinstance(data, torch.Tensor) and data.device == target and build is _ORIGINAL.get("as_tensor"):
            return data if not kwargs.get("dtype") else data.to(kwargs["dtype"])
        host = build(data.cpu() if isinstance(data, torch.Tensor) else data, *args, **kwargs)
        moved = host.to(target)
        return moved.requires_grad_(True) if requires_grad else moved
    return constructor


def install(device_type: str) -> None:
    """Wrap ``torch.tensor`` and ``torch.as_tensor`` for ``device_type``; once a process."""
    for name in ("tensor", "as_tensor"):
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(torch, name)
            setattr(torch, name, _on_device(device_type, _ORIGINAL[name]))
