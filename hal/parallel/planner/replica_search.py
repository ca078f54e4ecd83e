"""Replica plans beside stage plans: each device type trains a whole replica on its speed-sized share of the batch.

Why a second family: a stage plan makes every micro-batch's activations cross between device types (over the
bridge where the backends differ) and runs as fast as its slowest stage allows; a replica plan keeps each type to
itself and crosses once a step with the gradients (or every H steps with local SGD). Which wins depends on the
bridge, the model's size and the batch, so the search prices both and says which it prefers and why.

How a replica plan is found (``ReplicaSearch``), for every split of two or more device types into groups, one
replica a group — a group of one type is a replica on that type, a group of several a replica that is itself a
pipeline over those types (a *mix*: replicas of heterogeneous pipelines, every type of the group holding a stage):
1. each group is searched alone (``search.Search`` on a cluster of its types) for the whole global batch: its speed;
2. the batch is shared in proportion to those speeds, in granules of rows (``auto_rows``), and each group is
   searched again for its own rows: its replica's plan and predicted step;
3. a granule moves from the slowest replica to the fastest while that shortens the step (the speeds are not
   linear in rows: micro-batching and the bubble change with them);
4. the cross-island sync is priced (``sync_cost``) and added, not overlapped: the exchange runs after the backward.

The sync as ``parallel.replicas.sync`` runs it: each replica gathers its full gradients (inside its island), the
parameters cross in buckets whose speakers are a stage's ranks in turn — about min(devices a replica) pairs carry
buckets at once over the bridge — and each speaker hands the sum back over its stage. bf16 on the wire halves the
bridge's bytes; local SGD (every H) pays the exchange once per H steps (and trains differently: not exact). Each pair
gets the declared bridge figure, capped by its nodes' share of their links out (``inter_node_gbps`` a node); the
bridge's host channels inside a pair are not counted (the declared figure is taken as a pair's). Where ``hal profile``
timed the bridge's all-reduce on the node (a bucket, staged and striped over the host channels, as the exchange sums
it), that figure prices every bucket instead: a broadcast's single stream is about 3× slower on H200 hosts.
"""
from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from hal.errors import ConfigError
from hal.parallel.config.flops import model_parameters
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.replicas import Replica, ReplicaSync, ReplicatedPlan, RowSteps, auto_rows
from hal.parallel.planner.cluster import Cluster, DeviceType
from hal.parallel.planner.cost import CostModel, Placement, ring_all_reduce_s, transfer_s
from hal.parallel.planner.search import Result, Search
from hal.parallel.replicas.fp8_wire import BLOCK as FP8_BLOCK
from hal.parallel.replicas.sync import BUCKET_BYTES

REFINE_ROUNDS = 8  # granule moves tried from the proportional shares
CONFIRM = 20  # candidates each one-type search re-predicts with the simulator
WIRE_BYTES = {"none": 4, "bf16": 2, "fp8": 1 + 4 / FP8_BLOCK}  # a gradient value on the bridge (fp8: its block's scale)
MAX_TYPES = 4  # device types combined into replicas (every split of every subset of two or more)
PROGRESS_EVERY_S = 2.0  # at most one progress line this often


Group = DeviceType | tuple[DeviceType, ...]  # one replica's device type, or the types of a mixed replica's pipeline


def splits(types: tuple[DeviceType, ...]) -> list[list[tuple[DeviceType, ...]]]:
    """Every way to split ``types`` into two or more non-empty groups (set partitions, order kept; 4 types: 14)."""
    out: list[list[tuple[DeviceType, ...]]] = []

    def grow(i: int, groups: list[list[DeviceType]]) -> None:
        if i == len(types):
            if len(groups) >= 2:
                out.append([tuple(g) for g in groups])
            return
        for g in groups:
            g.append(types[i])
            grow(i + 1, groups)
            g.pop()
        groups.append([types[i]])
        grow(i + 1, groups)
        groups.pop()

    grow(0, [])
    return out


