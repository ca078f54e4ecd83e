"""Predict a plan's step time and per-rank memory on a cluster, from a profile and the schedule simulator.

Why the simulator: the schedule is data (``parallel.schedules``), so its makespan, per-stage bubble and
peak in-flight micro-batches for unequal stages come from playing it, not from a closed form that
holds for one schedule and equal stages only. The cost model's job is to feed it:

- per stage and micro-batch, forward and backward = layers × the profiled layer time at the stage's
  rows per replica (micro_batch_size / dp) and tp (recompute: the layer points measured with it), plus
  the embedding on the first stage and norm + head + loss on the last, plus tp's all-reduces (two per
  layer each way; recompute repeats one, or under sp three half-size exchanges) over the stage's link;
- the boundary transfer: one micro-batch's activations for one receiving replica over the link
  between the two stages (native CCL, another node, or the bridge between backends) — the simulator
  takes one p2p time, the slowest boundary's;
- an accelerator's host: where the profile has both clocks (``profile.LayerPoint``: host enqueue and
  device time), the simulator plays both — each stage's host enqueues its actions back to back and
  never waits for its neighbours (receives wait on the device), a device runs an action no sooner
  than its host queued it — so a host slower than its device sets the pace and the pipeline's drain
  comes on top; the engine's own host work per action is the profile's calibrated ``action_host_s``,
  and tp layers measured with their group carry their collectives' host and device cost;
- after the schedule, each stage's dp gradient sync (bucketed ring all-reduce over the stage's link;
  ZeRO-1: reduce-scatter + all-gather, the same bytes; on a cpu node, the collectives the profile
  measured with every pair of its ranks syncing at once) and its AdamW step; the step ends with the
  slowest stage.

CPU ranks share their node's cores: compute is stretched by the node's occupancy (busy share × ranks ×
threads / cores, busy from the simulated bubble, three rounds) through the slowdown the profile's
calibration pipelines measured at such occupancies (``planner.calibrate``; without them, occupancy
itself), every compute action pays the calibrated wait for its hand-off partner, and a tp all-reduce
costs at least the calibrated wait. Memory per rank =
``memory_check.rank_bytes`` (fp32 weights, grads, AdamW state, ZeRO-1 sharded) + activations × the simulator's peak in-flight micro-batches (+ one
layer's full activations while a checkpointed layer recomputes). Every prediction lists the estimated
numbers it used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hal.parallel.config.memory import rank_bytes, routed_expert_parameters, stage_parameters
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.planner.cluster import Cluster, DeviceType, Figure
from hal.parallel.planner.device_profile import DeviceProfile, Profile
from hal.parallel.schedules import Schedule, simulate
from hal.parallel.schedules.fastest import measured_or_unit
from hal.parallel.schedules.stage_times import StageTimes

BUCKET_BYTES = 16 * 2**20  # the engine's gradient bucket (parallel.pipeline.engine.BUCKET_BYTES)
BOUNDARY_BYTES = 4  # boundary activations travel in the weights' dtype: fp32
GRAD_BYTES = 4
DEFAULT_WEIGHT_SHARE = 0.5  # W's share of a split backward where the profile did not measure it (the unit-time play's)


@dataclass(frozen=True)
class Placement:
    """Which device type runs each stage, and where in that type's devices (numbered node by node) it starts."""

    kinds: tuple[DeviceType, ...]
    starts: tuple[int, ...]

    @classmethod
    def pack(cls, plan: ParallelPlan, kinds: tuple[DeviceType, ...]) -> Placement:
        """Stages of one type take its devices in pipeline order."""
        used: dict[str, int] = {}
        starts = []
        for stage, kind in zip(plan.stages, kinds):
            starts.append(used.get(kind.device, 0))
            used[kind.device] = starts[-1] + stage.devices
        return cls(kinds, tuple(starts))

    def nodes(self, k: int, devices: int) -> set[int]:
        kind, start = self.kinds[k], self.starts[k]
        return {kind.node_of(i) for i in range(start, start + devices)}


