"""Search the plans of a cluster: enumerate, prune, rank with a closed form, confirm the best with the simulator.

Why two rounds: the simulator plays every action (S × M × V of them per stage) in Python, too slow for
the hundreds of thousands of candidates of a 512-device cluster; the closed form (Metis's: the sum of
the stages plus (M − 1) × the slowest, the bubble divided by V for interleaved schedules and by about
three for zero-bubble ones) ranks them in microseconds, and the cost model (``cost.CostModel``, the
simulator inside) re-predicts the best few hundred, which are then ranked by that prediction.

The space, and how it is pruned:
- device-type order: every ordering of every non-empty subset of the cluster's types (a type is used
  whole or not at all: a slow type may be better left out; ``use_all_types``: every type, in every order),
  each type with each of its grids — while that space (computed first) holds at most ``EXACT_LAYOUTS``
  layouts. It grows factorially with the types (6 catalog GPU types of 8 give 5.8e9 layouts), so past it
  the search is bounded and says so: the k fastest types for every k, two orders (fastest first, most memory
  first), each type's grid by coordinate descent — about 4·ROUNDS·T²·G layouts (Search.bounded_layouts).
  On 2 and 3 types, where both run, its best plan was within 1 % of the exhaustive one's step;
- per type: the stage count p divides its device count, and its p stages are alike (same devices,
  tp, dp, sp) — stages of one type are interchangeable, so unlike grids within a type add nothing
  the layer split cannot; tp divides the model's split sizes (an MoE model's expert widths too) and fits
  on one node; sp only with tp ≥ 2; ep (an MoE model) divides dp and the expert count, and a candidate
  whose layer split leaves an ep stage without MoE layers is dropped (the same split at ep 1 is searched);
- at most as many stages as layers (each stage needs one layer a chunk);
- micro-batch size: divides the config's global batch (kept fixed, so the training is the same) and
  is a multiple of every stage's dp; micro-batch count ≥ stages (1F1B), a multiple of it when interleaved;
- layer split: balanced by each stage's speed (greedy: the next layer goes where the stage time grows
  least; uneven allowed, embedding and head counted), so it is computed, not enumerated;
- recompute per stage and ZeRO-1: only where the plan would not fit otherwise (both cost time or
  nothing): turned on stage by stage, then ZeRO-1, then the candidate is dropped;
- schedules: 1f1b, zero-bubble, and with 2 chunks a stage interleaved-1f1b, interleaved-zero-bubble and zbv
  (whose V puts the head on the first stage).

Measured on the 2-core CI host (Llama-3.2-1B's shape with 64 layers, H100s plus Ascend 910Bs declared half
and half, every schedule): 64 devices, 26,106 candidates in 5.7 s; 512 devices, 32,262 in 6.2 s.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from hal.errors import ConfigError
from hal.parallel.config.memory import (
    OPTIMIZER_BYTES,
    WEIGHT_AND_GRADIENT_BYTES,
    embedding_parameters,
    final_norm_parameters,
    layer_parameters,
    routed_expert_parameters,
)
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan, StagePlan, moe_stages, validate_plan
from hal.parallel.planner.cluster import DeviceType
from hal.parallel.planner.cost import BOUNDARY_BYTES, CostModel, Placement, Prediction, expert_exchange_s, ring_all_reduce_s, transfer_s
from hal.parallel.schedules import Schedule, get_schedule

SCHEDULES = tuple(get_schedule(name) for name in ("1f1b", "zero-bubble", "interleaved-1f1b", "interleaved-zero-bubble", "zbv"))
CONFIRM = 200  # candidates the simulator re-predicts
ORDER_CONFIRM = 8  # of those, the best re-predicted with the measured-time order hal train will keep
EXACT_LAYOUTS = 20_000  # layouts walked exhaustively; above, the bounded search (a few device types stay below it)
ROUNDS = 2  # coordinate-descent rounds of the bounded search
PROGRESS_S = 1.0  # a progress line at most this often, the first after this long


@dataclass(frozen=True)
class Grid:
    kind: DeviceType
    stages: int
    tp: int
    dp: int
    sp: bool
    ep: int = 1  # expert parallelism (an MoE model): the routed experts sharded over ep of the dp ranks

    @property
    def devices(self) -> int:
        return self.tp * self.dp


@dataclass
class Result:
    plan: ParallelPlan
    placement: Placement
    prediction: Prediction


@dataclass
class SearchReport:
    results: list[Result]
    considered: int  # candidates ranked by the closed form
    confirmed: int  # re-predicted with the simulator
    pruned_memory: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    layouts: int = 0  # layouts (type order x grids) scored
    bounded: bool = False  # past EXACT_LAYOUTS: the polynomial search, not every layout
    replicas: list[Any] = field(default_factory=list)  # replica plans (planner.replica_search), fastest first


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_choices(model: ModelConfig, limit: int) -> list[int]:
    g = math.gcd(model.num_heads, model.num_kv_heads, model.hidden_size, model.ffn_hidden_size, model.vocab_size)
    if model.is_moe:  # every expert is split over tp too
        g = math.gcd(g, model.moe_ffn_hidden_size or model.ffn_hidden_size, model.moe_shared_ffn_size)
    return [t for t in _divisors(g) if t <= limit]


def _ep_choices(model: ModelConfig, dp: int) -> list[int]:
    """Expert-parallel degrees for a stage of ``dp`` replicas: dividing dp and the expert count (1 for a dense model)."""
    if not model.is_moe:
        return [1]
    return [e for e in _divisors(dp) if model.moe_num_experts % e == 0]


class Search:
    """One search over ``cluster`` for ``model`` keeping ``base``'s global batch and flags."""

    def __init__(self, cost: CostModel, base: ParallelPlan, *, progress: Callable[[str], None] | None = None,
                 use_all_types: bool = False, progress_s: float = PROGRESS_S, confirm: int = CONFIRM,
                 order_confirm: int = ORDER_CONFIRM) -> None:
        self.cost, self.base = cost, base
        self.confirm = confirm  # candidates the simulator re-predicts
        self.order_confirm = order_confirm  # of those, the best re-predicted with the measured-time order
        self.progress_s = progress_s
        self.use_all_types = use_all_types
        self.model, self.seq = cost.model, cost.seq
        self.rows_total = base.global_batch_size
        self.say = progress or (lambda _: None)
        self._layer_cache: dict[tuple[str, int, int, bool], tuple[float, float, float]] = {}
        self._mean_layer_params = layer_parameters(self.model)  # a sum over every layer: asked once per candidate stage
        m = self.model
        self._mean_expert_params = sum(routed_expert_parameters(m, i) for i in range(m.num_layers)) / m.num_layers
        self._moe_share = len(m.moe_layers()) / m.num_layers  # MoE layers' share of the layers
        self.schedules = SCHEDULES
        self.notes: list[str] = []

    # --- enumeration ------------------------------------------------------------------------------
    def grids(self, kind: DeviceType) -> list[Grid]:
        out = []
        for p in _divisors(kind.count):
            if p > self.model.num_layers:
                continue
            d = kind.count // p
            for tp in _tp_choices(self.model, min(d, kind.per_node)):
                if d % tp:
                    continue
                for sp in ((False, True) if tp > 1 and self.seq % tp == 0 else (False,)):
                    for ep in _ep_choices(self.model, d // tp):
                        out.append(Grid(kind, p, tp, d // tp, sp, ep))
        return out

    def layouts(self) -> Iterator[tuple[Grid, ...]]:
        """Every ordered choice of device types, each with one of its grids (the exhaustive space)."""
        types = list(self.cost.cluster.types)
        per_type = {t.device: self.grids(t) for t in types}
        for r in range(len(types) if self.use_all_types else 1, len(types) + 1):
            for order in itertools.permutations(types, r):
                for combo in itertools.product(*(per_type[t.device] for t in order)):
                    if sum(g.stages for g in combo) <= self.model.num_layers:
                        yield combo

    def layout_count(self) -> int:
        """How many layouts ``layouts`` walks (before the layer-count filter): Σ_r r! · e_r(grids a type), where e_r
        is the elementary symmetric sum — computed, not enumerated, so the choice of search costs nothing."""
        counts = [len(self.grids(t)) for t in self.cost.cluster.types]
        e = [1] + [0] * len(counts)
        for c in counts:
            for r in range(len(counts), 0, -1):
                e[r] += e[r - 1] * c
        sizes = [len(counts)] if self.use_all_types else range(1, len(counts) + 1)
        return sum(math.factorial(r) * e[r] for r in sizes)

    def bounded_layouts(self, score: Callable[[tuple[Grid, ...]], float]) -> None:
        """The search past ``EXACT_LAYOUTS``: polynomial in the number of device types T (about 4·ROUNDS·T²·G
        layouts scored, G grids a type). Which types: the k fastest for every k (a slow type is the one worth
        leaving out; every type with ``use_all_types``); their order: fastest first, and most memory first (1F1B's
        first stages hold the most micro-batches); each type's grid: coordinate descent, one type at a time with the
        others fixed, ``ROUNDS`` rounds at most, from two starts (plain data parallelism; each type's best grid on
        its own). ``score`` ranks a layout
        (its best closed-form step; every candidate it finds is kept as in the exhaustive search)."""
        types = list(self.cost.cluster.types)
        per_type = {t.device: self.grids(t) for t in types}
        speed = {t.device: self._layer(t, 1, 1, False)[0] + self._layer(t, 1, 1, False)[1] for t in types}
        alone = {t.device: min(per_type[t.device], key=lambda g: score((g,))) for t in types}  # each grid on its own
        fastest = sorted(types, key=lambda t: (speed[t.device] / t.count, t.device))
        subsets = [fastest] if self.use_all_types else [fastest[:k] for k in range(1, len(types) + 1)]
        for subset in subsets:
            by_memory = sorted(subset, key=lambda t: (-(t.memory_bytes.value if t.memory_bytes else 0.0), t.device))
            orders = {tuple(t.device for t in o): o for o in (subset, by_memory)}  # the two, once if they agree
            plain = lambda t: min(per_type[t.device], key=lambda g: (g.stages, g.tp, g.sp, g.ep))  # noqa: E731
            for order, start in itertools.product(orders.values(), (plain, lambda t: alone[t.device])):
                choice = [start(t) for t in order]
                best = score(tuple(choice)) if sum(g.stages for g in choice) <= self.model.num_layers else math.inf
                for _ in range(ROUNDS):
                    improved = False
                    for i, t in enumerate(order):
                        for grid in per_type[t.device]:
                            trial = (*choice[:i], grid, *choice[i + 1:])
                            if grid == choice[i] or sum(g.stages for g in trial) > self.model.num_layers:
                                continue
                            step = score(trial)
                            if step < best:
                                best, choice, improved = step, list(trial), True
                    if not improved:
                        break

    # --- costs used by the closed form ----------------------------------------------------------------
    def _layer(self, kind: DeviceType, tp: int, rows: int, recompute: bool) -> tuple[float, float, float]:
        key = (kind.device, tp, rows, recompute)
        if key not in self._layer_cache:
            self._layer_cache[key] = self.cost.device(kind).layer(tp, rows, self.seq, recompute)
        return self._layer_cache[key]

    def _contention(self, layout: tuple[Grid, ...]) -> dict[str, tuple[float, float]]:
        """Per cpu device type: (compute slowdown, wait per action) with every rank of the layout busy."""
        out = {}
        for g in layout:
            if g.kind.is_cpu:
                ranks = g.stages * g.devices * self.cost.device(g.kind).threads_or_one()
                occupancy = ranks / len(g.kind.nodes) / (g.kind.cores or 1)
                out[g.kind.device] = (self.cost.stretch(g.kind, occupancy), self.cost.action_wait(g.kind, occupancy))
        return out

    def candidates(self, layout: tuple[Grid, ...]) -> Iterator[tuple[float, ParallelPlan, tuple[DeviceType, ...]]]:
        """(closed-form step s, plan, stage kinds) for every micro-batching and schedule of ``layout`` that fits."""
        stages = [g for g in layout for _ in range(g.stages)]
        S, L = len(stages), self.model.num_layers
        kinds = tuple(g.kind for g in stages)
        lcm = math.lcm(*(g.dp for g in stages))
        stretch = self._contention(layout)
        for mbs in _divisors(self.rows_total):
            if mbs % lcm:
                continue
            M = self.rows_total // mbs
            for schedule in self.schedules:
                V = schedule.chunks()
                if M < S or schedule.problem(S, M) or L < S * V:
                    continue
                built = self._build(stages, kinds, mbs, M, schedule, V, stretch)
                if built is not None:
                    yield built

    def _build(self, stages: list[Grid], kinds: tuple[DeviceType, ...], mbs: int, M: int, schedule: Schedule, V: int,
               stretch: dict[str, tuple[float, float]]) -> tuple[float, ParallelPlan, tuple[DeviceType, ...]] | None:
        S, m = len(stages), self.model
        recompute = [False] * S
        zero1 = False
        while True:
            per_layer, extra = [], []
            for k, g in enumerate(stages):
                rows = mbs // g.dp
                f, b, _ = self._layer(g.kind, g.tp, rows, recompute[k])
                c, wait = stretch.get(g.kind.device, (1.0, 0.0))
                tp_s = 0.0
                if g.tp > 1:
                    gbps, lat, _ = self.cost.link(g.kind, g.kind, True)
                    tp_s = (4 + recompute[k]) * ring_all_reduce_s(rows * self.seq * m.hidden_size * BOUNDARY_BYTES, g.tp, gbps, lat)
                if g.ep > 1:  # the mean layer's share of an MoE layer's four exchanges (six with recompute)
                    gbps, lat, _ = self.cost.link(g.kind, g.kind, g.devices <= g.kind.per_node)
                    tp_s += ((4 + 2 * recompute[k]) * self._moe_share
                             * expert_exchange_s(rows * self.seq, m, g.ep, gbps, lat))
                per_layer.append((f + b) * c + tp_s)
                actions = V * (3 if schedule.splits_backward else 2)  # a micro-batch's compute actions on this stage
                prof, tokens, e = self.cost.device(g.kind), rows * self.seq, actions * wait
                if k == 0:
                    e += tokens * (prof.embedding.forward_s + prof.embedding.backward_s) * c
                if k == schedule.head_stage(S):
                    head = prof.head_for(self.base.fused_head)
                    e += tokens * (head.forward_s + head.backward_s) * c / g.tp
                extra.append(e)
            layers = balance(per_layer, extra, m.num_layers, V)
            if layers is None:
                return None
            over = self._over_memory(stages, layers, mbs, M, recompute, zero1, S, V)
            if over is None:
                break
            if not recompute[over]:
                recompute[over] = True
            elif not zero1 and stages[over].dp > 1:
                zero1 = True
            else:
                self.pruned_memory += 1
                return None
        times = [n * c + e for n, c, e in zip(layers, per_layer, extra)]
        p2p = self._p2p(stages, mbs)
        slowest = max(times)
        step = sum(times) / schedule.bubble_divisor + (M - 1) * slowest + 2 * (S * V - 1) * p2p + self._tail(stages, layers, zero1)
        plan_stages = tuple(
            StagePlan(g.kind.backend, g.devices, _chunks(n, V), g.tp, g.dp, g.sp, recompute[k], None, None, g.ep)
            for k, (g, n) in enumerate(zip(stages, layers)))
        plan = ParallelPlan(plan_stages, schedule, M, mbs, zero1, self.base.compile, self.base.compile_backend,
                            self.base.fused_head, V, self.base.order if schedule.plays_times or self.base.order != "measured" else "auto")
        holding = set(moe_stages(plan, m))
        if any(g.ep > 1 and k not in holding for k, g in enumerate(stages)):
            return None  # the layer split left an ep stage without MoE layers: the same plan at ep 1 is searched
        return step, plan, kinds

    def _stage_params(self, k: int, S: int, layers: int) -> int:
        m = self.model
        count = layers * self._mean_layer_params
        if k == 0:
            count += embedding_parameters(m)
        if k == S - 1:
            count += final_norm_parameters(m) + (0 if m.tie_embeddings and S == 1 else embedding_parameters(m))
        return count

    def _over_memory(self, stages: list[Grid], layers: list[int], mbs: int, M: int, recompute: list[bool], zero1: bool,
                     S: int, V: int) -> int | None:
        """The first stage whose rank would not fit (1F1B's in-flight bound: S − k micro-batches), or None."""
        host: dict[tuple[str, int], float] = {}
        worst = None
        for k, g in enumerate(stages):
            params = self._stage_params(k, S, layers[k]) / g.tp
            experts = layers[k] * self._mean_expert_params / g.tp  # held 1 / ep of them, their state over dp / ep
            static = ((params - experts) * (WEIGHT_AND_GRADIENT_BYTES + OPTIMIZER_BYTES / (g.dp if zero1 else 1))
                      + experts / g.ep * (WEIGHT_AND_GRADIENT_BYTES + OPTIMIZER_BYTES / (g.dp // g.ep if zero1 else 1)))
            act = layers[k] * self._layer(g.kind, g.tp, mbs // g.dp, recompute[k])[2] * min(S - k + (V > 1) * S, M)
            need = static + act
            cap = g.kind.memory_bytes
            if cap is None:
                continue
            if g.kind.is_cpu:
                host[(g.kind.device, 0)] = host.get((g.kind.device, 0), 0.0) + need * g.devices
                if host[(g.kind.device, 0)] > cap.value * len(g.kind.nodes) and worst is None:
                    worst = k
            elif need > cap.value and worst is None:
                worst = k
        return worst

    def _p2p(self, stages: list[Grid], mbs: int) -> float:
        worst = 0.0
        for a, b in zip(stages, stages[1:]):
            gbps, lat, _ = self.cost.link(a.kind, b.kind, a.kind.device == b.kind.device and len(a.kind.nodes) == 1)
            seq = self.seq / b.tp if b.sp else self.seq
            worst = max(worst, transfer_s(mbs / b.dp * seq * self.model.hidden_size * BOUNDARY_BYTES, gbps, lat))
        return worst

    def _tail(self, stages: list[Grid], layers: list[int], zero1: bool) -> float:
        worst, S = 0.0, len(stages)
        for k, (g, n) in enumerate(zip(stages, layers)):
            sync, opt = self.cost.stage_sync_s(g.kind, self._stage_params(k, S, n), n * self._mean_expert_params, g.tp,
                                               g.dp, g.ep, zero1, spans=g.devices > g.kind.per_node)
            worst = max(worst, sync + opt)
        return worst

    # --- the search --------------------------------------------------------------------------------------
    def run(self, top: int = 5) -> SearchReport:
        started = time.monotonic()
        self.pruned_memory = 0
        best: list[tuple[float, int, ParallelPlan, tuple[DeviceType, ...]]] = []
        considered, walked, seen = 0, 0, {}
        total = self.layout_count()
        exact = total <= EXACT_LAYOUTS
        last_said = started

        def score(layout: tuple[Grid, ...]) -> float:
            """Rank ``layout``'s candidates into ``best``; its best closed-form step (inf: none fits)."""
            nonlocal considered, walked, last_said
            key = tuple((g.kind.device, g.stages, g.tp, g.dp, g.sp, g.ep) for g in layout)
            if key in seen:
                return seen[key]
            walked += 1
            step_best = math.inf
            for step, plan, kinds in self.candidates(layout):
                considered += 1
                step_best = min(step_best, step)
                item = (-step, considered, plan, kinds)
                if len(best) < self.confirm:
                    heapq.heappush(best, item)
                elif item[0] > best[0][0]:
                    heapq.heapreplace(best, item)
            seen[key] = step_best
            now = time.monotonic()
            if now - last_said >= self.progress_s:
                last_said = now
                of = f" of {total:,}" if exact else ""
                self.say(f"searching: {walked:,}{of} layouts, {considered:,} candidates ranked, {now - started:.0f} s")
            return step_best

        if exact:
            for layout in self.layouts():
                score(layout)
        else:
            types = len(self.cost.cluster.types)
            note = (f"{types} device types give {total:,} layouts (type orders x grids), more than the "
                    f"{EXACT_LAYOUTS:,} searched exhaustively: the search was bounded (the k fastest types for each k, "
                    f"two orders, each type's grid by coordinate descent from two starts; polynomial in the types), so a better plan "
                    "may exist outside it")
            self.say(note)
            self.notes.append(note)
            self.bounded_layouts(score)
        if not best and not self.pruned_memory:  # nothing was even tried: the batch or the layers cannot be split so far
            raise ConfigError(f"hal plan --search: no layout splits a global batch of {self.rows_total} rows and "
                              f"{self.model.num_layers} layers over the cluster's {self.cost.cluster.device_count} devices; "
                              "declare fewer devices or raise the global batch (micro_batches x micro_batch_size)")
        if not best:
            raise ConfigError(f"hal plan --search: no plan of this model fits the cluster's {self.cost.cluster.device_count} "
                              f"devices ({self.pruned_memory} ran out of memory even with recompute and zero1); add devices, "
                              "shrink the model or the global batch")
        self.say(f"closed form ranked {considered} candidates; the simulator re-predicts the best {len(best)}")
        results = []
        for _, _, plan, kinds in best:
            place = Placement.pack(plan, kinds)
            pred = self.cost.predict(plan, place)
            if pred.fits:
                results.append(Result(plan, place, pred))
        results.sort(key=lambda r: r.prediction.step_s)
        results = self._with_measured_orders(results, top)
        for r in results[:top]:
            validate_plan(r.plan, self.model, world_size=r.plan.world_size, check_backends=False, seq_len=self.seq,
                          single_host=False, origin="hal plan --search")
        return SearchReport(results[:top], considered, len(best), self.pruned_memory, time.monotonic() - started,
                            list(self.notes), walked, not exact)


    def _with_measured_orders(self, results: list[Result], top: int) -> list[Result]:
        """The best ``order_confirm`` (at least ``top``) re-predicted with the order hal train will keep after its
        calibration (a played schedule under ``parallel.order: auto``), then ranked again: the unit order ranks the
        rest, because a timed play costs up to a second where a simulation costs milliseconds."""
        head = max(top, self.order_confirm)
        again = [Result(r.plan, r.placement, self.cost.predict(r.plan, r.placement, measured_order=True))
                 if r.plan.schedule.plays_times and r.plan.order != "unit" else r for r in results[:head]]
        return sorted(again, key=lambda r: r.prediction.step_s) + results[head:]


def _chunks(layers: int, V: int) -> int | tuple[int, ...]:
    if V == 1:
        return layers
    return tuple(layers // V + (1 if i < layers % V else 0) for i in range(V))


def balance(per_layer: list[float], extra: list[float], layers: int, V: int = 1) -> list[int] | None:
    """Layers per stage minimising the slowest stage (time = n × per_layer + extra), each stage ≥ V layers."""
    S = len(per_layer)
    if layers < S * V:
        return None
    counts = [V] * S
    heap = [((counts[k] + 1) * per_layer[k] + extra[k], k) for k in range(S)]
    heapq.heapify(heap)
    for _ in range(layers - S * V):
        _, k = heapq.heappop(heap)
        counts[k] += 1
        heapq.heappush(heap, ((counts[k] + 1) * per_layer[k] + extra[k], k))
    return counts


def report_dict(report: SearchReport, cost: CostModel) -> dict[str, Any]:
    """The search as plain data (``--json``)."""
    tokens = cost.seq
    return {
        "considered": report.considered, "confirmed_with_simulator": report.confirmed, "pruned_memory": report.pruned_memory,
        "search_s": report.seconds, "cluster": cost.cluster.to_dict(), "profile_estimated": cost.profile.estimated(),
        "seq": tokens, "notes": report.notes,
        "plans": [{"rank": i + 1, "plan": r.plan.to_dict(), "devices": [k.device for k in r.placement.kinds],
                   "prediction": r.prediction.to_dict()} for i, r in enumerate(report.results)],
        "replica_plans": [{"rank": i + 1, **c.to_dict()} for i, c in enumerate(report.replicas)],
    }