def fewer(kind: DeviceType, n: int) -> DeviceType:
    """``kind`` with its first ``n`` devices only (taken node by node)."""
    if n >= kind.count:
        return kind
    nodes, left = [], n
    for node, count in kind.nodes:
        if left <= 0:
            break
        nodes.append((node, min(count, left)))
        left -= count
    return replace(kind, nodes=tuple(nodes))


def _halvings(count: int) -> list[int]:
    """count, count / 2, ... down to 1 (while it halves evenly)."""
    out = [count]
    while out[-1] > 1 and out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    return out


@dataclass(frozen=True)
class SyncCost:
    """A step's cross-island sync, priced: seconds (amortised over H), bytes a step on the bridge, pairs striped."""

    seconds: float
    bridge_bytes: float  # a replica's bytes on the bridge per exchange
    stripes: int
    every: int
    compress: str


@dataclass
class ReplicaCandidate:
    """One replica plan: each replica's plan on its type, its rows, the sync, and the predicted step."""

    results: tuple[Result, ...]
    rows: tuple[int, ...]
    sync: SyncCost
    seq: int

    @property
    def compute_s(self) -> float:
        """The slowest replica's own step (the others wait for it at the sync)."""
        return max(r.prediction.step_s for r in self.results)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.sync.seconds

    @property
    def tokens_per_s(self) -> float:
        return sum(self.rows) * self.seq / self.step_s

    @property
    def devices(self) -> tuple[str, ...]:
        """Each replica's device type; a mixed replica's types joined by '+', in stage order."""
        return tuple("+".join(k.device for k in _types(r)) for r in self.results)

    @property
    def type_count(self) -> int:
        """Device types the replicas use, together."""
        return sum(len(_types(r)) for r in self.results)

    @property
    def mixed(self) -> bool:
        """Whether some replica is a pipeline over several device types."""
        return any("+" in d for d in self.devices)

    def replicated(self, sync: ReplicaSync) -> ReplicatedPlan:
        replicas, first = [], 0
        for result, rows in zip(self.results, self.rows):
            replicas.append(Replica(result.plan, rows, first))
            first += result.plan.world_size
        return ReplicatedPlan(tuple(replicas), sum(self.rows), sync)

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "compute_s": self.compute_s,
                "sync_s": self.sync.seconds, "sync_share": self.sync.seconds / self.step_s,
                "bridge_bytes": self.sync.bridge_bytes, "stripes": self.sync.stripes, "every": self.sync.every,
                "compress": self.sync.compress,
                "replicas": [{"device": d, "rows": n, "plan": r.plan.to_dict(), "prediction": r.prediction.to_dict()}
                             for d, n, r in zip(self.devices, self.rows, self.results)]}


def _nodes(result: Result) -> set[tuple[str, int]]:
    """The nodes a replica's ranks sit on (a type's devices taken in order, as ``Placement.pack`` places them)."""
    place = result.placement
    return {(place.kinds[k].device, node) for k, stage in enumerate(result.plan.stages)
            for node in place.nodes(k, stage.devices)}


def _types(result: Result) -> tuple[DeviceType, ...]:
    """A replica's device types, in stage order, each once."""
    return tuple({k.device: k for k in result.placement.kinds}.values())


