"""One collective API for every backend and for groups that span vendor islands.

``Communicator`` is what callers use: ``all_reduce``, ``all_gather`` (one tensor, a list, uneven
dim 0), ``reduce_scatter``, ``all_to_all`` (equal or uneven splits), ``broadcast``, ``reduce``,
``gather``, ``scatter``, ``send``/``recv``, ``batch_p2p`` and ``barrier`` — each with
``async_op`` (a ``Handle``) and a per-call ``timeout``. Inside one island the calls go straight
to the backend's CCL; a group spanning islands goes through ``collectives.bridge`` behind the
same methods, so callers never ask which path they are on. Ranks (``src``, ``dst``, ``peer``)
are global ranks, as in torch.distributed.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from hal.backend import Backend, CclGap
from hal.backend_registry import get_backend
from hal.downgrades import Downgrade, record_downgrade

from .bridge import Bridge
from .failures import starting, wait_all
from .p2p import P2P
from .p2p_check import check_peers
from .process_groups import Layout, World, aborted, current_world, make_layout
from .serial_worker import SerialWorker
from .validation import (
    REDUCE_OPS,
    SPLITS_IN,
    SPLITS_OUT,
    CallSignature,
    CollectiveError,
    agree_splits,
    all_gather_single,
    check,
    exchange,
    exchange_split_rows,
    reduce_scatter_single,
    split_row,
)

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}  # fmt: skip


class Handle:
    """The result of an ``async_op=True`` call: ``wait()`` returns what the sync call returns.

    Without an explicit timeout, ``wait`` keeps the CCL's own semantics (on NCCL: the current
    stream waits for the collective, the host does not); the group's timeout and the CCL's
    watchdog still bound it. An explicit per-call timeout makes the host wait, bounded by it.
    A failure is one named error (``failures``): a timeout, a lost peer, or the CCL's own.
    """

    def __init__(
        self, works: Sequence[Any], finish: Callable[[], Any], timeout: datetime.timedelta | None, what: str,
        peers: Sequence[int] = (),
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._timeout = timeout
        self._what = what
        self._peers = tuple(peers)
        self._done = False
        self._result: Any = None

    def wait(self, timeout: datetime.timedelta | None = None) -> Any:
        if not self._done:
            wait_all(self._works, timeout or self._timeout, self._what, self._peers)
            self._result = self._finish()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


P2P_THREAD_ENV = "HAL_BRIDGE_P2P_THREAD"  # "0": bridged point-to-point calls complete in the caller (no thread)


class _FutureWork:
    """A call running on a ``SerialWorker``, as the work item ``Handle`` waits on: waiting only waits (the call's own
    error, already named by the bridge, is raised by the handle's result)."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_futures([self._future], None if timeout is None else timeout.total_seconds())
        return self._future.done()

    def is_completed(self) -> bool:
        return self._future.done()


class Communicator:
    """Collectives over a set of ranks; native inside an island, bridged across islands."""

    def __init__(
        self,
        layout: Layout,
        world: World | None = None,
        *,
        validate: bool = True,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        self.world = world or current_world()
        self.layout = layout
        self.validate = validate
        self.timeout = timeout or self.world.timeout
        self._seq = 0
        self._peers = tuple(r for r in layout.ranks if r != self.world.rank)
        self._gaps: dict[tuple[str, torch.dtype, str | None], CclGap | None] = {}
        self._island_backend = get_backend(layout.island_of(self.rank).backend) if self.is_member else self.backend
        self._bridge: Bridge | None = None
        self._p2p_worker: SerialWorker | None = None  # bridged point-to-point calls, in posting order (_bridged_p2p)
        if layout.is_heterogeneous and self.is_member:
            with self._bridged("setup"):
                self._bridge = Bridge(layout, self.rank, self.backend, self.device, self.timeout, self._gap)

    # --- who and where ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.layout.ranks

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def group_rank(self) -> int:
        return self.layout.ranks.index(self.rank)

    @property
    def is_member(self) -> bool:
        return self.rank in self.layout.ranks

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def backend(self) -> Backend:
        return self.world.backend

    @property
    def native_group(self) -> dist.ProcessGroup | None:
        """The CCL group of this rank's island (the whole group when it is homogeneous)."""
        return self.layout.island_of(self.rank).group

    @property
    def peers(self) -> tuple[int, ...]:
        """The other ranks of this group (who a lost connection can be with)."""
        return self._peers

    @property
    def path(self) -> str:
        return "bridge" if self.layout.is_heterogeneous else f"native {self.backend.ccl}"

    def subgroup(self, ranks: Sequence[int], *, validate: bool | None = None) -> Communicator:
        """A communicator over ``ranks``. Every rank of the world must call it (torch's rule)."""
        self._alive("subgroup")
        layout = make_layout(self.world, ranks)
        return Communicator(layout, self.world, validate=self.validate if validate is None else validate, timeout=self.timeout)

    # --- the checks every call makes --------------------------------------------------------------
    def _begin(
        self,
        op: str,
        tensor: torch.Tensor | None,
        *,
        reduce_op: str | None = None,
        root: int = -1,
        timeout: datetime.timedelta | None = None,
        splits: int = 0,
    ) -> list[CallSignature] | None:
        self._alive(op)
        if not self.is_member:
            raise CollectiveError(f"{op}: rank {self.rank} is not in this group ({list(self.ranks)}); call it only on member ranks")
        if reduce_op is not None and reduce_op not in REDUCE_OPS:
            raise CollectiveError(f"{op}: reduce op {reduce_op!r} is unknown; use one of {', '.join(REDUCE_OPS)}")
        if root != -1 and root not in self.ranks:
            raise CollectiveError(f"{op}: root rank {root} is not in this group ({list(self.ranks)}); pass a member's global rank")
        if reduce_op == "avg" and tensor is not None and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CollectiveError(f"{op}: avg of {str(tensor.dtype).replace('torch.', '')} tensors is not exact; "
                                  "use sum and divide, or a float dtype")
        self._seq += 1
        device_ok = tensor is None or self._on_my_device(tensor)
        if not self.validate:
            if not device_ok:
                raise CollectiveError(f"{op}: tensor is on {tensor.device}, this rank's device is {self.device}; move it with .to(device)")
            return None
        mine = CallSignature(
            op, self._seq, None if tensor is None else tensor.dtype, () if tensor is None else tuple(tensor.shape),
            "none" if tensor is None else tensor.device.type, device_ok, reduce_op, root, splits,
        )
        signatures = exchange(mine, self.layout.host_group, self.ranks, timeout or self.timeout, self.rank)
        check(signatures, self.ranks, self.device.type)
        return signatures

    def _alive(self, op: str) -> None:
        """Refuse at once once a failure aborted this process's groups (they are gone; a call would hang or crash)."""
        reason = aborted()
        if reason is not None:
            raise CollectiveError(f"{op}: this rank's collectives were aborted after an earlier failure ({reason[:300]}); "
                                  "end this rank — it cannot communicate any more")

    def _starting(self, what: str, group: dist.ProcessGroup | None, timeout: datetime.timedelta | None) -> ContextManager[None]:
        """Start this call's CCL op inside the block: bounded by the call's timeout, start errors named (``failures``)."""
        return starting([group], timeout or self.timeout, what, self.peers)

    def _bridged(self, what: str) -> ContextManager[None]:
        """A bridged call: every group it may use is bounded by this communicator's timeout, start errors named."""
        groups = [*self.layout.channels, self.layout.leaders_group, *(i.group for i in self.layout.islands)]
        return starting([g for g in groups if g is not None], self.timeout, f"bridge {what}", self.peers)

    def _on_my_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != self.device.type:
            return False
        return self.device.type == "cpu" or tensor.device.index in (None, self.device.index)

    def _gap(self, op: str, tensor: torch.Tensor, reduce_op: str | None) -> bool:
        """True when the island's CCL cannot do this op/dtype and the call must go through the host."""
        key = (op, tensor.dtype, reduce_op)
        if key not in self._gaps:  # capability data is static: look each combination up once
            self._gaps[key] = find_gap(self._island_backend, op, tensor.dtype, reduce_op)
        gap = self._gaps[key]
        if gap is None:
            return False
        backend = self._island_backend
        dtype = str(tensor.dtype).replace("torch.", "")
        if gap.handling == "refuse":
            raise CollectiveError(f"{op}: {backend.ccl} cannot do {gap.op or op} on {dtype} ({gap.source}); use another dtype")
        record_downgrade(Downgrade("ccl", f"{op} on {backend.ccl}/{dtype}", backend.ccl, "host gloo (staged copy)", gap.source))
        return True

    def _reduce_with(self, op: str, group: dist.ProcessGroup | None) -> str:
        """The reduce op the CCL runs: ``op`` itself, or sum for an avg it lacks (divided after)."""
        runs_on = get_backend("cpu") if group is self.layout.host_group else self._island_backend
        if op in runs_on.ccl_reduce_ops:
            return op
        if op == "avg":
            return "sum"
        raise CollectiveError(f"{runs_on.ccl} has no {op} reduction; use one of {', '.join(sorted(runs_on.ccl_reduce_ops))}")

    def _run(self, works: Sequence[Any], finish: Callable[[], Any], async_op: bool, what: str, timeout: datetime.timedelta | None) -> Any:
        handle = Handle(works, finish, timeout, what, self.peers)
        return handle if async_op else handle.wait()

    def _group_for(self, op: str, tensor: torch.Tensor, reduce_op: str | None) -> tuple[dist.ProcessGroup | None, torch.Tensor]:
        """(group, tensor to communicate): the island's CCL, or the host group with a host copy."""
        if self._gap(op, tensor, reduce_op):
            return self.layout.host_group, tensor.detach().cpu()
        return self.native_group, tensor

    # --- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        """Reduce ``tensor`` across ranks, in place; returns it."""
        self._begin("all_reduce", tensor, reduce_op=op, timeout=timeout)
        if self._bridge is not None:
            with self._bridged("all_reduce"):
                return self._done(self._bridge.all_reduce(tensor, op), async_op)
        group, buf = self._group_for("all_reduce", tensor, op)
        native = self._reduce_with(op, group)
        with self._starting("all_reduce", group, timeout):
            work = dist.all_reduce(buf, op=_TORCH_OPS[native], group=group, async_op=True)

        def finish() -> torch.Tensor:
            if native != op:
                buf.div_(self.size)
            return _copy_back(tensor, buf)

        return self._run([work], finish, async_op, "all_reduce", timeout)

    def all_gather(
        self, tensor: torch.Tensor, *, sizes: Sequence[int] | None = None, out: torch.Tensor | None = None,
        async_op: bool = False, timeout: datetime.timedelta | None = None,
    ) -> Any:
        """Every rank's tensor concatenated along dim 0 (dim 0 may differ between ranks).

        With validation on, each rank's dim 0 is known from the check; with it off, pass
        ``sizes`` for uneven inputs (equal sizes are assumed otherwise). ``out`` (optional)
        receives the result, so hot loops need not allocate.
        """
        return self._all_gather(tensor, sizes, async_op, timeout, out)[0]

    def _all_gather(
        self, tensor: torch.Tensor, sizes: Sequence[int] | None, async_op: bool, timeout: datetime.timedelta | None,
        out: torch.Tensor | None = None,
    ) -> tuple[Any, list[int]]:
        signatures = self._begin("all_gather", tensor, timeout=timeout)
        known = self._dim0_sizes(tensor, signatures, sizes)
        if out is not None:
            _check_out("all_gather", out, (sum(known), *tensor.shape[1:]), tensor)
        if self._bridge is not None:
            with self._bridged("all_gather"):
                return self._done(_into(out, self._bridge.all_gather(tensor, known)), async_op), known
        group, buf = self._group_for("all_gather", tensor, None)
        longest = max(known)
        even = longest * self.size == sum(known)
        padded = buf if buf.shape[0] == longest else _pad_dim0(buf, longest)
        direct = out is not None and even and buf is tensor and out.is_contiguous()
        gathered = out if direct else padded.new_empty((longest * self.size, *buf.shape[1:]))
        with self._starting("all_gather", group, timeout):
            work = all_gather_single(gathered, padded.contiguous(), group=group, async_op=True)

        def finish() -> torch.Tensor:
            if direct:
                return gathered
            result = gathered if even else torch.cat([p[:n] for p, n in zip(gathered.split(longest), known)])
            return _into(out, result.to(tensor.device) if buf is not tensor else result)

        return self._run([work], finish, async_op, "all_gather", timeout), known

    def all_gather_list(self, tensor: torch.Tensor, *, sizes: Sequence[int] | None = None,
                        timeout: datetime.timedelta | None = None) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (dim 0 may differ)."""
        gathered, known = self._all_gather(tensor, sizes, False, timeout)
        return list(gathered.split(known))

    def reduce_scatter(
        self, tensor: torch.Tensor, op: str = "sum", *, out: torch.Tensor | None = None, async_op: bool = False,
        timeout: datetime.timedelta | None = None,
    ) -> Any:
        """Reduce across ranks, then return this rank's equal slice of dim 0 (into ``out`` if given)."""
        self._begin("reduce_scatter", tensor, reduce_op=op, timeout=timeout)
        if tensor.shape[0] % self.size:
            raise CollectiveError(f"reduce_scatter: dim 0 ({tensor.shape[0]}) is not divisible by the group size {self.size}; pad it")
        shape = (tensor.shape[0] // self.size, *tensor.shape[1:])
        if out is not None:
            _check_out("reduce_scatter", out, shape, tensor)
        if self._bridge is not None:
            with self._bridged("reduce_scatter"):
                return self._done(_into(out, self._bridge.reduce_scatter(tensor, op)), async_op)
        group, buf = self._group_for("reduce_scatter", tensor, op)
        native = self._reduce_with(op, group)
        direct = out is not None and buf is tensor and out.is_contiguous()
        scattered = out if direct else buf.new_empty(shape)
        with self._starting("reduce_scatter", group, timeout):
            work = reduce_scatter_single(scattered, buf.contiguous(), op=_TORCH_OPS[native], group=group, async_op=True)

        def finish() -> torch.Tensor:
            if native != op:
                scattered.div_(self.size)
            return scattered if direct else _into(out, scattered.to(tensor.device))

        return self._run([work], finish, async_op, "reduce_scatter", timeout)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        input_splits: Sequence[int] | None = None,
        output_splits: Sequence[int] | None = None,
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
        timeout: datetime.timedelta | None = None,
    ) -> Any:
        """Send dim-0 slice i of ``tensor`` to rank i; returns what every rank sent here, in rank order.

        With validation on, every rank's split sizes are checked on every rank (``agree_splits``): a
        bad list on one rank is the same error, naming it, everywhere, and ``output_splits`` is
        computed when left out. Without it, the sizes each rank receives are exchanged when
        ``output_splits`` is left out, with a flag per rank, so a bad list still fails everywhere.
        """
        given = (SPLITS_IN if input_splits is not None else 0) | (SPLITS_OUT if output_splits is not None else 0)
        signatures = self._begin("all_to_all", tensor, timeout=timeout, splits=given)
        if signatures is not None:
            rows_of = None
            if any(sig.splits for sig in signatures):
                mine = split_row(self.size, input_splits, output_splits)
                rows_of = exchange_split_rows(mine, self.layout.host_group, self.ranks, timeout or self.timeout,
                                              f"all_to_all (call #{self._seq}) split sizes", self.rank)
            sends = agree_splits(signatures, rows_of, self.ranks)
            me = self.group_rank
            input_splits, output_splits = sends[me], [row[me] for row in sends]
        else:
            fits = input_splits is not None and len(input_splits) == self.size and min(input_splits) >= 0 and sum(input_splits) == tensor.shape[0]
            if input_splits is None and tensor.shape[0] % self.size:
                raise CollectiveError(f"all_to_all: dim 0 ({tensor.shape[0]}) is not divisible by the group size {self.size}; pass input_splits")
            if input_splits is not None and output_splits is None:
                output_splits = self._exchange_splits(list(input_splits) if fits else None, timeout)
            elif input_splits is not None and not fits:
                raise CollectiveError(f"all_to_all: input_splits {list(input_splits)} must have {self.size} non-negative sizes "
                                      f"summing to dim 0 ({tensor.shape[0]})")
        rows = sum(output_splits) if output_splits is not None else tensor.shape[0]
        if out is not None:
            _check_out("all_to_all", out, (rows, *tensor.shape[1:]), tensor)
        if self._bridge is not None:
            with self._bridged("all_to_all"):
                return self._done(_into(out, self._bridge.all_to_all(tensor, input_splits, output_splits)), async_op)
        group, buf = self._group_for("all_to_all", tensor, None)
        direct = out is not None and buf is tensor and out.is_contiguous()
        received = out if direct else buf.new_empty((rows, *buf.shape[1:]))
        with self._starting("all_to_all", group, timeout):
            work = dist.all_to_all_single(
                received, buf.contiguous(), output_split_sizes=None if output_splits is None else list(output_splits),
                input_split_sizes=None if input_splits is None else list(input_splits), group=group, async_op=True,
            )

        def finish() -> torch.Tensor:
            return received if direct else _into(out, received.to(tensor.device))

        return self._run([work], finish, async_op, "all_to_all", timeout)

    def all_to_all_blocks(
        self, tensor: torch.Tensor, send_blocks: Sequence[Sequence[int]], recv_blocks: Sequence[Sequence[int]], *,
        timeout: datetime.timedelta | None = None,
    ) -> torch.Tensor:
        """Several uneven all-to-alls as one exchange: block row j sends ``tensor``'s j-th chunk
        (``send_blocks[j][r]`` rows to rank r, in rank order) and receives ``recv_blocks[j][s]`` rows from each
        rank s into the output's j-th chunk. A caller that needs what arrives grouped by j and then by source
        (an MoE's rows by local expert) gets it with no copy after the exchange.

        Where the CCL groups ops (``Backend.ccl_coalesces``) and the call is native and unvalidated, the rows'
        all-to-alls start as one grouped launch; otherwise one ``all_to_all`` per row (each validated when the
        communicator validates), started together and waited for at the end."""
        rows_in, rows_out = _block_rows(self.size, tensor, send_blocks, recv_blocks)
        out = tensor.new_empty((sum(rows_out), *tensor.shape[1:]))
        chunks, src, dst = [], 0, 0
        for send, recv, n_in, n_out in zip(send_blocks, recv_blocks, rows_in, rows_out):
            chunks.append((tensor[src:src + n_in], out[dst:dst + n_out], list(send), list(recv)))
            src, dst = src + n_in, dst + n_out
        if self._groups_all_to_alls(tensor):
            self._begin("all_to_all", tensor, timeout=timeout)
            group = self.native_group
            with self._starting("all_to_all", group, timeout):
                with dist._coalescing_manager(group, self.device, async_ops=True) as grouped:
                    for x, o, send, recv in chunks:
                        dist.all_to_all_single(o, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
            return self._run(grouped.works, lambda: out, False, "all_to_all", timeout)
        handles = [self.all_to_all(x, input_splits=send, output_splits=recv, out=o, async_op=True, timeout=timeout)
                   for x, o, send, recv in chunks]
        for handle in handles:
            handle.wait()
        return out

    def _groups_all_to_alls(self, tensor: torch.Tensor) -> bool:
        """Whether ``all_to_all_blocks`` can start its rows as one grouped CCL launch here."""
        return (not self.validate and self._bridge is None and self._island_backend.ccl_coalesces
                and hasattr(dist, "_coalescing_manager") and self._on_my_device(tensor)
                and not self._gap("all_to_all", tensor, None))

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        """Copy ``src``'s tensor into every rank's ``tensor``; returns it."""
        self._begin("broadcast", tensor, root=src, timeout=timeout)
        if self._bridge is not None:
            with self._bridged("broadcast"):
                return self._done(self._bridge.broadcast(tensor, src), async_op)
        group, buf = self._group_for("broadcast", tensor, None)
        with self._starting("broadcast", group, timeout):
            work = dist.broadcast(buf, src=src, group=group, async_op=True)
        return self._run([work], lambda: _copy_back(tensor, buf), async_op, "broadcast", timeout)

    def reduce(self, tensor: torch.Tensor, dst: int, op: str = "sum", *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        """Reduce into ``dst``'s ``tensor`` (other ranks' tensors are left unspecified, as in torch)."""
        self._begin("reduce", tensor, reduce_op=op, root=dst, timeout=timeout)
        if self._bridge is not None:
            with self._bridged("reduce"):
                return self._done(self._bridge.reduce(tensor, dst, op), async_op)
        group, buf = self._group_for("reduce", tensor, op)
        native = self._reduce_with(op, group)
        with self._starting("reduce", group, timeout):
            work = dist.reduce(buf, dst=dst, op=_TORCH_OPS[native], group=group, async_op=True)

        def finish() -> torch.Tensor:
            if self.rank == dst and native != op:
                buf.div_(self.size)
            return _copy_back(tensor, buf)

        return self._run([work], finish, async_op, "reduce", timeout)

    def gather(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        """Every rank's tensor, as a list on ``dst`` (None elsewhere)."""
        self._begin("gather", tensor, root=dst, timeout=timeout)
        if self._bridge is not None:
            with self._bridged("gather"):
                return self._done(self._bridge.gather(tensor, dst), async_op)
        group, buf = self._group_for("gather", tensor, None)
        out = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == dst else None
        with self._starting("gather", group, timeout):
            work = dist.gather(buf.contiguous(), out, dst=dst, group=group, async_op=True)

        def finish() -> list[torch.Tensor] | None:
            return None if out is None else [o.to(tensor.device) for o in out]

        return self._run([work], finish, async_op, "gather", timeout)

    def scatter(
        self, out: torch.Tensor, chunks: Sequence[torch.Tensor] | None = None, src: int = 0, *,
        async_op: bool = False, timeout: datetime.timedelta | None = None,
    ) -> Any:
        """``src`` sends ``chunks[i]`` to rank i, received into ``out``; returns ``out``."""
        self._begin("scatter", out, root=src, timeout=timeout)
        if self.rank == src and (
            chunks is None or len(chunks) != self.size or any(c.shape != out.shape or c.dtype != out.dtype for c in chunks)
        ):
            raise CollectiveError(f"scatter: src needs {self.size} chunks with out's shape {tuple(out.shape)} and dtype {out.dtype}")
        if self._bridge is not None:
            with self._bridged("scatter"):
                return self._done(self._bridge.scatter(out, chunks, src), async_op)
        group, buf = self._group_for("scatter", out, None)
        send = None if self.rank != src else [c.to(buf.device).contiguous() for c in chunks]  # type: ignore[union-attr]
        with self._starting("scatter", group, timeout):
            work = dist.scatter(buf, send, src=src, group=group, async_op=True)
        return self._run([work], lambda: _copy_back(out, buf), async_op, "scatter", timeout)

    def barrier(self, *, timeout: datetime.timedelta | None = None) -> None:
        """Wait until every rank arrives (bounded by the timeout) — over the host group, any backend."""
        self._begin("barrier", None, timeout=timeout)
        if not self.validate:
            exchange(CallSignature("barrier", self._seq, None, (), "none", True), self.layout.host_group, self.ranks,
                     timeout or self.timeout, self.rank)

    # --- point to point ---------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        return self.batch_p2p([P2P("send", tensor, dst)], async_op=async_op, timeout=timeout)

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        return self.batch_p2p([P2P("recv", tensor, src)], async_op=async_op, timeout=timeout)

    def batch_p2p(self, ops: Sequence[P2P], *, async_op: bool = False, timeout: datetime.timedelta | None = None) -> Any:
        """Post sends and receives together (no ordering deadlocks); returns the received tensors."""
        self._alive("batch_p2p")
        for p in ops:
            if p.kind not in ("send", "recv"):
                raise CollectiveError(f"batch_p2p: kind {p.kind!r} is unknown; use 'send' or 'recv'")
            if p.peer not in self.ranks or p.peer == self.rank:
                raise CollectiveError(f"{p.kind}: peer {p.peer} must be another rank of this group ({list(self.ranks)})")
            if not self._on_my_device(p.tensor):
                raise CollectiveError(f"{p.kind}: tensor is on {p.tensor.device}, this rank's device is {self.device}; move it with .to(device)")
        what = ops[0].kind if len(ops) == 1 else "batch_p2p"
        peers = sorted({p.peer for p in ops})
        if self.validate:
            check_peers(self.layout.host_group, self.rank, ops, timeout or self.timeout)
        if self._bridge is not None:
            return self._bridged_p2p(ops, what, peers, async_op)
        buffers = [(p, self._group_for(p.kind, p.tensor, None)) for p in ops]
        torch_ops = [
            dist.P2POp(dist.isend if p.kind == "send" else dist.irecv, buf, p.peer, group=group)
            for p, (group, buf) in buffers
        ]
        # A send to a peer that is gone fails here, while starting, not in the wait: same named error.
        with starting([group for _, (group, _) in buffers], timeout or self.timeout, what, peers):
            works = dist.batch_isend_irecv(torch_ops) if torch_ops else []

        def finish() -> list[torch.Tensor]:
            received = []
            for p, (_, buf) in buffers:
                if p.kind == "recv":
                    received.append(_copy_back(p.tensor, buf))
            return received

        handle = Handle(works, finish, timeout, what, peers)
        return handle if async_op else handle.wait()

    # --- helpers ------------------------------------------------------------------------------------
    def _dim0_sizes(self, tensor: torch.Tensor, signatures: list[CallSignature] | None, sizes: Sequence[int] | None) -> list[int]:
        if signatures is not None:
            known = [s.shape[0] if s.shape else 1 for s in signatures]
            if sizes is not None and list(sizes) != known:
                raise CollectiveError(f"all_gather: sizes {list(sizes)} disagree with what the ranks passed {known}")
        elif sizes is not None:
            known = list(sizes)
        else:
            known = [tensor.shape[0]] * self.size  # without validation, equal sizes unless told
        if len(known) != self.size:
            raise CollectiveError(f"all_gather: sizes names {len(known)} ranks, the group has {self.size}")
        return known

    def _exchange_splits(self, input_splits: list[int] | None, timeout: datetime.timedelta | None) -> list[int]:
        """How much this rank receives from each (an all_to_all of the split sizes, on the host).

        ``input_splits`` None: this rank's are bad. Each rank sends every other a (size, ok) pair,
        so every rank learns which ranks' lists are bad and raises the same error.
        """
        ok = input_splits is not None
        send = torch.tensor([[v, 1] for v in input_splits] if ok else [[0, 0]] * self.size, dtype=torch.int64)  # type: ignore[union-attr]
        recv = torch.empty_like(send)
        what = f"all_to_all (call #{self._seq}) split sizes"
        with self._starting(what, self.layout.host_group, timeout):
            work = dist.all_to_all_single(recv, send, group=self.layout.host_group, async_op=True)
        wait_all([work], timeout or self.timeout, what, self.peers)
        rows = recv.tolist()
        bad = [r for r, (_, fits) in zip(self.ranks, rows) if not fits]
        if bad:
            where = ", ".join(f"rank {r}" for r in bad)
            raise CollectiveError(
                f"all_to_all: input_splits on {where} must be {self.size} non-negative sizes summing to that rank's dim 0; "
                f"fix input_splits on {where}"
            )
        return [size for size, _ in rows]

    def _bridged_p2p(self, ops: Sequence[P2P], what: str, peers: Sequence[int], async_op: bool) -> Any:
        """A bridged batch, run on this communicator's one P2P thread (``serial_worker``) so an asynchronous post
        returns at once and the caller computes on while the transfer waits for its peer; every bridged batch goes
        through that thread, in posting order, the order both ends of the link agree on. The thread runs on the
        caller's stream, so a send's staging copy follows the kernels that made the tensor, and a received tensor
        is used only after ``wait``. ``HAL_BRIDGE_P2P_THREAD=0`` runs them in the caller, each completing before it
        returns (what every release before this one did: for comparison)."""
        if os.environ.get(P2P_THREAD_ENV, "1") == "0":
            with self._bridged(what):
                return self._done(self._bridge.batch_p2p(ops), async_op)  # type: ignore[union-attr]
        if self._p2p_worker is None:
            self._p2p_worker = SerialWorker(f"hal-bridge-p2p-{self.rank}")
        bridge, stream = self._bridge, self.backend.current_stream() if self.device.type != "cpu" else None
        assert bridge is not None

        def run() -> list[torch.Tensor]:
            with self._bridged(what), (self.backend.stream(stream) if stream is not None else contextlib.nullcontext()):
                return bridge.batch_p2p(ops)

        future = self._p2p_worker.submit(run)
        handle = Handle([_FutureWork(future)], future.result, None, what, peers)
        return handle if async_op else handle.wait()

    def _done(self, result: Any, async_op: bool) -> Any:
        """Bridge calls complete before they return; async callers still get a Handle."""
        return Handle([], lambda: result, None, "bridge") if async_op else result


def find_gap(backend: Backend, op: str, dtype: torch.dtype, reduce_op: str | None = None) -> CclGap | None:
    """The backend's declared CCL gap that covers this call, if any (capability data, no vendor checks)."""
    name = str(dtype).replace("torch.", "")
    for gap in backend.ccl_gaps:
        if gap.dtype in (None, name) and gap.op in (None, op, reduce_op):
            return gap
    return None


def _check_out(op: str, out: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise CollectiveError(
            f"{op}: out is {tuple(out.shape)} {out.dtype} on {out.device}; it must be {tuple(shape)} {like.dtype} on {like.device}"
        )


def _block_rows(size: int, tensor: torch.Tensor, send_blocks: Sequence[Sequence[int]],
                recv_blocks: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Rows each block row sends and receives; a malformed table is one error naming it."""
    if len(send_blocks) != len(recv_blocks) or not send_blocks:
        raise CollectiveError(f"all_to_all_blocks: {len(send_blocks)} send rows and {len(recv_blocks)} receive rows; "
                              "give the same number, at least one")
    for name, table in (("send_blocks", send_blocks), ("recv_blocks", recv_blocks)):
        for j, row in enumerate(table):
            if len(row) != size or min(row) < 0:
                raise CollectiveError(f"all_to_all_blocks: {name}[{j}] is {list(row)}; give {size} non-negative row counts (one per rank)")
    rows_in = [sum(row) for row in send_blocks]
    if sum(rows_in) != tensor.shape[0]:
        raise CollectiveError(f"all_to_all_blocks: send_blocks add up to {sum(rows_in)} rows, the tensor has {tensor.shape[0]}; make them match")
    return rows_in, [sum(row) for row in recv_blocks]


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """Copy ``result`` into the caller's ``out`` when one was given."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _pad_dim0(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad])


def _copy_back(target: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not target:
        target.copy_(buf)
    return target


def world_communicator(*, validate: bool = True, timeout: datetime.timedelta | None = None) -> Communicator:
    """A communicator over every rank (collective: every rank calls it)."""
    world = current_world()
    return Communicator(make_layout(world, range(world.size)), world, validate=validate, timeout=timeout)
