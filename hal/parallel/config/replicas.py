"""Replicas: several whole plans side by side, each training its share of the global batch (data parallelism
across islands of different vendors and speeds).

    parallel:
      global_batch: 16            # rows per optimizer step over every replica (needed with rows: auto)
      replica_sync: {every: 1}    # 1: gradients meet every step (exact); H > 1: local SGD, see below
      replicas:
        - rows: 12                # this replica's rows of every step (or auto: by measured speed)
          micro_batch_size: 4     # then micro_batches defaults to rows / micro_batch_size
          stages: [{backend: cuda, devices: 2, layers: 4, tp: 2}]
        - rows: 4
          schedule: gpipe
          stages: [{backend: cpu, devices: 2, layers: 4, dp: 2}]

Each replica is a complete ``parallel:`` body of its own (``parallel.config.plan``: stages, schedule,
micro-batching, zero1, compile …) over its own consecutive ranks — replica 0 first — and the model is one.
Replicas may differ in backend, device count, stage count, layer split, tp/dp/sp/ep, precision and schedule:
their gradients are matched by parameter name, in full (``parallel.replicas.sync``). With ``every: 1`` the
step's gradient is the token-weighted mean over every replica, so the run computes the single-device training.
With ``every: H > 1`` the replicas step on their own and meet every H steps (DiLoCo): the mean of their
parameter deltas is the outer gradient of a Nesterov-momentum SGD (``outer_lr``, ``outer_momentum``); H = 1
with outer lr 1 and no momentum is plain sync.

A ``parallel:`` section without ``replicas:`` — one plan, ``stages: [...]`` — parses into the same object: a set of
one replica whose rows are its plan's global batch (``parse_parallel``). A run is always a set of replicas; one
replica syncs with nobody, so its sync settings are the defaults and nothing crosses islands.

This module is data and checks only (no process): every problem is one ConfigError line naming the key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from hal.config import limits
from hal.config.schema import Choice, NonNegativeInt, Number, PositiveInt, key, parse_section, reject_unknown, require_mapping
from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, parse_plan, validate_plan
from hal.parallel.config.topology import Topology

AUTO = "auto"
COMPRESSIONS = ("none", "bf16", "fp8")  # fp8: e4m3 blocks with error feedback (parallel.replicas.fp8_wire)
OVERLAPS = ("off", "on")
MAX_REPLICAS = 64


@dataclass(frozen=True)
class ReplicaSync:
    """``parallel.replica_sync``: how often and how the replicas' updates meet across islands."""

    every: int = key(PositiveInt(limits.STEPS), 1, example="every: 8")  # H: steps between cross-replica syncs
    outer_lr: float = key(Number(positive=True), 1.0, example="outer_lr: 0.7")  # local SGD's outer step (H > 1)
    outer_momentum: float = key(Number(positive=False), 0.0, example="outer_momentum: 0.9")  # Nesterov, H > 1
    compress: str = key(Choice(COMPRESSIONS), "none")  # the cross-island part's dtype on the wire
    # every-step sync: the exchange during the backward where a stage allows it (on: cpu stages and one-rank
    # accelerator stages so far; a GPU stage of several ranks hung in testing: docs/replicas.md), or after it (off)
    overlap: str = key(Choice(OVERLAPS), "off")
    # rows: auto replicas' shares re-balanced from measured step times every N steps (0: never)
    rebalance_every: int = key(NonNegativeInt(limits.STEPS), 10, example="rebalance_every: 10")

    def to_dict(self) -> dict[str, Any]:
        return {"every": self.every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "compress": self.compress, "rebalance_every": self.rebalance_every, "overlap": self.overlap}


@dataclass(frozen=True)
class Replica:
    """One replica: its plan over its own ranks, and its rows of every step (None: ``auto``, set at start)."""

    plan: ParallelPlan
    rows: int | None
    first_rank: int
    where: str = ""  # the config section of its plan: "parallel.replicas[i]", or "parallel" for a plain plan

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.plan.world_size)

    def topology(self) -> Topology:
        """Which of the replica's ranks is where: its plan laid out from its first rank."""
        return Topology.from_plan(self.plan, self.first_rank)