def sync_cost(cost: CostModel, results: tuple[Result, ...], *, every: int = 1, compress: str = "none",
              bridged: bool | None = None) -> SyncCost:
    """The cross-island exchange of one step (its seconds divided by ``every``), as ``parallel.replicas.sync`` runs it.
    ``bridged``: the replicas are islands of their own (declared apart, as ``HAL_ISLANDS`` does); None: where their
    backends differ, as islands form by default."""
    params = model_parameters(cost.model)
    wire = params * WIRE_BYTES[compress]
    groups = [_types(r) for r in results]
    devices = [r.plan.world_size for r in results]
    buckets = max(1, math.ceil(params * 4 / BUCKET_BYTES))
    stripes = max(1, min(min(devices), buckets))
    # the bridge: an all-reduce over one speaker a replica, the buckets spread over the stripes; a pair gets the
    # bridge's figure (the slowest between any two replicas' types), but the pairs of one node share its link out
    # (inter_node_gbps a node)
    worst_gbps, worst_lat, one_node = math.inf, 0.0, True
    R, rounds = len(results), math.ceil(buckets / stripes)
    summed: list[float | None] = []  # a bucket's bridge sum as hal profile timed it, each pair of types
    for (ra, ga), (rb, gb) in itertools.combinations(list(zip(results, groups)), 2):
        same = bool({n for _, n in _nodes(ra)} & {n for _, n in _nodes(rb)})
        one_node = one_node and same
        for a, b in itertools.product(ga, gb):
            gbps, lat, _ = cost.link(a, b, same, bridged=bridged)
            worst_gbps, worst_lat = min(worst_gbps, gbps), max(worst_lat, lat)
            crosses = bridged if bridged is not None else a.backend != b.backend
            summed.append(cost.bridge_sum(a, b, wire / buckets, R) if crosses else None)
    nodes = min(len(_nodes(r)) for r in results)
    per_pair = worst_gbps if one_node else min(worst_gbps, nodes * cost.cluster.links.inter_node_gbps / stripes)
    if compress == "fp8":  # gathered, not summed on the wire: every speaker's message reaches the R - 1 others
        bridge = (R - 1) * wire / stripes / (per_pair * 1e9) + rounds * (R - 1) * worst_lat * 1e-6
    elif one_node and summed and all(t is not None for t in summed):
        # the sum measured on this node (staged, striped over the host channels, as the exchange runs it), bucket
        # after bucket; the speaker pairs share the node's host, so they are not counted as adding throughput (on
        # 4 x H200 two pairs ran 1.3x one pair: docs/replicas.md)
        bridge = buckets * max(t for t in summed if t is not None)
    else:
        bridge = ring_all_reduce_s(wire / stripes, R, per_pair, worst_lat, rounds)
    # inside each island: the full gradients gathered over tp, and each speaker's sum handed back over its stage
    inside = 0.0
    for result in results:
        stages = result.plan.num_stages
        for stage, kind in zip(result.plan.stages, result.placement.kinds):  # each stage's ranks hand back their part
            gbps, lat, _ = cost.link(kind, kind, stage.devices <= kind.per_node)
            hand_back = transfer_s(params * 4 / stages, gbps, lat) if stage.devices > 1 else 0.0
            tp_gbps, tp_lat, _ = cost.link(kind, kind, True)  # a tp group sits on one node
            gather = transfer_s(params * 4 / stages * (stage.tp - 1) / stage.tp, tp_gbps, tp_lat) if stage.tp > 1 else 0.0
            inside = max(inside, hand_back + gather)
    return SyncCost((bridge + inside) / every, wire, stripes, every, compress)


def stage_kinds(cluster: Cluster, plan: ParallelPlan) -> tuple[DeviceType, ...]:
    """Each stage's device type: the cluster's (first) type of the stage's backend; one line where it has none."""
    kinds = []
    for stage in plan.stages:
        match = [t for t in cluster.types if t.backend == stage.backend]
        if not match:
            raise ConfigError(f"a stage runs on backend {stage.backend!r} but the cluster ({cluster.origin}) has no "
                              "device of it; give --cluster with one")
        kinds.append(match[0])
    return tuple(kinds)


def _cpu_load(cost: CostModel, result: Result) -> dict[tuple[str, int], float]:
    """Rank-threads a replica keeps busy on each cpu node, (device, node) -> threads (while it computes)."""
    place, out = result.placement, {}
    for k, (stage, kind) in enumerate(zip(result.plan.stages, place.kinds)):
        if kind.is_cpu:
            for i in range(place.starts[k], place.starts[k] + stage.devices):
                key = (kind.device, kind.node_of(i))
                out[key] = out.get(key, 0.0) + cost.device(kind).threads_or_one()
    return out


