"""HCCL and CNCL stand-ins: a process group registered under the vendor library's name for the stand-in device,
moving the device's tensors through gloo over their host memory.

``torch.distributed.Backend.register_backend(name, creator, devices=[device_type])`` (torch's own
``test/distributed/test_c10d_pypg.py`` runs a Python process group the same way): a group made with
``"cpu:gloo,npu:hccl"`` then sends the npu tensors of every collective here, through c10d's PrivateUse1 kernels.
Each call unwraps the stand-in tensors to their host tensors and runs gloo's collective on them in place. What the
real library lacks is refused here too, in its words, so ``collectives/`` must route around it as it would on the
hardware: HCCL has no ``gather`` and no float64 reductions (CANN HCCL API reference); CNCL's float64
reductions are unconfirmed (no public dtype table), so the stand-in refuses them as ``backends/cambricon.py``
routes them.
"""
from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .host_device import STANDIN_NOTE, HostTensor


def _host(tensors: Sequence[Any]) -> list[Any]:
    return [_host(t) if isinstance(t, list) else (t.host if isinstance(t, HostTensor) else t) for t in tensors]


class StandinCCL(dist.ProcessGroup):
    """One group's vendor-library stand-in: gloo over the host tensors, the library's documented gaps refused."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, name: str,
                 unsupported: frozenset[str], no_reduce: frozenset[torch.dtype]) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._name, self._unsupported, self._no_reduce = name, unsupported, no_reduce

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self._name

    def _refuse(self, op: str, tensors: Sequence[Any] = (), reduces: bool = False) -> None:
        if op in self._unsupported:
            raise RuntimeError(f"{self._name.upper()} has no {op} ({self._name} {STANDIN_NOTE}; the library lacks it too)")
        if reduces:
            flat = [t for t in _flatten(tensors) if isinstance(t, torch.Tensor)]
            bad = [t.dtype for t in flat if t.dtype in self._no_reduce]
            if bad:
                raise RuntimeError(f"{self._name.upper()} reductions have no {bad[0]} ({self._name} {STANDIN_NOTE}; "
                                   "the library lacks it too)")

    # --- collectives: the names c10d's Python process groups override ------------------------------------------
    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        self._refuse("allreduce", tensors, reduces=True)
        return self._gloo.allreduce(_host(tensors), opts)

    def broadcast(self, tensors: list[Any], opts: Any) -> Any:
        return self._gloo.broadcast(_host(tensors), opts)

    def reduce(self, tensors: list[Any], opts: Any) -> Any:
        self._refuse("reduce", tensors, reduces=True)
        return self._gloo.reduce(_host(tensors), opts)

    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
        return self._gloo.allgather(_host(outputs), _host(inputs), *(() if opts is None else (opts,)))

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002 (torch's name)
        return self._gloo._allgather_base(*_host([output, input]), *(() if opts is None else (opts,)))

    def all_gather_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch 2.13's name for the flat all-gather (``all_gather_into_tensor``)."""
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch 2.13's name for the flat reduce-scatter (``reduce_scatter_tensor``)."""
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any) -> Any:
        self._refuse("reduce_scatter", outputs, reduces=True)
        return self._gloo.reduce_scatter(_host(outputs), _host(inputs), opts)

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        self._refuse("reduce_scatter", [output], reduces=True)
        return self._gloo._reduce_scatter_base(*_host([output, input]), *(() if opts is None else (opts,)))

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: list[int], input_split_sizes: list[int],  # noqa: A002
                      opts: Any = None) -> Any:
        out, into = _host([output, input])
        return self._gloo.alltoall_base(out, into, output_split_sizes, input_split_sizes,
                                        *(() if opts is None else (opts,)))

    def gather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
        self._refuse("gather")
        return self._gloo.gather(_host(outputs), _host(inputs), *(() if opts is None else (opts,)))

    def scatter(self, outputs: list[Any], inputs: list[list[Any]], opts: Any = None) -> Any:
        self._refuse("scatter")
        return self._gloo.scatter(_host(outputs), _host(inputs), *(() if opts is None else (opts,)))

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        return self._gloo.send(_host(tensors), dst, tag)

    def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
        return self._gloo.recv(_host(tensors), src, tag)

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier(*(() if opts is None else (opts,)))


def _flatten(items: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for item in items:
        out += _flatten(item) if isinstance(item, list) else [item]
    return out


def register_ccl(name: str, device_type: str, unsupported: frozenset[str], no_reduce: frozenset[torch.dtype]) -> None:
    """Register the stand-in library ``name`` for ``device_type`` (once a process)."""
    if name.upper() in dist.Backend._plugins:  # type: ignore[attr-defined]
        return

    def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> StandinCCL:
        return StandinCCL(store, rank, size, timeout, name, unsupported, no_reduce)

    dist.Backend.register_backend(name, create, devices=[device_type])


__all__ = ["StandinCCL", "register_ccl"]