@dataclass(frozen=True)
class ReplicatedPlan:
    """The replicas in rank order, the rows of a step over all of them, and how they sync."""

    replicas: tuple[Replica, ...]
    global_batch: int
    sync: ReplicaSync

    @classmethod
    def single(cls, plan: ParallelPlan, where: str = "parallel") -> ReplicatedPlan:
        """A plain plan as the set of one replica: all the step's rows, nothing to sync with."""
        return cls((Replica(plan, plan.global_batch_size, 0, where),), plan.global_batch_size, ReplicaSync())

    @property
    def world_size(self) -> int:
        return sum(r.world_size for r in self.replicas)

    @property
    def several(self) -> bool:
        """More than one replica: something crosses islands, and reports show each replica."""
        return len(self.replicas) > 1

    @property
    def plan(self) -> ParallelPlan:
        """The plan of a run of one replica (a plain ``parallel: {stages: ...}``); several replicas have several."""
        if self.several:
            raise ValueError(f"the run has {len(self.replicas)} replicas, each with its own plan: ask each replica")
        return self.replicas[0].plan

    def plans(self) -> list[ParallelPlan]:
        """Each replica's plan, in replica order."""
        return [r.plan for r in self.replicas]

    def topologies(self) -> list[Topology]:
        """Each replica's topology over its own ranks, in replica order."""
        return [r.topology() for r in self.replicas]

    def first_stage(self, index: int) -> int:
        """Where replica ``index``'s stages begin in the run's list of every replica's stages (replica 0's first)."""
        return sum(r.plan.num_stages for r in self.replicas[:index])

    @property
    def writer(self) -> int:
        """The rank that logs: replica 0's first rank of the stage holding the loss (the first stage under zbv)."""
        topology = self.replicas[0].topology()
        return topology.stages[topology.last_stage].offset

    def timeline_files(self) -> list[str]:
        """What ``hal train --profile`` leaves in the run directory for its last step: timeline.json, or one a replica."""
        if not self.several:
            return ["timeline.json"]
        return [f"timeline-replica-{i}.json" for i in range(len(self.replicas))]

    @property
    def resolved(self) -> bool:
        """Every replica's rows are known (no ``auto`` left)."""
        return all(r.rows is not None for r in self.replicas)

    def replica_of(self, rank: int) -> int:
        for i, r in enumerate(self.replicas):
            if rank in r.ranks:
                return i
        raise ValueError(f"rank {rank} is outside the replicas' world 0..{self.world_size - 1}")

    def row_ranges(self) -> list[range]:
        """Each replica's rows of the step's global batch, in replica order."""
        if not self.resolved:
            raise ValueError("the replicas' rows are not set yet (rows: auto): resolve them first (with_rows)")
        out, first = [], 0
        for r in self.replicas:
            assert r.rows is not None
            out.append(range(first, first + r.rows))
            first += r.rows
        return out

    def with_rows(self, rows: Sequence[int]) -> ReplicatedPlan:
        """The same replicas with these rows (``auto`` resolved): each replica's micro-batches follow."""
        if len(rows) != len(self.replicas) or sum(rows) != self.global_batch:
            raise ValueError(f"rows {list(rows)} do not split global_batch {self.global_batch} over "
                             f"{len(self.replicas)} replicas")
        replicas = []
        for r, n in zip(self.replicas, rows):
            mbs = r.plan.micro_batch_size
            if n <= 0 or n % mbs:
                raise ValueError(f"{n} rows are not a positive multiple of micro_batch_size {mbs}")
            replicas.append(replace(r, rows=n, plan=replace(r.plan, micro_batches=n // mbs)))
        return replace(self, replicas=tuple(replicas))

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "replica_sync": self.sync.to_dict(),
                "replicas": [{"rows": AUTO if r.rows is None else r.rows, **r.plan.to_dict()} for r in self.replicas]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplicatedPlan:
        """The inverse of ``to_dict`` for data this code wrote (a job file, a checkpoint): no re-validation."""
        replicas, first = [], 0
        for index, raw in enumerate(data["replicas"]):
            body = {k: v for k, v in raw.items() if k != "rows"}
            plan = ParallelPlan.from_dict(body)
            replicas.append(Replica(plan, None if raw["rows"] == AUTO else int(raw["rows"]), first,
                                    f"parallel.replicas[{index}]"))
            first += plan.world_size
        return cls(tuple(replicas), int(data["global_batch"]), ReplicaSync(**data["replica_sync"]))


# --- parsing ------------------------------------------------------------------------------------------------

TOP_KEYS = ("replicas", "global_batch", "replica_sync")


def is_replicated(raw: Any) -> bool:
    """Whether a ``parallel:`` section lists replicas (else it is one plan, as before)."""
    return isinstance(raw, Mapping) and "replicas" in raw


def parse_parallel(raw: Any, origin: str = "config") -> ReplicatedPlan:
    """The ``parallel:`` section as the run's replicas: listed ones, or a plain plan as the set of one."""
    return parse_replicated(raw, origin) if is_replicated(raw) else ReplicatedPlan.single(parse_plan(raw, origin))


def _rows(origin: str, where: str, value: Any) -> int | None:
    if value == AUTO:
        return None
    return PositiveInt(limits.ROWS).check(origin, where, value, "rows: 8 (or rows: auto)")


def _parse_replica(origin: str, index: int, raw: Any, first_rank: int) -> Replica:
    where = f"parallel.replicas[{index}]"
    require_mapping(origin, where, raw, "give each replica rows and a plan body, e.g. {rows: 8, stages: [...]}")
    if "rows" not in raw:
        raise ConfigError(f"{origin}: '{where}' is missing key 'rows'; give its rows of every step, e.g. rows: 8, "
                          "or rows: auto (shares by measured speed)")
    if "model" in raw:
        raise ConfigError(f"{origin}: '{where}.model': replicas train one model; give 'model:' once, at the top of the file")
    rows = _rows(origin, f"{where}.rows", raw["rows"])
    body = {k: v for k, v in raw.items() if k != "rows"}
    plan = parse_plan(body, origin, where=where)
    if rows is not None:
        mbs = plan.micro_batch_size
        if rows % mbs:
            raise ConfigError(f"{origin}: {where}: rows {rows} is not a multiple of its micro_batch_size {mbs}; "
                              f"use rows: {max(mbs, rows // mbs * mbs)} or another micro_batch_size")
        if "micro_batches" in body and plan.micro_batches * mbs != rows:
            raise ConfigError(f"{origin}: {where}: micro_batches {plan.micro_batches} × micro_batch_size {mbs} = "
                              f"{plan.micro_batches * mbs} rows, but rows is {rows}; drop micro_batches (it follows "
                              f"from rows) or make them agree")
        plan = replace(plan, micro_batches=rows // mbs)
    return Replica(plan, rows, first_rank, where)


def parse_replicated(raw: Mapping[str, Any], origin: str = "config") -> ReplicatedPlan:
    """A ``parallel:`` section with ``replicas:`` as a ReplicatedPlan: keys, types and the rows' arithmetic."""
    reject_unknown(origin, "parallel", raw, TOP_KEYS)
    items = raw["replicas"]
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{origin}: key 'parallel.replicas' must be a non-empty list of replicas, each a plan body "
                          "with its rows, e.g. replicas: [{rows: 8, stages: [...]}, {rows: 4, stages: [...]}]")
    if len(items) > MAX_REPLICAS:
        raise ConfigError(f"{origin}: parallel.replicas lists {len(items)} replicas, above the limit {MAX_REPLICAS}; "
                          "use dp inside a replica for more copies on one island")
    replicas, first = [], 0
    for i, item in enumerate(items):
        replica = _parse_replica(origin, i, item, first)
        replicas.append(replica)
        first += replica.world_size
    raw_sync = raw.get("replica_sync", {})
    if isinstance(raw_sync, Mapping) and isinstance(raw_sync.get("overlap"), bool):  # YAML reads a bare on / off so
        raw_sync = {**raw_sync, "overlap": "on" if raw_sync["overlap"] else "off"}
    sync = parse_section(origin, "parallel.replica_sync", raw_sync, ReplicaSync)
    known = sum(r.rows for r in replicas if r.rows is not None)
    auto = [i for i, r in enumerate(replicas) if r.rows is None]
    if "global_batch" in raw:
        total = PositiveInt(limits.ROWS).check(origin, "parallel.global_batch", raw["global_batch"], "global_batch: 16")
    elif auto:
        raise ConfigError(f"{origin}: parallel.replicas[{auto[0]}].rows is auto but parallel.global_batch is not given; "
                          "give the rows of a step over all replicas, e.g. global_batch: 32")
    else:
        total = known
    if not auto and known != total:
        parts = " + ".join(str(r.rows) for r in replicas)
        raise ConfigError(f"{origin}: the replicas' rows add up to {known} ({parts}) but parallel.global_batch is {total}; "
                          "make them agree (or drop global_batch: it is their sum)")
    if auto:
        least = sum(replicas[i].plan.micro_batch_size for i in auto)
        if total - known < least:
            raise ConfigError(f"{origin}: parallel.global_batch {total} leaves {total - known} rows for the auto replicas "
                              f"{auto}, fewer than their micro_batch_size total {least}; raise global_batch")
        check_auto_shares(replicas, total, origin)  # whole micro-batches each schedule runs, adding up: or one line
    if len(replicas) == 1 and (sync.compress != "none" or sync.every != 1 or sync.overlap == "on"):
        which = "compress" if sync.compress != "none" else "every" if sync.every != 1 else "overlap"
        raise ConfigError(f"{origin}: parallel.replica_sync sets {which} "
                          "but there is one replica: nothing crosses islands; drop replica_sync or add a replica")
    if sync.outer_momentum >= 1:  # 1.5 was accepted: the loss climbed to ~9e5 in 60 steps and the run exited 0
        raise ConfigError(f"{origin}: parallel.replica_sync.outer_momentum is {sync.outer_momentum:g}; a momentum of 1 or "
                          "more never decays, so the outer steps grow without bound: give one below 1 (e.g. 0.9)")
    if sync.outer_lr >= 2:  # p = anchor - lr x (the replicas' mean change): at 2 it lands as far past as it started
        raise ConfigError(f"{origin}: parallel.replica_sync.outer_lr is {sync.outer_lr:g}; an outer step of 2 or more "
                          "overshoots the replicas' mean change by as much as it moved, so the meetings never settle: "
                          "give one below 2 (DiLoCo uses 0.7)")
    if sync.every == 1 and (sync.outer_lr != 1.0 or sync.outer_momentum != 0.0):
        raise ConfigError(f"{origin}: parallel.replica_sync.outer_lr / outer_momentum apply to local SGD (every > 1), "
                          "but every is 1 (gradients meet every step); set every: 8 or drop them")
    if sync.every > 1 and sync.overlap == "on":
        raise ConfigError(f"{origin}: parallel.replica_sync.overlap applies to the every-step gradient sync; local SGD "
                          "(every > 1) meets after the optimizer step; drop overlap or set every: 1")
    if sync.every > 1 and sync.compress != "none":
        raise ConfigError(f"{origin}: parallel.replica_sync.compress applies to the every-step gradient sync; local "
                          "SGD (every > 1) sends parameter deltas uncompressed; drop compress or set every: 1")
    if sync.compress == "fp8":
        import torch

        if not hasattr(torch, "float8_e4m3fn"):  # what parallel.replicas.fp8_wire encodes with (torch 2.1 on)
            raise ConfigError(f"{origin}: parallel.replica_sync.compress is fp8 but this torch has no float8_e4m3fn "
                              f"(torch {torch.__version__}); use compress: bf16, or torch 2.1 or later")
    return ReplicatedPlan(tuple(replicas), total, sync)


def validate_replicated(rep: ReplicatedPlan, model: ModelConfig, *, world_size: int | None, check_backends: bool = True,
                        seq_len: int | None = None, single_host: bool = True, origin: str = "config",
                        precision: str | None = None) -> None:
    """Each replica's plan against the model (``validate_plan``), the world's size, and what replicas cannot mix."""
    for r in rep.replicas:
        validate_plan(r.plan, model, world_size=None if rep.several else world_size, check_backends=check_backends,
                      seq_len=seq_len, single_host=single_host, origin=section(origin, r.where), precision=precision)
    if not rep.several:
        return
    if world_size is not None and world_size != rep.world_size:
        parts = " + ".join(str(r.world_size) for r in rep.replicas)
        raise ConfigError(f"{origin}: the replicas use {rep.world_size} devices ({parts}) but the world has {world_size} "
                          f"ranks; launch {rep.world_size} ranks or change the replicas' devices")
    if single_host and check_backends:
        _check_shared_devices(rep, origin)


def section(origin: str, where: str) -> str:
    """A message's origin for a replica's plan: the file, and the section unless it is the plain ``parallel``."""
    return origin if where in ("", "parallel") else f"{origin}: {where}"


def _check_shared_devices(rep: ReplicatedPlan, origin: str) -> None:
    """On one host, the replicas' accelerator ranks together fit the devices (each replica alone was checked)."""
    from hal.backend_registry import get_backend

    wanted: dict[str, int] = {}
    for r in rep.replicas:
        for s in r.plan.stages:
            wanted[s.backend] = wanted.get(s.backend, 0) + s.devices
    for name, count in wanted.items():
        backend = get_backend(name)
        if backend.device_type == "cpu":
            continue
        have = backend.device_count()
        if count > have:
            raise ConfigError(f"{origin}: the replicas put {count} ranks on backend '{name}' but this host has {have}; "
                              "lower their devices or move a replica to another backend")


@dataclass(frozen=True)
class RowSteps:
    """The rows a replica's plan can take in a step: ``first``, ``first + step``, ... — whole micro-batches that its
    schedule runs (a DualPipeV plan needs 2 x its stages, an interleaved one a multiple of them)."""

    first: int
    step: int


def row_steps(plan: ParallelPlan, most: int) -> RowSteps:
    """``plan``'s row counts as first + k x step, from its schedule's own rule (read over the counts up to ``most``
    rows, and past them until two are found; ``first`` may exceed ``most``). A schedule whose micro-batch counts are not
    such a progression gets a ValueError (give such a replica fixed rows)."""
    mbs = plan.micro_batch_size
    scan = max(most // mbs, 1)
    counts = [m for m in range(1, scan + 1) if plan.schedule.problem(plan.num_stages, m) is None]
    extra = scan
    while len(counts) < 2 and extra < scan + 64 * max(plan.num_stages, 1):
        extra += 1
        if plan.schedule.problem(plan.num_stages, extra) is None:
            counts.append(extra)
    if len(counts) < 2:
        raise ValueError(f"schedule {plan.schedule.name} runs no count of micro-batches up to {extra}")
    step = counts[1] - counts[0]
    if counts != list(range(counts[0], counts[-1] + 1, step)) or (counts[-1] < scan and scan - counts[-1] >= step):
        raise ValueError(f"schedule {plan.schedule.name}'s micro-batch counts {counts[:6]}... are not every k-th one")
    return RowSteps(counts[0] * mbs, step * mbs)


def reachable_sums(steps: Sequence[RowSteps], most: int) -> int:
    """A bit mask of the totals up to ``most`` that rows of these replicas (each one of its row counts) add up to."""
    mask = (1 << (most + 1)) - 1
    reach = 1
    for s in steps:
        reach = (reach << s.first) & mask
        shift = s.step
        while shift <= most and reach:  # any number of further steps: 1, 2, 4, ... of them doubles the reach
            reach |= (reach << shift) & mask
            shift <<= 1
    return reach


def auto_rows(speeds: Sequence[float], global_batch: int, steps: Sequence[RowSteps | None],
              fixed: Sequence[int | None]) -> list[int]:
    """Rows per replica in proportion to ``speeds`` (rows per second each can train), each one of its ``steps`` (whole
    micro-batches its schedule runs); replicas with ``fixed`` rows keep them.

    Largest-remainder rounding on each replica's steps, taking a step only where the rest can still be placed, so the
    rows add up to ``global_batch`` exactly (the config's check, ``check_auto_shares``, proved a split exists)."""
    free = global_batch - sum(f for f in fixed if f is not None)
    auto = [i for i, f in enumerate(fixed) if f is None]
    own = {i: steps[i] for i in auto}
    if any(s is None for s in own.values()) or any(s <= 0 or not math.isfinite(s) for s in (speeds[i] for i in auto)):
        raise ValueError(f"cannot share {free} rows over replicas {auto} at speeds {list(speeds)}")
    rows = [f if f is not None else own[i].first for i, f in enumerate(fixed)]  # type: ignore[union-attr]
    left = free - sum(rows[i] for i in auto)
    reach = reachable_sums([RowSteps(0, own[i].step) for i in auto], max(left, 0))  # type: ignore[union-attr]
    if left < 0 or not reach >> left & 1:
        raise ValueError(f"{free} rows cannot be placed in the auto replicas' counts {[own[i] for i in auto]}")
    total_speed = sum(speeds[i] for i in auto)
    want = {i: free * speeds[i] / total_speed for i in auto}
    while left > 0:
        fits = [i for i in auto if own[i].step <= left and reach >> (left - own[i].step) & 1]  # type: ignore[union-attr]
        i = max(fits, key=lambda j: (want[j] - rows[j]) / own[j].step)  # type: ignore[union-attr]
        rows[i] += own[i].step  # type: ignore[union-attr]
        left -= own[i].step  # type: ignore[union-attr]
    return rows


def shares_by_speed(replicas: ReplicatedPlan, speeds: Sequence[float]) -> list[int]:
    """Every replica's rows: the fixed ones kept, the auto ones from ``speeds`` (``auto_rows``, in the counts each
    schedule runs)."""
    fixed = [r.rows for r in replicas.replicas]
    free = replicas.global_batch - sum(f for f in fixed if f is not None)
    steps = [row_steps(r.plan, free) if f is None else None for r, f in zip(replicas.replicas, fixed)]
    return auto_rows(speeds, replicas.global_batch, steps, fixed)


def check_auto_shares(replicas: Sequence[Replica], total: int, origin: str) -> None:
    """The auto replicas can split what the fixed ones leave of ``total`` into counts their schedules run — or one line
    naming a global batch that works."""
    auto = [i for i, r in enumerate(replicas) if r.rows is None]
    free = total - sum(r.rows for r in replicas if r.rows is not None)
    try:
        steps = [row_steps(replicas[i].plan, free) for i in auto]
    except ValueError as exc:
        raise ConfigError(f"{origin}: rows: auto cannot share rows with this plan ({exc}); give its replica fixed rows") from None
    least = sum(s.first for s in steps)
    if least > free:  # the smallest share of each auto replica (its schedule's fewest micro-batches) does not fit
        counts = ", ".join(f"replica {i}: {s.first}" for i, s in zip(auto, steps))
        raise ConfigError(f"{origin}: parallel.global_batch {total} leaves {free} rows for the auto replicas, fewer than "
                          f"the fewest whole micro-batches their schedules run ({counts}); use global_batch "
                          f"{total - free + least} or more")
    reach = reachable_sums(steps, free + sum(s.first + s.step for s in steps))
    if reach >> free & 1:
        return
    near = [t for t in range(free + 1, reach.bit_length()) if reach >> t & 1][:1] + \
        [t for t in range(free - 1, 0, -1) if reach >> t & 1][:1]
    fixed = total - free
    options = " or ".join(str(fixed + t) for t in sorted(near))
    counts = ", ".join(f"replica {i}: {s.first}, {s.first + s.step}, ... rows" for i, s in zip(auto, steps))
    raise ConfigError(f"{origin}: parallel.global_batch {total} leaves {free} rows for the auto replicas, which no split "
                      f"into whole micro-batches their schedules run adds up to ({counts}); use global_batch {options}")