def predict_replicas(costs: Sequence[CostModel], plans: Sequence[ParallelPlan], rows: Sequence[int], *,
                     bridged: bool | None = None, every: int = 1, compress: str = "none") -> ReplicaCandidate:
    """The predicted step of given replicas (each plan priced by its own cost model — its profile, its precision — on
    the cluster type of each stage's backend) and their sync: what the search predicts, for plans a user wrote
    (``benchmarks/replicas_shares.py`` sets it beside measured steps)."""
    places: list[Placement] = []
    used: dict[str, int] = {}
    for cost, plan in zip(costs, plans):
        place = Placement.pack(plan, stage_kinds(cost.cluster, plan))  # then after the replicas before it: their ranks come first
        starts = tuple(start + used.get(kind.device, 0) for start, kind in zip(place.starts, place.kinds))
        for stage, kind in zip(plan.stages, place.kinds):
            used[kind.device] = used.get(kind.device, 0) + stage.devices
            if used[kind.device] > kind.count:
                raise ConfigError(f"the replicas use {used[kind.device]} {kind.device} devices but the cluster "
                                  f"({cost.cluster.origin}) has {kind.count}; give a cluster that holds them")
        places.append(Placement(place.kinds, starts))
    found = tuple(Result(plan, place, cost.predict(plan, place)) for cost, plan, place in zip(costs, plans, places))
    for _ in range(2):  # replicas whose cpu ranks share a node's cores slow each other: each sees the others' load
        loads = [_cpu_load(cost, r) for cost, r in zip(costs, found)]
        if not any(set(a) & set(b) for a, b in itertools.combinations(loads, 2)):
            break
        step = max(r.prediction.step_s for r in found)
        again = []
        for i, (cost, plan, place) in enumerate(zip(costs, plans, places)):
            shared = copy.copy(cost)
            shared.background = {}
            for j, (other, load) in enumerate(zip(found, loads)):
                for key, threads in load.items():
                    if j != i:  # the other replica is busy for its own step's share of the common one
                        shared.background[key] = shared.background.get(key, 0.0) + threads * other.prediction.step_s / step
            again.append(Result(plan, place, shared.predict(plan, place)))
        found = tuple(again)
    return ReplicaCandidate(found, tuple(rows), sync_cost(costs[0], found, every=every, compress=compress, bridged=bridged),
                            costs[0].seq)