@dataclass
class StageCost:
    """One stage's share of a step (seconds per micro-batch, per step) and one rank's memory."""

    device: str
    forward_s: float
    backward_s: float
    tp_comm_s: float
    grad_sync_s: float
    optimizer_s: float
    weights_bytes: int  # weights + grads + optimizer state (memory_check.rank_bytes)
    activation_bytes: int
    memory_bytes: int
    capacity_bytes: int | None
    estimated: bool
    expert_exchange_s: float = 0.0  # ep: the MoE layers' dispatches and combines, per micro-batch both ways

    @property
    def fits(self) -> bool:
        return self.capacity_bytes is None or self.memory_bytes <= self.capacity_bytes


@dataclass
class Prediction:
    step_s: float
    tokens_per_s: float
    schedule_s: float
    p2p_s: float
    bubble: tuple[float, ...]
    bubble_overall: float
    in_flight: tuple[int, ...]
    stages: list[StageCost]
    bound: str
    estimated: list[str] = field(default_factory=list)
    # the simulator's inputs this prediction played (``simulate``'s keyword arguments): a written plan keeps them,
    # so ``hal train --profile`` can draw the planner's own timeline beside the measured one
    simulated: dict[str, Any] = field(default_factory=dict)
    # where predicted with ``measured_order``: which order hal train will keep and the two simulated schedules' spans
    order: dict[str, Any] | None = None

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "schedule_s": self.schedule_s, "p2p_s": self.p2p_s,
                "bubble": list(self.bubble), "bubble_overall": self.bubble_overall, "in_flight": list(self.in_flight),
                "bound": self.bound, "fits": self.fits, "estimated": self.estimated,
                "stages": [s.__dict__ | {"fits": s.fits} for s in self.stages],
                **({"order": self.order} if self.order is not None else {})}


