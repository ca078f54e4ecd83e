"""Stand-ins for the vendor runtimes hal has no hardware for: a torch_npu-shaped and a torch_mlu-shaped runtime
whose ``npu`` / ``mlu`` devices keep their tensors in host memory (``host_device``, ``runtime``, ``torch_npu``,
``torch_mlu``), and HCCL / CNCL stand-ins over gloo (``ccl``).

Why: no tensor had ever lived on an ``npu`` or ``mlu`` device here; with the stand-ins the vendor paths — device
strings, factories, ``Module.to``, autocast, collectives on the device, checkpoints, stage-to-stage transfers —
can run on a laptop and in CI (``tests/cli/test_standins.py`` names those that do), and fail where the hardware's
documented limits would make them fail. A user's use: dry-run an Ascend or Cambricon job before queueing on the real cluster.

They are on only when asked (``hal.standin``: ``HAL_STANDIN``, set by ``--standin``); then the backend loads the
stand-in in place of the vendor package (``standin_package``). One vendor runtime per process: each owns PyTorch's
one PrivateUse1 device, so a process holds one of them (a plan with both runs them on different ranks).
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

from hal.errors import ConfigError, UnsupportedError
from hal.standin import device_count, requested

if TYPE_CHECKING:
    from .runtime import Vendor

_ACTIVE: tuple[str, ModuleType] | None = None  # (backend, its package) of this process


_KEPT_FREE = False  # this process launches ranks: PrivateUse1 stays free for the stand-ins they load


def keep_free() -> None:
    """This process starts ranks and loads no stand-in itself: what it asks of one is answered by a child process
    (``elsewhere``), and its ranks, forked from it with PrivateUse1 still free (``hal.launch.zygote``), each load
    their own vendor's. Called by ``hal train`` before its checks."""
    global _KEPT_FREE
    _KEPT_FREE = True


def _forked_child() -> None:
    """A child forked from a launcher that kept PrivateUse1 free (a rank, through the zygote) loads its own."""
    global _KEPT_FREE
    _KEPT_FREE = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


def kept_free() -> bool:
    """Whether this process keeps PrivateUse1 free for its ranks (``keep_free``) and has loaded no stand-in."""
    return _KEPT_FREE and _ACTIVE is None


class OwnedElsewhere(UnsupportedError):
    """This process's PrivateUse1 device is another vendor runtime's: the stand-in asked for runs in other processes
    (its ranks; a launcher asks a child, ``elsewhere``)."""


def active() -> str | None:
    """The backend whose stand-in this process runs, or None."""
    return None if _ACTIVE is None else _ACTIVE[0]


def standin_package(backend: str) -> ModuleType | None:
    """The stand-in package for ``backend`` when ``HAL_STANDIN`` asks for it (installed on first use), else None.
    UnsupportedError, one line, where it cannot be: another vendor runtime owns this process's PrivateUse1 device,
    or this torch cannot write a device in Python."""
    global _ACTIVE
    wanted = requested()
    if backend not in wanted:
        return None
    if _KEPT_FREE and _ACTIVE is None:
        raise OwnedElsewhere("one vendor runtime per process: this process starts the ranks and keeps PrivateUse1 free "
                             f"for them; the {backend} stand-in loads in its own ranks")
    if _ACTIVE is not None:
        if _ACTIVE[0] == backend:
            return _ACTIVE[1]
        raise OwnedElsewhere(f"one vendor runtime per process: the {_ACTIVE[0]} stand-in owns this process's "
                               f"PrivateUse1 device, so {backend}'s cannot load here; run {backend} on other ranks")
    import torch
    from torch.utils import backend_registration

    owner = torch._C._get_privateuse1_backend_name()
    if owner != "privateuseone":
        raise OwnedElsewhere(f"one vendor runtime per process: PrivateUse1 is already {owner!r} here, so the "
                               f"{backend} stand-in cannot load; run {backend} on other ranks")
    if not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"):
        raise UnsupportedError(f"the {backend} stand-in needs a torch that writes devices in Python (torch.utils."
                               f"backend_registration._setup_privateuseone_for_python_backend); torch {torch.__version__} "
                               "has none")
    from .runtime import register

    vendor = _vendor(backend)
    try:
        model = vendor.model(wanted[backend])
    except KeyError:
        raise ConfigError(f"HAL_STANDIN: {backend} has no stand-in model {wanted[backend]!r}; use one of "
                          f"{', '.join(vendor.models)}") from None
    # A device written in Python has one autograd device thread: a rank (torchrun's LOCAL_RANK set) sees one device,
    # its own npu:0 / mlu:0, as a rank does under its runtime's visible-devices variable; other processes see all.
    count = 1 if "LOCAL_RANK" in os.environ else device_count()
    package = register(vendor, model, count)
    _ACTIVE = (backend, package)
    return package


def _vendor(backend: str) -> Vendor:
    if backend == "ascend":
        from .torch_npu import ASCEND

        return ASCEND
    from .torch_mlu import CAMBRICON

    return CAMBRICON


__all__ = ["OwnedElsewhere", "active", "keep_free", "kept_free", "standin_package"]
