"""A step's timeline as data: every rank's measured spans, and the simulator's prediction for the same plan.

Why: ``--profile``'s per-phase sums say how long a stage idled, not where. The picture
(``parallel.observe.timeline_plot``) needs each compute action and each P2P post or wait in time, per rank,
next to what the simulator (``parallel.schedules.simulate``) expects from the same schedule fed with
those measured compute times: what differs is communication, waiting and noise, which the simulator
leaves out. The document is plain JSON (``RUN_DIR/timeline.json``), so a saved one redraws the same.

Document (version 1): ``schedule``, ``num_stages``, ``micro_batches``, ``virtual_stages``, ``unit``
("s", or "layer" for ``hal plan``'s layer-proportional guess), ``stages`` [{stage, backend, ranks}],
``predicted`` {assumes, forward, backward, weight_share, makespan, bubble, spans [{stage, kind, mb,
chunk, start, end}]}, optionally ``planned`` in the same form (the planner's own timeline, which ``hal train``
adds from a written plan's ``planned:`` section, ``parallel.config.planned``, with ``step_s`` predicted), and
for a measured step also ``step``, ``clock`` ("host", "events", or both where stages differ) and
``aligned`` (how the ranks' clocks were lined up), ``makespan`` and ``ranks`` [{rank, stage, dp, tp, clock, host,
clock_at_origin, schedule [start, end], spans [{kind, mb, chunk, what, start, end}], compute, p2p,
idle}] with shares of the measured makespan (idle: neither computing nor in a P2P call). A span's kind is F, B, I or W (compute),
p2p (a batch posted, or a wait for one) or grad_sync; times are seconds after the first rank's
schedule began.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from hal.errors import HalError
from hal.parallel.config.plan import ParallelPlan
from hal.parallel.config.planned import Planned
from hal.parallel.config.topology import Topology
from hal.parallel.schedules import Action, Overlap, P2PBatch, Schedule, get_schedule, simulate

VERSION = 1
COMPUTE = ("F", "B", "I", "W", "P")  # P: a DualPipeV pair, its forward and backward at once


# --- measured: one rank's spans ------------------------------------------------------------------------


def span_record(phase: str, label: Any, start: float, end: float) -> dict[str, Any]:
    """One labelled timer interval (``PhaseTimer.spans``) as a JSON span."""
    record: dict[str, Any] = {"kind": phase, "mb": None, "chunk": None, "what": str(label),
                              "start": float(start), "end": float(end)}
    if isinstance(label, Action) and label.kind.is_compute:
        record.update(kind=label.kind.value, mb=label.micro_batch, chunk=label.chunk)
    elif isinstance(label, Overlap):  # filed under its forward's micro-batch and chunk; "what" names both
        record.update(kind="P", mb=label.forward.micro_batch, chunk=label.forward.chunk)
    elif isinstance(label, (Action, P2PBatch)) or phase == "p2p":
        record["kind"] = "p2p"
        if isinstance(label, Action):  # an interleaved compute waiting for the receive it needs
            record["what"] = f"wait {label}"
    return record


def rank_record(rank: int, stage: int, dp: int, tp: int, spans: Sequence[Any], *, host: str,
                clock_at_origin: float, clock: str = "host") -> dict[str, Any]:
    """This rank's step: its schedule window and its spans (``PipelineEngine.step_spans``), times in seconds.

    ``host`` and ``clock_at_origin`` (``time.perf_counter()`` when the spans' origin was marked) line the
    ranks up: on one host that clock is the same for every process, so ranks that left the barrier
    at different moments are still placed exactly (``measured_document``). ``clock``: what timed the
    spans, "host" or "events" (an accelerator under ``--profile``).
    """
    records = [span_record(*span) for span in spans]
    window = [r for r in records if r["kind"] == "schedule"]
    if not window:
        raise HalError(f"rank {rank}: the step has no schedule span; record it with engine.step_spans() after a step")
    return {"rank": rank, "stage": stage, "dp": dp, "tp": tp, "clock": clock, "host": host, "clock_at_origin": clock_at_origin,
            "schedule": [window[0]["start"], window[0]["end"]], "spans": [r for r in records if r["kind"] != "schedule"]}


# --- measured: every rank's spans as one document ---------------------------------------------------------


def measured_document(plan: ParallelPlan, topology: Topology, ranks: Sequence[dict[str, Any]], *, step: int,
                      schedule: Schedule | None = None) -> dict[str, Any]:
    """Every rank's record of one step on one time axis, the earliest schedule start at 0, with shares and the prediction.

    Ranks on one host are placed by the host clock they share (``aligned`` "host clock"); across hosts
    each rank's origin is its exit from the barrier before the step (``aligned`` "barrier").
    """
    ranks = sorted((dict(r) for r in ranks), key=lambda r: r["rank"])
    shared = len({r["host"] for r in ranks}) == 1
    first = min(r["clock_at_origin"] for r in ranks)
    offset = {r["rank"]: r["clock_at_origin"] - first if shared else 0.0 for r in ranks}
    zero = min(r["schedule"][0] + offset[r["rank"]] for r in ranks)
    for r in ranks:
        shift = offset[r["rank"]] - zero
        r["schedule"] = [t + shift for t in r["schedule"]]
        r["spans"] = [{**s, "start": s["start"] + shift, "end": s["end"] + shift} for s in r["spans"]]
    makespan = max(r["schedule"][1] for r in ranks)
    for r in ranks:
        r.update(_shares(r["spans"], makespan))
    doc = _header(plan, topology, "s")
    clocks = sorted({r["clock"] for r in ranks})
    doc.update(step=step, clock=clocks[0] if len(clocks) == 1 else " + ".join(clocks), aligned="host clock" if shared else "barrier",
               makespan=makespan, ranks=ranks)
    if schedule is not None and schedule.times is not None:  # parallel.order: measured — the order that ran
        doc["order"] = "measured"
    costs = measured_costs(doc)
    pairs = ", pairs at their measured share" if any(p < 1.0 for p in costs["pair_share"]) else ""
    doc["predicted"] = predict(doc, **costs, schedule=schedule,
                               assumes=f"each stage's measured mean forward and backward per micro-batch{pairs}; "
                                       "communication free")
    return doc


def _shares(spans: Sequence[dict[str, Any]], makespan: float) -> dict[str, float]:
    """Compute, P2P and idle as shares of the schedule's makespan (the slowest rank's schedule end)."""
    busy = {"compute": 0.0, "p2p": 0.0}
    for s in spans:
        key = "compute" if s["kind"] in COMPUTE else "p2p" if s["kind"] == "p2p" else None
        if key is not None:  # the gradient sync comes after the schedule: not part of its window
            busy[key] += max(0.0, min(s["end"], makespan) - max(s["start"], 0.0))
    if makespan <= 0:
        return {"compute": 0.0, "p2p": 0.0, "idle": 0.0}
    compute, p2p = busy["compute"] / makespan, busy["p2p"] / makespan
    return {"compute": compute, "p2p": p2p, "idle": max(0.0, 1.0 - compute - p2p)}


def measured_costs(doc: dict[str, Any]) -> dict[str, Any]:
    """Per stage, the mean forward and backward time of one micro-batch through all its chunks (the
    simulator's inputs), each chunk's share of it, the weight half's share of a split backward, and what a pair run
    at once (DualPipeV's ``P`` spans) took of its forward and the other chunk's backward in turn (1.0: no pairs)."""
    S, V = doc["num_stages"], doc["virtual_stages"]
    durations: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    for r in doc["ranks"]:
        for s in r["spans"]:
            if s["kind"] in COMPUTE:
                durations[(r["stage"], s["kind"], s["chunk"] or 0)].append(s["end"] - s["start"])

    def mean(stage: int, kind: str, chunk: int) -> float:
        values = durations.get((stage, kind, chunk), [])
        return sum(values) / len(values) if values else 0.0

    forward, backward, shares = [], [], []
    for k in range(S):
        f = [mean(k, "F", v) for v in range(V)]
        b = [mean(k, "B", v) + mean(k, "I", v) + mean(k, "W", v) for v in range(V)]
        forward.append(sum(f))
        backward.append(sum(b))
        total = sum(f) + sum(b)
        shares.append([(fv + bv) / total for fv, bv in zip(f, b)] if total > 0 else [1.0 / V] * V)
    inputs = sum(sum(v) for key, v in durations.items() if key[1] == "I")
    weights = sum(sum(v) for key, v in durations.items() if key[1] == "W")
    share = weights / (inputs + weights) if inputs + weights > 0 else 0.5
    pair_share = []
    for k in range(S):  # a pair is filed under its forward's chunk c; its backward is the other chunk's (V = 2)
        spent = sum(sum(durations.get((k, "P", c), [])) for c in range(V))
        in_turn = sum(len(durations.get((k, "P", c), [])) * (forward[k] * shares[k][c] + backward[k] * shares[k][V - 1 - c])
                      for c in range(V))  # what the simulator charges that forward and backward one after the other
        pair_share.append(min(1.0, spent / in_turn) if V == 2 and spent > 0 and in_turn > 0 else 1.0)
    return {"forward": forward, "backward": backward, "weight_share": share, "chunk_share": shares,
            "pair_share": pair_share}


# --- predicted -------------------------------------------------------------------------------------------------


def layer_proportional(plan: ParallelPlan) -> dict[str, Any]:
    """The simulator's per-stage times when nothing was measured: one time unit per layer forward,
    two per layer backward, each chunk's share its share of the stage's layers."""
    layers = [float(s.layer_count) for s in plan.stages]
    shares = [[n / s.layer_count for n in s.chunk_layers(plan.virtual_stages)] for s in plan.stages]
    return {"forward_s": layers, "backward_s": [2.0 * n for n in layers], "chunk_share": shares}


def predict(doc: dict[str, Any], *, forward: Sequence[float], backward: Sequence[float], weight_share: float,
            chunk_share: Sequence[Sequence[float]], assumes: str, schedule: Schedule | None = None,
            pair_share: Sequence[float] | None = None) -> dict[str, Any]:
    """The simulator's timeline of the document's schedule with these per-stage times (``schedule``: the object
    that ran, whose order may have been played from measured times; default: the named schedule's unit order;
    ``pair_share``: what a pair run at once took of its two actions in turn, a stage; default 1.0, in turn)."""
    pairs = list(pair_share) if pair_share is not None else [1.0] * doc["num_stages"]
    sim = simulate(schedule or get_schedule(doc["schedule"]), doc["num_stages"], doc["micro_batches"], forward_s=list(forward),
                   backward_s=list(backward), weight_share=weight_share, virtual_stages=doc["virtual_stages"],
                   chunk_share=[list(row) for row in chunk_share], pair_share=pairs)
    return {"assumes": assumes, "forward": list(forward), "backward": list(backward), "weight_share": weight_share,
            **({"pair_share": pairs} if any(p < 1.0 for p in pairs) else {}),
            "makespan": sim.makespan, "bubble": list(sim.bubble), "spans": simulated_spans(sim)}


def simulated_spans(sim: Any) -> list[dict[str, Any]]:
    """A simulation's timeline as the document's predicted spans."""
    return [{"stage": sp.stage, "kind": sp.action.kind.value, "mb": sp.action.micro_batch, "chunk": sp.action.chunk,
             "start": sp.start, "end": sp.end} for sp in sim.timeline]


def plan_document(plan: ParallelPlan, first_rank: int = 0) -> dict[str, Any]:
    """``hal plan --timeline``: the predicted timeline alone, each stage's time proportional to its layers
    (``first_rank``: where the plan's ranks start — a replica's)."""
    doc = _header(plan, Topology.from_plan(plan, first_rank), "layer")
    costs = layer_proportional(plan)
    doc["predicted"] = predict(doc, forward=costs["forward_s"], backward=costs["backward_s"], weight_share=0.5,
                               chunk_share=costs["chunk_share"],
                               assumes="stage time proportional to its layers, backward = 2 x forward")
    return doc


def planned_document(plan: ParallelPlan, planned: dict[str, Any]) -> dict[str, Any]:
    """``hal plan --timeline`` of a plan ``hal plan --search`` wrote: the planner's own timeline, in seconds
    (``planned``: ``planned_timeline``'s document part)."""
    doc = _header(plan, Topology.from_plan(plan), "s")
    doc["planned"] = planned
    return doc


def _header(plan: ParallelPlan, topology: Topology, unit: str) -> dict[str, Any]:
    return {"version": VERSION, "schedule": plan.schedule.name, "num_stages": plan.num_stages,
            "micro_batches": plan.micro_batches, "virtual_stages": plan.virtual_stages, "unit": unit,
            "stages": [{"stage": m.index, "backend": m.backend, "ranks": list(m.ranks)} for m in topology.stages],
            "ranks": []}


def check_document(doc: Any, where: str) -> dict[str, Any]:
    """A timeline document read back from a file: the version this code draws, else one line."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not ("predicted" in doc or "planned" in doc):
        raise HalError(f"{where}: not a version-{VERSION} timeline document; write it again with this hal")
    return doc


def planned_timeline(planned: Planned, plan: ParallelPlan) -> dict[str, Any]:
    """The planner's timeline of ``plan``: the simulator replaying the inputs the cost model played, in the
    timeline document's ``predicted`` form (``parallel.observe.timeline``), plus the step it predicted."""
    sim = simulate(plan.schedule, plan.num_stages, plan.micro_batches, **dict(planned.inputs))
    n = len(planned.estimated)
    estimated = f", {n} figure{'s' if n > 1 else ''} estimated (the plan file says which)" if n else ""
    return {"assumes": f"hal plan --search's cost model ({planned.profile or 'its profile'}), step "
                       f"{planned.step_s:.3g} s{estimated}", "estimated": list(planned.estimated),
            "forward": list(planned.inputs["forward_s"]), "backward": list(planned.inputs["backward_s"]),
            "makespan": sim.makespan, "bubble": list(sim.bubble), "spans": simulated_spans(sim), "step_s": planned.step_s}
