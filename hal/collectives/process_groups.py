"""Process groups built from a hal backend: who is where, and which CCL serves which tensors.

One process per device. ``init_distributed`` starts torch.distributed with the backend's
``"cpu:gloo,<device>:<ccl>"`` string (plain ``gloo`` on the CPU), pins the rank to its device
(``LOCAL_RANK`` under torchrun / ``hal launch``), and records each rank's *island*: ranks of one
backend on one CCL. A world with several islands (CUDA ranks + CPU ranks, or CPU islands
declared for tests) starts on gloo everywhere and gets one native sub-group per island; the
collectives bridge joins them.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from hal.backend import Backend
from hal.backend_registry import get_backend
from hal.errors import ConfigError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
ISLANDS_ENV = "HAL_ISLANDS"  # e.g. "0,0,1,1": declare islands on a homogeneous (test) world
CHANNELS_ENV = "HAL_BRIDGE_CHANNELS"  # host connections a bridged layout stripes large P2P messages over
DEFAULT_BRIDGE_CHANNELS = 8
MAX_BRIDGE_CHANNELS = 16


@dataclass(frozen=True)
class Island:
    """Ranks that share a backend and can use its CCL among themselves."""

    index: int
    backend: str  # hal backend name of every rank in it
    ranks: tuple[int, ...]  # global ranks, ascending
    group: dist.ProcessGroup | None  # native CCL group of exactly these ranks (None on non-members)

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class Layout:
    """A set of ranks as the collectives see it: its islands, a host (gloo) group, the leaders."""

    ranks: tuple[int, ...]  # global ranks, ascending
    islands: tuple[Island, ...]
    host_group: dist.ProcessGroup | None  # gloo over every rank here (metadata, validation, bridge)
    leaders_group: dist.ProcessGroup | None  # gloo over island leaders (None on non-leaders / one island)
    # More gloo groups over the same ranks (bridged layouts only): each is its own set of TCP
    # connections served by its own gloo thread, so a large message striped over them is not held to
    # one stream's speed (``collectives.bridge``). Channel 0 is ``host_group`` itself.
    extra_channels: tuple[dist.ProcessGroup, ...] = ()

    @property
    def channels(self) -> tuple[dist.ProcessGroup | None, ...]:
        """The host connections of this layout: ``host_group`` first, then the extra channels."""
        return (self.host_group, *self.extra_channels)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def island_of(self, rank: int) -> Island:
        return next(i for i in self.islands if rank in i.ranks)

    @property
    def is_heterogeneous(self) -> bool:
        return len(self.islands) > 1


@dataclass(frozen=True)
class World:
    """This process's view of the job: its rank, backend and device, and every rank's island key."""

    rank: int
    size: int
    backend: Backend
    device: torch.device
    backends: tuple[str, ...]  # backend name of every rank
    island_keys: tuple[str, ...]  # island key of every rank (backend name unless declared)
    timeout: datetime.timedelta
    bridge_channels: int = 1  # host connections per bridged layout (HAL_BRIDGE_CHANNELS, agreed by every rank)

_WORLD: World | None = None
_ABORTED: str | None = None  # why this process's groups were aborted (the first failure), if they were


def device_for_rank(backend: Backend) -> torch.device:
    """The device this process drives: LOCAL_RANK (torchrun) modulo the visible device count."""
    if backend.device_type == "cpu":
        return torch.device("cpu")
    count = backend.device_count()
    if count == 0:
        backend.require_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = local_rank % count
    backend.set_device(index)
    backend.prepare_autograd(index)
    return backend.device(index)


def islands_from_env(world_size: int) -> list[int] | None:
    """``HAL_ISLANDS``: the island of each of ``world_size`` ranks (None: unset, islands by backend). Raises
    ConfigError (one line) for a value that is not one island number a rank: a launcher checks it before any start."""
    text = os.environ.get(ISLANDS_ENV)
    return _parse_islands(text, world_size) if text else None


def _parse_islands(text: str, world_size: int) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{ISLANDS_ENV}={text!r}: use comma-separated island numbers, one per rank, e.g. 0,0,1,1") from None
    if len(ids) != world_size:
        raise ConfigError(f"{ISLANDS_ENV}={text!r} names {len(ids)} ranks but the world has {world_size}; give one island per rank")
    return ids


def bridge_channels_from_env() -> int:
    """``HAL_BRIDGE_CHANNELS``: how many host connections a bridged layout opens (1 = a single stream)."""
    text = os.environ.get(CHANNELS_ENV, "").strip()
    if not text:
        return DEFAULT_BRIDGE_CHANNELS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_BRIDGE_CHANNELS:
        raise ConfigError(f"{CHANNELS_ENV}={text!r}: give the number of host connections, 1 to {MAX_BRIDGE_CHANNELS} "
                          f"(1 = one stream; default {DEFAULT_BRIDGE_CHANNELS})")
    return value


def _gather_strings(value: str, world_size: int, group: dist.ProcessGroup | None = None) -> list[str]:
    out: list[object] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return [str(v) for v in out]


def stacks_after_s_from_env() -> float | None:
    """``HAL_DUMP_STACKS_AFTER_S``: seconds after which a rank prints every thread's stack (None: unset).

    Raises ConfigError (one line) for a value that is not a positive number."""
    value = os.environ.get("HAL_DUMP_STACKS_AFTER_S")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"HAL_DUMP_STACKS_AFTER_S={value!r} is not a positive number of seconds; e.g. 60")
    return seconds


def _stacks_later() -> None:
    """``HAL_DUMP_STACKS_AFTER_S=N``: every thread's Python stack to stderr N seconds after start, then every N
    seconds — what a hung rank is waiting in (a debugging aid; off unless set)."""
    seconds = stacks_after_s_from_env()
    if seconds is not None:
        import faulthandler

        faulthandler.dump_traceback_later(seconds, repeat=True, file=sys.stderr)


def init_distributed(
    backend: Backend | str | None = None,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    islands: Sequence[int] | None = None,
    store: dist.Store | None = None,
) -> World:
    """Start torch.distributed for this rank on ``backend`` and record every rank's island.

    Without ``init_method`` the torchrun environment (``env://``) is used; ``store`` (with ``rank``) joins through that
    store instead (``roles.take_role``: the world joined again at the plan's ranks). ``islands`` (or the
    ``HAL_ISLANDS`` variable) declares islands explicitly; by default ranks are grouped by the
    backend each one runs.
    """
    global _WORLD
    if _WORLD is not None:
        raise ConfigError("hal collectives are already initialised in this process; call shutdown() first")
    if backend is None:
        backend = os.environ.get("HAL_BACKEND", "cpu")
    if isinstance(backend, str):
        backend = get_backend(backend)
    backend.require_available()
    device = device_for_rank(backend)
    rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None and "WORLD_SIZE" in os.environ else world_size
    if rank is None or world_size is None:
        raise ConfigError("rank and world size are unknown: start under 'hal launch' / torchrun, or pass rank= and world_size=")

    _stacks_later()
    # Start on gloo everywhere: every rank can join it, whatever its device. A homogeneous world
    # then uses the device CCL through its own group (below).
    if store is None and init_method is None and RESTART_ENV in os.environ:
        store = incarnation_store(rank, world_size, timeout)
    if store is not None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(
            "gloo", init_method=init_method or "env://", rank=rank, world_size=world_size, timeout=timeout
        )
    try:
        channels = str(bridge_channels_from_env())
    except ConfigError as exc:
        channels = f"error: {exc}"  # still gathered, so every rank fails together instead of hanging
    names, channel_values = zip(*(v.split("\t") for v in _gather_strings(f"{backend.name}\t{channels}", world_size)))
    _agree_on_channels(list(channel_values))
    declared = list(islands) if islands is not None else None
    if declared is None:
        declared = islands_from_env(world_size)
    if declared is not None and len(declared) != world_size:
        raise ConfigError(f"islands names {len(declared)} ranks but the world has {world_size}; give one island per rank")
    keys = tuple(f"island {d}" for d in declared) if declared is not None else tuple(names)
    _WORLD = World(rank, world_size, backend, device, tuple(names), keys, timeout, int(channel_values[0]))
    return _WORLD


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def incarnation_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store (``env://``) under a prefix of this incarnation's own. After torchrun restarts its workers
    (``--max-restarts``) they meet in the same store, where the failed incarnation's gloo addresses still sit:
    read back, they were "connection refused" on every rank (seen under c10d rendezvous, torch 2.13)."""
    found, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return dist.PrefixStore(f"hal/incarnation-{os.environ.get(RESTART_ENV, '0')}/", found)


def _agree_on_channels(values: list[str]) -> None:
    """Channel groups are made collectively: every rank must ask for the same number, or none is made."""
    errors = [v for v in values if v.startswith("error: ")]
    if errors:
        dist.destroy_process_group()
        raise ConfigError(errors[0][len("error: "):])
    if len(set(values)) != 1:
        dist.destroy_process_group()
        where = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ConfigError(f"{CHANNELS_ENV} differs between ranks ({where}); set the same value on every rank")


def make_layout(world: World, ranks: Sequence[int]) -> Layout:
    """Groups for ``ranks``: one native group per island, a gloo host group, a gloo leaders group.

    Collective: every rank of the world must call it with the same ``ranks`` (torch's rule for
    creating groups), members or not.
    """
    members = tuple(sorted(set(ranks)))
    if not members or members[0] < 0 or members[-1] >= world.size:
        raise ConfigError(f"ranks {list(ranks)} are not a subset of the world 0..{world.size - 1}")
    order = list(dict.fromkeys(world.island_keys[r] for r in members))
    islands: list[Island] = []
    for index, key in enumerate(order):
        island_ranks = tuple(r for r in members if world.island_keys[r] == key)
        kinds = {world.backends[r] for r in island_ranks}
        if len(kinds) != 1:
            raise ConfigError(f"{key} mixes backends {sorted(kinds)}; an island runs one backend")
        island_backend = get_backend(world.backends[island_ranks[0]])
        group = dist.new_group(list(island_ranks), backend=island_backend.process_group_backend(), timeout=world.timeout)
        islands.append(Island(index, island_backend.name, island_ranks, group if world.rank in island_ranks else None))
    host = dist.new_group(list(members), backend="gloo", timeout=world.timeout)
    leaders = [i.leader for i in islands]
    leaders_group = dist.new_group(leaders, backend="gloo", timeout=world.timeout) if len(islands) > 1 else None
    extra = [dist.new_group(list(members), backend="gloo", timeout=world.timeout)
             for _ in range(world.bridge_channels - 1 if len(islands) > 1 else 0)]
    inside = world.rank in members
    return Layout(
        members, tuple(islands), host if inside else None,
        leaders_group if world.rank in leaders else None, tuple(extra) if inside else (),
    )


def group_timeout() -> datetime.timedelta:
    """The timeout every group of this world was made with (each op's CCL timeout unless a call bounds it)."""
    return _WORLD.timeout if _WORLD is not None else DEFAULT_TIMEOUT


def current_world() -> World:
    if _WORLD is None:
        raise ConfigError("hal collectives are not initialised: call collectives.init_distributed() first")
    return _WORLD


def abort_all(reason: str) -> None:
    """Abort every process group of this process after a failure it cannot recover from (once).

    Why: after a timeout or a lost peer the groups are in an unknown state — an op may be half
    done, and a late peer could still match it — so later calls must fail at once (``aborted``),
    and a CCL that queues device work (NCCL) releases the process only through its abort. torch's
    ``_abort_process_group`` aborts them all (gloo's abort does not stop an op already running in
    its worker thread: ``failures.starting`` bounds those by the call's timeout instead); a torch
    without it gets ``destroy_process_group``, which drops them the same way.
    """
    global _ABORTED
    if _ABORTED is not None:
        return
    _ABORTED = reason
    if not dist.is_initialized():
        return
    abort = getattr(distributed_c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except (RuntimeError, ValueError) as exc:  # kept in the reason every later call shows
        said = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        _ABORTED = f"{reason} (aborting the process groups failed too: {said})"


def aborted() -> str | None:
    """The failure that aborted this process's groups, or None while they are usable."""
    return _ABORTED


def shutdown(*, drain: bool = False) -> None:
    """Destroy every group this module made (safe to call twice, and after an abort).

    ``drain`` (a rank that finished its work): on an accelerator the device is synchronized first — a receive or send
    waited on only by the stream (a pipeline's last transfers) may still be running when the host is done, and a
    process that leaves with it in flight strands its peer's matching operation until that peer's CCL timeout. Not
    after a failure: the peers a stuck operation waits for may never come."""
    global _WORLD, _ABORTED
    world, failed = _WORLD, _ABORTED
    _WORLD = None
    _ABORTED = None
    try:
        if drain and world is not None and failed is None and world.device.type != "cpu":
            world.backend.synchronize()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