class ReplicaSearch:
    """Replica plans over ``cost``'s cluster, keeping ``base``'s global batch; one replica a device type."""

    def __init__(self, cost: CostModel, base: ParallelPlan, *, progress: Callable[[str], None] | None = None) -> None:
        self.cost, self.base = cost, base
        self.rows_total = base.global_batch_size
        self.say = progress or (lambda _: None)
        self._best: dict[tuple[str, int], Result | None] = {}
        self.notes: list[str] = []  # what the search left out, said beside its plans
        self.tried: list[tuple[str, ...]] = []  # every split searched: each replica's types joined by '+'
        self.searched = 0  # one-replica searches run (each a stage search of its own: seconds on a large cluster)
        self._began = time.monotonic()
        self._said_at = self._began

    def alone(self, kind: DeviceType | tuple[DeviceType, ...], rows: int) -> Result | None:
        """The best plan of ``kind`` by itself for ``rows`` rows a step (None: none fits or splits). A group of several
        types is searched as one pipeline over all of them (each type holds a stage): a mixed replica. A single type
        may use fewer of its devices (halving) where that is faster or where all of them cannot split a small share
        (16 cpu ranks for 4 rows): a replica's devices are what its rows can use."""
        group = kind if isinstance(kind, tuple) else (kind,)
        key = ("+".join(k.device for k in group), rows)
        if key not in self._best:
            options = [group] if len(group) > 1 else [(fewer(group[0], n),) for n in _halvings(group[0].count)]
            found = [r for r in (self._search(g, rows) for g in options) if r is not None]
            self._best[key] = min(found, key=lambda r: r.prediction.step_s) if found else None
        return self._best[key]

    def _search(self, group: tuple[DeviceType, ...], rows: int) -> Result | None:
        now = time.monotonic()
        if now - self._said_at >= PROGRESS_EVERY_S:  # a long search shows it is alive, and where it is
            self._said_at = now
            self.say(f"replicas: {self.searched} replica plan(s) searched, now {' + '.join(f'{k.count}× {k.device}' for k in group)} "
                     f"on {rows} rows, {now - self._began:.0f} s")
        self.searched += 1
        cluster = Cluster(group, self.cost.cluster.links, self.cost.cluster.origin)
        one = CostModel(cluster, self.cost.profile, self.cost.model, self.cost.seq)
        base = replace(self.base, micro_batches=rows, micro_batch_size=1)
        try:
            # its pick alone re-predicted with the measured-time order: one replica search runs per type and share
            report = Search(one, base, confirm=CONFIRM, use_all_types=len(group) > 1, order_confirm=1).run(1)
        except ConfigError:
            return None
        return report.results[0] if report.results else None

    def granule(self) -> int:
        """Rows moved at a time: the largest power of two dividing the batch that still leaves 16 granules (or 1)."""
        g = 1
        while self.rows_total % (2 * g) == 0 and self.rows_total // (2 * g) >= 16:
            g *= 2
        return g

    def _candidate(self, kinds: tuple[Group, ...], rows: list[int]) -> ReplicaCandidate | None:
        results = []
        for kind, n in zip(kinds, rows):
            result = self.alone(kind, n)
            if result is None:
                return None
            results.append(result)
        found = tuple(results)
        return ReplicaCandidate(found, tuple(rows), sync_cost(self.cost, found), self.cost.seq)

    def for_types(self, kinds: tuple[Group, ...]) -> ReplicaCandidate | None:
        """The best replica plan of these types or groups of types (one replica each), or None when one cannot train
        its share."""
        speeds = []
        for kind in kinds:
            whole = self.alone(kind, self.rows_total)
            if whole is None:
                return None
            speeds.append(self.rows_total / whole.prediction.step_s)
        g = self.granule()
        if self.rows_total < g * len(kinds):
            return None
        rows = auto_rows(speeds, self.rows_total, [RowSteps(g, g)] * len(kinds), [None] * len(kinds))
        best = self._candidate(kinds, rows)
        for _ in range(REFINE_ROUNDS):
            if best is None:
                break
            steps = [r.prediction.step_s for r in best.results]
            slow, fast = steps.index(max(steps)), steps.index(min(steps))
            if slow == fast or rows[slow] <= g:
                break
            trial = list(rows)
            trial[slow] -= g
            trial[fast] += g
            moved = self._candidate(kinds, trial)
            if moved is None or moved.step_s >= best.step_s:
                break
            best, rows = moved, trial
        return best

    def run(self, top: int = 3) -> list[ReplicaCandidate]:
        """The best replica plans over every split of every set of two or more device types into two or more groups
        (a group of several types: a mixed replica), fastest first ([] with one type)."""
        types = list(self.cost.cluster.types)[:MAX_TYPES]
        if len(self.cost.cluster.types) > MAX_TYPES:
            self.notes.append(f"replica plans combine the first {MAX_TYPES} of the cluster's "
                              f"{len(self.cost.cluster.types)} device types (declaration order); the others are in "
                              "stage plans only")
        found = []
        for r in range(2, len(types) + 1):
            for subset in itertools.combinations(types, r):
                for split in splits(subset):
                    self.say("replicas: " + " | ".join(" + ".join(f"{k.count}× {k.device}" for k in g) for g in split))
                    self.tried.append(tuple("+".join(k.device for k in g) for g in split))
                    candidate = self.for_types(tuple(g[0] if len(g) == 1 else g for g in split))
                    if candidate is not None:
                        found.append(candidate)
        found.sort(key=lambda c: c.step_s)
        return found[:top]

    def fastest_alone(self) -> tuple[DeviceType, Result] | None:
        """The best one-type plan for the whole batch (what adding the other islands must beat)."""
        best = None
        for kind in self.cost.cluster.types:
            result = self.alone(kind, self.rows_total)
            if result is not None and (best is None or result.prediction.step_s < best[1].prediction.step_s):
                best = (kind, result)
        return best