def ring_all_reduce_s(nbytes: float, n: int, gbps: float, latency_us: float, buckets: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n of the bytes each way, 2(n-1) latencies per bucket."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (gbps * 1e9) + buckets * 2 * (n - 1) * latency_us * 1e-6


def transfer_s(nbytes: float, gbps: float, latency_us: float) -> float:
    return nbytes / (gbps * 1e9) + latency_us * 1e-6


def expert_exchange_s(tokens: float, model: ModelConfig, ep: int, gbps: float, latency_us: float) -> float:
    """One MoE exchange (dispatch or combine) of ``tokens`` tokens a rank over an ep group: each token's top-k rows
    of ``hidden`` values, the (ep - 1) / ep of them routed to other ranks (balanced routing) leaving this rank over
    its link at once, plus a count exchange's latency. A layer runs four: dispatch and combine, each way."""
    if ep <= 1 or tokens <= 0:
        return 0.0
    nbytes = tokens * model.moe_top_k * model.hidden_size * BOUNDARY_BYTES * (ep - 1) / ep
    return transfer_s(nbytes, gbps, latency_us) + latency_us * 1e-6


class CostModel:
    """A cluster, a profile, a model, a sequence length and a precision: ``predict(plan, placement)``."""

    def __init__(self, cluster: Cluster, profile: Profile, model: ModelConfig, seq: int) -> None:
        self.cluster, self.profile, self.model, self.seq = cluster, profile, model, seq
        # busy rank-threads of other work on a cpu node, (device, node) -> threads (replicas sharing the node's cores)
        self.background: dict[tuple[str, int], float] = {}

    # --- links ----------------------------------------------------------------------------------------
    def link(self, a: DeviceType, b: DeviceType, same_node: bool, *, bridged: bool | None = None) -> tuple[float, float, bool]:
        """(GB/s, µs, estimated) between two devices; a measured link of the profile replaces a default figure.
        ``bridged``: the two are in different islands (None: where their backends differ, as islands form by
        default); the bridge measured by ``hal profile`` on either side (the slower) replaces its default figure."""
        if bridged is None:
            bridged = a.backend != b.backend
        bw, lat = self.cluster.bridge(same_node) if bridged else self.cluster.between(a, b, same_node)
        measured = None
        if bridged:
            found = [self.profile.links[f"{k.backend}-bridge"] for k in (a, b) if f"{k.backend}-bridge" in self.profile.links]
            if found and same_node:
                measured = min(found, key=lambda link: link.bandwidth_gbps)
        elif a.backend == b.backend == "cpu" and same_node:
            measured = self.profile.links.get("cpu-island")
        if measured is not None:
            bw = Figure(measured.bandwidth_gbps, "measured") if bw.source == "default" else bw
            lat = Figure(measured.latency_us, "measured") if lat.source == "default" else lat
        return bw.value, lat.value, "default" in (bw.source, lat.source)

    def bridge_sum(self, a: DeviceType, b: DeviceType, nbytes: float, ranks: int) -> float | None:
        """Seconds of the bridge's all-reduce of ``nbytes`` over ``ranks`` speakers of one node, from the all-reduce
        ``hal profile`` timed across the bridge on either side (the slower); None where neither side measured it."""
        links = [self.profile.links.get(f"{k.backend}-bridge") for k in (a, b)]
        times = [t for t in (link.collective_s("all_reduce", nbytes, ranks) for link in links if link) if t is not None]
        return max(times) if times else None

    def device(self, kind: DeviceType) -> DeviceProfile:
        return self.profile.devices[kind.device]

    # --- one stage --------------------------------------------------------------------------------------
    def _compute(self, plan: ParallelPlan, place: Placement, k: int) -> tuple[float, float, float, float, float, int, int,
                                                                             tuple[float, float]]:
        """(forward s, backward s, comm forward s, comm backward s (tp's collectives and ep's exchanges), activation
        bytes of one micro-batch,
        tp all-reduces forward, backward, host enqueue s of one micro-batch's layers forward and backward) for stage k,
        uncontended.

        Where the profile has an accelerator's two clocks, forward and backward are the device's times and the
        host's enqueue times are returned beside them (the simulator plays both clocks); else they are 0."""
        stage, kind, m = plan.stages[k], place.kinds[k], self.model
        prof = self.device(kind)
        rows, seq = plan.micro_batch_size // stage.dp, self.seq
        f, b, act = prof.layer(stage.tp, rows, seq, stage.checkpoint, stage.sp)
        clocks = prof.clocks(stage.tp, rows, seq, stage.checkpoint, stage.sp)
        L = stage.layer_count
        host_x = device_x = 1.0
        if plan.schedule.splits_backward and prof.split_cost:  # the split program's measured cost (graph breaks)
            host_x, device_x = prof.split_cost
        host = (0.0, 0.0)
        if clocks is not None:
            host, (f, b) = (L * clocks[0] * host_x, L * clocks[1] * host_x), clocks[2:]
        fwd, bwd = L * f * device_x, L * b * device_x
        tokens = rows * seq
        if k == 0:
            fwd += tokens * prof.embedding.forward_s
            bwd += tokens * prof.embedding.backward_s
        head_act = 0.0
        if k == plan.last_stage:
            head = prof.head_for(plan.fused_head)
            fwd += tokens * head.forward_s / stage.tp
            bwd += tokens * head.backward_s / stage.tp
            head_act = head.saved_bytes(tokens) / stage.tp
        tp_f = tp_b = 0.0
        calls_f = calls_b = 0  # tp all-reduces inside the stage's compute (each a blocking exchange)
        if stage.tp > 1 and not prof.has_tp_points(stage.tp, stage.sp):  # measured points include the collectives
            gbps, lat, _ = self.link(kind, kind, True)
            one = ring_all_reduce_s(tokens * m.hidden_size * BOUNDARY_BYTES, stage.tp, gbps, lat)
            # Two row-parallel all-reduces a layer each way. Recompute re-runs the forward up to its last saved tensor
            # (torch's early stop, ``Stage._run_layer``): tp repeats the attention output's all-reduce, sp its two
            # all-gathers and the reduce-scatter — three half-size exchanges, counted as two.
            calls_f, calls_b = 2 * L, (2 + ((2 if stage.sp else 1) if stage.checkpoint else 0)) * L
            tp_f, tp_b = calls_f * one, calls_b * one
            if stage.sp and prof.sp_exchange_s(0.0) is not None:  # a calibrated wait per sp exchange: count them all
                calls_f, calls_b = 4 * L, (4 + (3 if stage.checkpoint else 0)) * L
        ep_f, ep_b = self._expert_exchanges(plan, place, k)
        return fwd, bwd, tp_f + ep_f, tp_b + ep_b, L * act + head_act, calls_f, calls_b, host

    def _expert_exchanges(self, plan: ParallelPlan, place: Placement, k: int) -> tuple[float, float]:
        """(forward s, backward s) of stage k's MoE exchanges for one micro-batch under ep: each MoE layer's dispatch
        and combine each way (a recomputed layer repeats its forward's)."""
        stage, kind, m = plan.stages[k], place.kinds[k], self.model
        if stage.ep <= 1:
            return 0.0, 0.0
        gbps, lat, _ = self.link(kind, kind, stage.devices <= kind.per_node)
        moe = sum(1 for i in plan.stage_layers(k) if m.is_moe_layer(i))
        one = expert_exchange_s(plan.micro_batch_size // stage.dp * self.seq, m, stage.ep, gbps, lat)
        return 2 * moe * one, (2 + (2 if stage.checkpoint else 0)) * moe * one

    def _tail(self, plan: ParallelPlan, place: Placement, k: int) -> tuple[float, float]:
        """(dp gradient sync s, optimizer s) of stage k after the schedule."""
        stage, kind = plan.stages[k], place.kinds[k]
        experts = sum(routed_expert_parameters(self.model, i) for i in plan.stage_layers(k))
        return self.stage_sync_s(kind, stage_parameters(self.model, plan, k), experts, stage.tp, stage.dp, stage.ep,
                                 plan.zero1, spans=len(place.nodes(k, stage.devices)) > 1)

    def stage_sync_s(self, kind: DeviceType, params: float, experts: float, tp: int, dp: int, ep: int, zero1: bool, *,
                     spans: bool) -> tuple[float, float]:
        """(gradient sync s, optimizer s) of a stage of ``params`` parameters, ``experts`` of them routed experts: the
        dense ones sync over the dp replicas, a rank's 1 / ep of the experts over their dp / ep replicas (the
        engine's two groups); each tp shard apart (the search's screening uses this too)."""
        dense, mine = (params - experts) / tp, experts / ep / tp
        sync = self.dp_sync_s(kind, dense, dp, zero1, spans=spans)
        if mine:
            sync += self.dp_sync_s(kind, mine, dp // ep, zero1, spans=spans)
        opt = (dense / (dp if zero1 else 1) + mine / (dp // ep if zero1 else 1)) * self.device(kind).optimizer_s_per_param
        return sync, opt

    def dp_sync_s(self, kind: DeviceType, params: float, dp: int, zero1: bool, *, spans: bool) -> float:
        """Seconds of a stage's gradient sync over ``dp`` replicas of ``params`` parameters (per tp shard): a cpu
        node's measured loaded collectives where the profile has them, else bucketed rings over the link (the
        search's screening uses this too, so it ranks plans as the full prediction does)."""
        if dp <= 1:
            return 0.0
        nbytes = params * GRAD_BYTES
        loaded = None if spans or not kind.is_cpu else self._loaded_sync(nbytes, dp, zero1)
        if loaded is not None:
            return loaded
        gbps, lat, _ = self.link(kind, kind, not spans)
        return ring_all_reduce_s(nbytes, dp, gbps, lat, max(1, math.ceil(nbytes / BUCKET_BYTES)))

    def _loaded_sync(self, nbytes: float, dp: int, zero1: bool) -> float | None:
        """A cpu stage's dp gradient sync from the island's measured loaded collectives (every dp group of the node
        syncing at once, as in a step): the engine's bucketed all-reduces, or ZeRO-1's reduce-scatter of the
        gradients and all-gather of the parameters; None where the profile has no such measurement."""
        island = self.profile.links.get("cpu-island")
        if island is None or not island.loaded_collectives:
            return None
        if zero1:
            parts = [island.collective_s(op, nbytes, dp) for op in ("reduce_scatter", "all_gather")]
            return None if None in parts else sum(p for p in parts if p is not None)
        full, rest = divmod(nbytes, BUCKET_BYTES)
        whole = island.collective_s("all_reduce", BUCKET_BYTES, dp) if full else 0.0
        last = island.collective_s("all_reduce", rest, dp) if rest else 0.0
        return None if whole is None or last is None else full * whole + last

    def _p2p(self, plan: ParallelPlan, place: Placement) -> float:
        """The slowest boundary's transfer of one micro-batch to one receiving replica (with interleaving, the wrap too)."""
        S, worst = plan.num_stages, 0.0
        pairs = [(k, k + 1) for k in range(S - 1)] + ([(S - 1, 0)] if plan.virtual_stages > 1 and plan.placement == "loop" else [])
        for a, b in pairs:
            sa, sb = plan.stages[a], plan.stages[b]
            same = place.nodes(a, sa.devices) & place.nodes(b, sb.devices)
            gbps, lat, _ = self.link(place.kinds[a], place.kinds[b], bool(same))
            rows = plan.micro_batch_size / sb.dp
            seq = self.seq / sb.tp if sb.sp else self.seq
            worst = max(worst, transfer_s(rows * seq * self.model.hidden_size * BOUNDARY_BYTES, gbps, lat))
        return worst

    # --- the plan -----------------------------------------------------------------------------------------
    def predict(self, plan: ParallelPlan, place: Placement, *, measured_order: bool = False) -> Prediction:
        """The plan's step, bubble and memory. ``measured_order``: where the run will play its order from measured
        times (``parallel.order`` auto or measured with a played schedule), predict that order — played from these
        predicted times, kept where the simulator finds it faster than the unit order, as ``hal train`` keeps it.
        Off by default: a play costs up to a second at 16 stages × 32 micro-batches, so the search ranks its
        candidates with the unit order and re-predicts only its best few this way."""
        S, M, V = plan.num_stages, plan.micro_batches, plan.virtual_stages
        base = [self._compute(plan, place, k) for k in range(S)]
        tails = [self._tail(plan, place, k) for k in range(S)]
        p2p = self._p2p(plan, place)
        schedule = plan.schedule
        shares = [[n / s.layer_count for n in s.chunk_layers(V)] for s in plan.stages] if V > 1 else None
        occupancy = self._occupancy(plan, place, [1.0] * S)
        # An accelerator's host enqueues its program without waiting on its neighbours (receives wait on the device):
        # the simulator plays each stage's host clock beside its device's (``simulate``'s host_* arguments).
        per_action = [self.device(kind).action_host_s or 0.0 for kind in place.kinds]
        host_clocks: dict[str, Any] = {}
        if any(b[7] != (0.0, 0.0) for b in base) or any(per_action):
            host_clocks = {"host_forward_s": [b[7][0] for b in base], "host_backward_s": [b[7][1] for b in base],
                           "host_action_s": per_action}
        # the weight half's share of each stage's backward, as its device's profile measured it (else the play's half)
        w_share = [self.device(kind).weight_share for kind in place.kinds]
        unmeasured_share = schedule.splits_backward and None in w_share
        w_share = [DEFAULT_WEIGHT_SHARE if w is None else w for w in w_share]
        for _ in range(3):  # contention depends on how busy the ranks are, which the simulation says
            stretch = [self.stretch(kind, occ) for kind, occ in zip(place.kinds, occupancy)]
            tp_wait = [self._tp_wait(kind, occ, stage.sp) for kind, occ, stage in zip(place.kinds, occupancy, plan.stages)]
            action_wait = [self.action_wait(kind, occ) for kind, occ in zip(place.kinds, occupancy)]
            fwd = [b[0] * stretch[k] + max(b[2], tp_wait[k] * b[5]) for k, b in enumerate(base)]
            bwd = [b[1] * stretch[k] + max(b[3], tp_wait[k] * b[6]) for k, b in enumerate(base)]
            sim = simulate(schedule, S, M, forward_s=fwd, backward_s=bwd, p2p_s=p2p, virtual_stages=V,
                           chunk_share=shares, action_s=action_wait, weight_share=w_share, **host_clocks)
            occupancy = self._occupancy(plan, place, [1.0 - x for x in sim.bubble])
        order = None
        if measured_order and plan.order in ("auto", "measured") and schedule.plays_times:
            kept, order = self._measured_order(schedule, S, M, V, fwd, bwd, p2p, shares, w_share)
            if kept.times is not None:  # the played order is what will run: the step as it plays
                sim = simulate(kept, S, M, forward_s=fwd, backward_s=bwd, p2p_s=p2p, virtual_stages=V,
                               chunk_share=shares, action_s=action_wait, weight_share=w_share, **host_clocks)
        tail_occupancy = self._occupancy(plan, place, [1.0] * S)
        tail = max((t[0] + t[1] * self.stretch(place.kinds[k], tail_occupancy[k])) for k, t in enumerate(tails))
        actions = [sum(1 for sp in sim.timeline if sp.stage == k) for k in range(S)]
        host = [M * sum(b[7]) + actions[k] * per_action[k] for k, b in enumerate(base)]  # each host's enqueue time
        schedule_s = sim.makespan
        step = schedule_s + tail
        stages = [self._stage_cost(plan, place, k, fwd[k], bwd[k], base[k], tails[k], sim.peak_in_flight[k]) for k in range(S)]
        self._host_memory(plan, place, stages)
        tokens = plan.global_batch_size * self.seq
        estimated = self._estimated(place)
        timed_compiled = bool(self.profile.meta.get("compiled_layers"))
        differ = [k for k in range(S) if plan.stage_compiles(k) != timed_compiled]
        if differ:  # a compiled layer is another program than an eager one: its times are another's
            estimated.append(f"stage(s) {', '.join(map(str, differ))} " + (
                "run eager layers, timed compiled" if timed_compiled else
                "compile their layers, timed eager (hal profile of a config that compiles times them compiled)"))
        if unmeasured_share:
            estimated.append("the weight half of a split backward assumed half the backward (a profile from before "
                             "hal profile measured its share; run hal profile again)")
        unpriced = [k for k in range(S) if not self.device(place.kinds[k]).split_cost] if plan.schedule.splits_backward else []
        if unpriced:  # benchmarks/split_backward.py: a compiled layer's graph breaks cost the host most
            estimated.append(f"stage(s) {', '.join(map(str, unpriced))} priced with whole layers, not split ones (a profile "
                             "from before hal profile measured the split; on an H200 compiled split layers took 1.03x "
                             "the whole ones' time at 4 x 2048 tokens a micro-batch, 2.4x at 1 x 2048: host-bound)")
        played = {"forward_s": fwd, "backward_s": bwd, "p2p_s": p2p, "virtual_stages": V, "chunk_share": shares,
                  "action_s": action_wait, **host_clocks}
        pred = Prediction(step, tokens / step, schedule_s, p2p, sim.bubble, sim.bubble_overall, sim.peak_in_flight,
                          stages, "", estimated, played)
        pred.bound = self._bound(plan, pred, fwd, bwd, tails, host)
        pred.order = order
        return pred

    @staticmethod
    def _measured_order(schedule: Schedule, S: int, M: int, V: int, fwd: list[float], bwd: list[float], p2p: float,
                        shares: list[list[float]] | None, w_share: list[float]) -> tuple[Schedule, dict[str, Any]]:
        """The order ``hal train`` will keep after its calibration, as this prediction's times foresee it (each stage's
        F, I and W per chunk, W the stage's measured share of the backward, every link ``p2p``), and what it says
        of it (``Prediction.order``)."""
        share = shares or [[1.0 / V] * V for _ in range(S)]
        forward = [[fwd[k] * share[k][v] for v in range(V)] for k in range(S)]
        weight = [[bwd[k] * share[k][v] * w_share[k] for v in range(V)] for k in range(S)]
        inputs = [[bwd[k] * share[k][v] * (1.0 - w_share[k]) for v in range(V)] for k in range(S)]
        links = [p2p] * (S - 1) + ([p2p] if V > 1 and schedule.placement == "loop" and S > 1 else [])
        keep, unit_s, measured_s = measured_or_unit(schedule, StageTimes.of(forward, inputs, weight, links), M)
        return keep, {"chosen": "unit" if keep.times is None else "measured", "unit_step_s": unit_s,
                      "measured_step_s": measured_s}

    def _occupancy(self, plan: ParallelPlan, place: Placement, busy: list[float]) -> list[float]:
        """Per stage: how busy the cores of its (busiest) cpu node are — busy share × threads of every rank
        there, over the node's cores; 0 for stages on accelerators."""
        load: dict[tuple[str, int], float] = dict(self.background)
        for k, (stage, kind) in enumerate(zip(plan.stages, place.kinds)):
            if kind.is_cpu:
                for i in range(place.starts[k], place.starts[k] + stage.devices):
                    key = (kind.device, kind.node_of(i))
                    load[key] = load.get(key, 0.0) + busy[k] * self.device(kind).threads_or_one()
        out = []
        for k, kind in enumerate(place.kinds):
            nodes = place.nodes(k, plan.stages[k].devices)
            out.append(max(load[(kind.device, n)] / (kind.cores or 1) for n in nodes) if kind.is_cpu else 0.0)
        return out

    def _tp_wait(self, kind: DeviceType, occupancy: float, sp: bool = False) -> float:
        """What one tp exchange costs on a cpu node this busy, calibrated: an all-reduce, or under sp an all-gather or
        reduce-scatter where the profile calibrated those (0 elsewhere: the ring model stands)."""
        if not kind.is_cpu:
            return 0.0
        prof = self.device(kind)
        exchange = prof.sp_exchange_s(occupancy) if sp else None
        return exchange if exchange is not None else (prof.tp_all_reduce_s(occupancy) or 0.0)

    def action_wait(self, kind: DeviceType, occupancy: float) -> float:
        """Seconds each compute action of a cpu rank waits on a node this busy, calibrated (0 elsewhere)."""
        return self.device(kind).action_wait_s(occupancy) if kind.is_cpu else 0.0

    def stretch(self, kind: DeviceType, occupancy: float) -> float:
        """The profile's measured in-run slowdown at this node occupancy; without calibration points, the share
        of the node's cores each busy rank gets."""
        if not kind.is_cpu:
            return 1.0
        measured = self.device(kind).stretch(occupancy)
        return max(1.0, occupancy) if measured is None else measured

    def _stage_cost(self, plan: ParallelPlan, place: Placement, k: int, fwd: float, bwd: float,
                    base: tuple[float, float, float, float, float, int, int, tuple[float, float]], tail: tuple[float, float],
                    in_flight: int) -> StageCost:
        stage, kind = plan.stages[k], place.kinds[k]
        static = rank_bytes(self.model, plan, k)
        per_mb = base[4]
        held = in_flight / plan.virtual_stages  # the simulator counts chunk activations for interleaved plans
        act = per_mb * held
        if stage.checkpoint:  # one layer's full activations while it recomputes
            act += self.device(kind).layer(stage.tp, plan.micro_batch_size // stage.dp, self.seq, False)[2]
        if k == plan.last_stage:  # the head's backward: its logits gradient and the loss's copies, once
            act += plan.micro_batch_size // stage.dp * self.seq * self.device(kind).head_for(plan.fused_head).transient_bytes / stage.tp
        capacity = None if kind.memory_bytes is None else int(kind.memory_bytes.value)
        expert = sum(self._expert_exchanges(plan, place, k))
        return StageCost(kind.device, fwd, bwd, base[2] + base[3] - expert, tail[0], tail[1], static, int(act),
                         int(static + act), capacity, self.device(kind).estimated, expert)

    def _host_memory(self, plan: ParallelPlan, place: Placement, stages: list[StageCost]) -> None:
        """cpu ranks of one node share its memory: each rank's capacity is its share of what the node's ranks need."""
        need: dict[tuple[str, int], int] = {}
        for k, (stage, kind) in enumerate(zip(plan.stages, place.kinds)):
            if kind.is_cpu:
                for i in range(place.starts[k], place.starts[k] + stage.devices):
                    key = (kind.device, kind.node_of(i))
                    need[key] = need.get(key, 0) + stages[k].memory_bytes
        for k, kind in enumerate(place.kinds):
            if kind.is_cpu and kind.memory_bytes is not None:
                worst = max(need[(kind.device, n)] for n in place.nodes(k, plan.stages[k].devices))
                # a rank fits when the node's ranks together fit: scale this rank's capacity by that ratio
                stages[k].capacity_bytes = int(stages[k].memory_bytes * kind.memory_bytes.value / max(worst, 1))

    def _estimated(self, place: Placement) -> list[str]:
        out = sorted({f"{k.device} compute (estimated from the catalog)" for k in place.kinds if self.device(k).estimated})
        for k in {kind.device: kind for kind in place.kinds}.values():
            if k.link_gbps.source == "default" and not (k.is_cpu and "cpu-island" in self.profile.links):
                out.append(f"{k.device} link ({k.link_gbps.value:g} GB/s, documented default)")
        backends = {k.backend for k in place.kinds}
        if len(backends) > 1 and self.cluster.links.bridge_gbps == 10.0 and not any(
                f"{b}-bridge" in self.profile.links for b in backends):
            out.append("bridge between backends (10 GB/s, documented default)")
        return out

    def _bound(self, plan: ParallelPlan, pred: Prediction, fwd: list[float], bwd: list[float], tails: list[tuple[float, float]],
               host: list[float]) -> str:
        """The largest part of the step: the slowest stage's compute, the bubble, the tail (sync/optimizer), transfers,
        or a host too slow to keep its device fed."""
        M = plan.micro_batches
        busy = [M * (f + b) for f, b in zip(fwd, bwd)]
        k = max(range(len(busy)), key=busy.__getitem__)
        slowest_host = max(range(len(host)), key=host.__getitem__)
        if host[slowest_host] >= busy[k] and host[slowest_host] > 0:  # a host, not a device, sets the pace
            return f"host of stage {slowest_host} ({pred.stages[slowest_host].device}): enqueues slower than its device runs"
        parts = {
            f"compute of stage {k} ({pred.stages[k].device})": busy[k],
            f"pipeline bubble ({pred.bubble_overall:.0%} idle)": pred.schedule_s - busy[k],
            "dp gradient sync": max(t[0] for t in tails),
            "optimizer step": max(t[1] for t in tails),
        }
        return max(parts, key=parts.__getitem__)
