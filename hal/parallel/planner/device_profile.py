"""A device profile: what one decoder layer, the embedding, the head and the optimizer cost on each device type.

Why a file: measuring takes time and a cluster is planned many times; the cost model reads numbers,
not devices. A profile is stamped with the model shape and the precision it was measured for, and one
made for another model or precision is refused in one line (its numbers would mean nothing;
``profile_file.load_profile`` reads and checks a file).

Every number carries where it comes from: a device type is ``measured`` (``hal profile`` on this host,
``parallel.planner.measure``) or ``estimated`` (from the catalog, ``parallel.planner.estimate``), and
every report that uses an estimated number says so. Layer points are per dp replica: ``rows`` rows of
``seq`` tokens through one layer at tensor-parallel degree ``tp``; ``lookup`` fits time = a + b × rows
over the points measured, so the cost model can ask for any row count.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from hal.errors import ConfigError
from hal.run_dirs import write_text_atomic

SCHEMA = 1
MEASURED, ESTIMATED = "measured", "estimated"


@dataclass(frozen=True)
class LayerPoint:
    """One decoder layer, one micro-batch slice: ``rows`` × ``seq`` tokens at ``tp``, recompute on or off."""

    tp: int
    rows: int
    seq: int
    recompute: bool
    forward_s: float
    backward_s: float  # with recompute: includes the layer's second forward
    activation_bytes: int  # saved for backward by one layer for one micro-batch (recompute: its input only)
    # An accelerator's two clocks (None on the cpu, whose host is the device): the host's time to enqueue one
    # call, and the device's time to run it with its queue kept full. A run is bound by the slower of the two.
    host_forward_s: float | None = None
    host_backward_s: float | None = None
    device_forward_s: float | None = None
    device_backward_s: float | None = None
    # Measured at tp > 1 with its group present (``measure.measure_tp_layers``): the times include the layer's tp
    # collectives (their device time and their host cost), under sequence parallelism when ``sp``.
    sp: bool = False


@dataclass(frozen=True)
class PerToken:
    """A part whose cost grows with the tokens it sees (embedding; norm + head + loss)."""

    forward_s: float
    backward_s: float
    activation_bytes: int  # saved for backward, per token
    # accelerators: what its forward + backward holds at the peak beyond what it saves, per token — the head's
    # logits gradient and the loss's fp32 copies live only then, once, on top of the in-flight activations
    transient_bytes: int = 0
    # saved for backward by one micro-batch whatever its token count: the fused head's weight gradient, which it
    # forms in its forward (the logits are gone by the backward)
    fixed_bytes: int = 0

    def saved_bytes(self, tokens: int) -> float:
        """Bytes one micro-batch of ``tokens`` tokens keeps for backward."""
        return tokens * self.activation_bytes + self.fixed_bytes


@dataclass(frozen=True)
class DeviceProfile:
    """One device type's costs; ``source`` is measured or estimated, ``basis`` says how."""

    device: str  # catalog id
    backend: str
    source: str
    basis: str
    layers: tuple[LayerPoint, ...]
    embedding: PerToken
    head: PerToken  # final norm, LM head and the loss
    optimizer_s_per_param: float
    threads: int | None = None  # cpu: compute threads per rank while measured
    achieved_tflops: float | None = None  # a layer's forward + backward FLOPs over its time (largest point)
    efficiency: float | None = None  # achieved / catalog peak, where the catalog has a peak
    # the final norm and the head fused with the loss (``parallel.fused_head``: no full logits); None in a profile
    # written before it was measured — a fused-head plan is then priced with ``head``, and the reports say so
    fused_head: PerToken | None = None
    # cpu: (node occupancy, slowdown, seconds of wait each action adds) measured by calibration pipelines
    # (``planner.calibrate``; a profile written before the wait was measured has two columns: no wait)
    contention: tuple[tuple[float, ...], ...] = ()
    # cpu: (node occupancy, seconds one tp all-reduce inside a layer costs, seconds one sequence-parallel exchange
    # costs), calibrated (``planner.calibrate``; a profile from before sp was calibrated has the first two only)
    tp_all_reduce: tuple[tuple[float, ...], ...] = ()
    # accelerators: the engine's own host seconds per compute action (its P2P posts and bookkeeping included), beyond
    # the layers' enqueue time, calibrated on a pipeline of this device (``planner.calibrate.calibrate_host``)
    action_host_s: float | None = None
    # the share of a layer's backward its weight half ``W`` takes under the zero-bubble split (largest row count,
    # recompute off, compiled where the profile compiles); None in a profile written before it was measured (the
    # cost model then assumes half, as the unit-time play does, and says so)
    weight_share: float | None = None
    # (host, device) time of a layer's split program (forward and backward with the linears split, as the zero-bubble
    # schedules run it: a compiled layer breaks its graphs at each linear) over the whole layer's, same rows (the
    # largest, recompute off); a cpu's one wall clock in both; None in a profile from before it was measured
    split_cost: tuple[float, float] | None = None

    @property
    def estimated(self) -> bool:
        return self.source == ESTIMATED

    def stretch(self, occupancy: float) -> float | None:
        """How much slower this device computes in a run whose node is ``occupancy`` busy (busy share × ranks ×
        threads / cores), from the calibration points; None when the profile has none (the cost model then
        assumes max(1, occupancy))."""
        return self._contended(occupancy, 1, 1.0)

    def action_wait_s(self, occupancy: float) -> float:
        """Seconds each compute action waits on a node ``occupancy`` busy (a hand-off's partner being scheduled);
        0 without calibration or where the profile predates the measurement."""
        if not self.contention or any(len(p) < 3 for p in self.contention):
            return 0.0
        return self._contended(occupancy, 2, 0.0) or 0.0

    def tp_all_reduce_s(self, occupancy: float) -> float | None:
        """Seconds one tp all-reduce inside a layer costs on a node ``occupancy`` busy; None without calibration."""
        return self._contended(occupancy, 1, 0.0, self.tp_all_reduce)

    def sp_exchange_s(self, occupancy: float) -> float | None:
        """Seconds one sequence-parallel exchange (all-gather or reduce-scatter) inside a layer costs on a node
        ``occupancy`` busy; None without that calibration."""
        if not self.tp_all_reduce or any(len(p) < 3 for p in self.tp_all_reduce):
            return None
        return self._contended(occupancy, 2, 0.0, self.tp_all_reduce)

    def _contended(self, occupancy: float, column: int, floor: float, table: Any = None) -> float | None:
        """Column ``column`` of the calibration points at ``occupancy``: linear between points and beyond the last."""
        rows = self.contention if table is None else table
        if not rows:
            return None
        pts = sorted((p[0], p[column]) for p in rows)  # the first: one rank alone on the node
        if occupancy <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if occupancy <= x1 or (x1, y1) == pts[-1]:
                slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
                return max(floor, y0 + slope * (occupancy - x0))
        return pts[-1][1]

    def threads_or_one(self) -> int:
        """Cores one rank keeps busy while it computes (cpu: the threads it was measured with)."""
        return self.threads or 1

    def has_tp_points(self, tp: int, sp: bool = False) -> bool:
        """Whether layers were measured at this tp (and sp) with the group present: their times include tp's
        collectives, which the cost model then does not add again."""
        return tp > 1 and any(p.tp == tp and p.sp == sp and not p.recompute for p in self.layers)

    def layer(self, tp: int, rows: int, seq: int, recompute: bool, sp: bool = False) -> tuple[float, float, float]:
        """(forward s, backward s, activation bytes) of one layer for ``rows`` rows of ``seq`` tokens.

        From the points at this (tp, recompute) and the nearest sequence length (time and memory scaled
        by tokens when the length differs); a straight line a + b × rows through them. tp degrees not
        measured come from tp 1 at rows / tp (the work splits, the per-call overhead does not; the cost
        model adds tp's communication). Points measured at this tp and sp (``has_tp_points``) are used as
        they are.
        """
        sp = sp and tp > 1
        if recompute and self._has(tp, False, sp):
            # Recompute's times follow from the plain layer's: the checkpointed forward is the plain forward, and
            # its backward re-runs that forward before the plain backward. Measured directly, the recompute
            # points carry an extra forward's worth of noise (a 2-core host: +37 % on one forward of the
            # planner-accuracy profile), so they give the activation bytes only — what recompute changes.
            fwd, bwd, _ = self._fit(tp, rows, seq, False, sp)
            act = self._fit(tp, rows, seq, True, sp)[2] if self._has(tp, True, sp) else 0.0
            return fwd, fwd + bwd, act
        return self._fit(tp, rows, seq, recompute, sp)

    def clocks(self, tp: int, rows: int, seq: int, recompute: bool, sp: bool = False) -> tuple[float, float, float, float] | None:
        """(host forward, host backward, device forward, device backward) seconds of one layer call, where the
        profile measured an accelerator's two clocks; None otherwise.

        The host's enqueue time does not depend on the rows (the same kernels are launched), and a tp-split
        layer launches as many as tp 1, so the host side is the points' median; the device side follows
        ``layer``'s rule (tp 1 at rows / tp). Points measured at this tp and sp are read as they are: their
        host side includes enqueuing the collectives, their device side running them. Recompute: forward +
        backward again, as ``layer``."""
        sp = sp and tp > 1
        split = 1
        plain = [p for p in self.layers if not p.recompute and p.tp == tp and p.sp == sp
                 and p.host_forward_s is not None and p.device_forward_s is not None]
        if not plain:
            split = tp
            plain = [p for p in self.layers if not p.recompute and p.tp == 1 and p.host_forward_s is not None
                     and p.device_forward_s is not None]
        if not plain:
            return None
        near = min({p.seq for p in plain}, key=lambda s: abs(s - seq))
        pts = sorted((p for p in plain if p.seq == near), key=lambda p: p.rows)
        xs = [p.rows * seq / near for p in pts]

        def at(field: str, x: float) -> float:
            return max(_fit(xs, [float(getattr(p, field)) for p in pts], x), 0.0)

        # the host launches the same kernels whatever the rows: its time is one number, the points' median (a line
        # through three noisy millisecond readings swings by tens of percent at the ends)
        hf = statistics.median(float(p.host_forward_s) for p in pts)  # type: ignore[arg-type]
        hb = statistics.median(float(p.host_backward_s) for p in pts)  # type: ignore[arg-type]
        df, db = at("device_forward_s", rows / split), at("device_backward_s", rows / split)
        return (hf, hf + hb, df, df + db) if recompute else (hf, hb, df, db)

    def _has(self, tp: int, recompute: bool, sp: bool = False) -> bool:
        """Whether points at this recompute setting exist (at ``tp`` and ``sp``, or at tp 1 to split)."""
        return any(p.recompute == recompute and ((p.tp == tp and p.sp == sp) or p.tp == 1) for p in self.layers)

    def _fit(self, tp: int, rows: int, seq: int, recompute: bool, sp: bool = False) -> tuple[float, float, float]:
        """(forward s, backward s, activation bytes) from the measured points at this recompute setting."""
        pts = [p for p in self.layers if p.recompute == recompute and p.tp == tp and p.sp == sp]
        x = float(rows)
        if not pts:  # a tp-split layer does 1/tp of the work of tp 1 at the same per-call overhead: tp 1 at rows / tp
            pts, x = [p for p in self.layers if p.recompute == recompute and p.tp == 1], rows / tp
        if not pts:
            raise ConfigError(f"profile of {self.device}: no layer measured with recompute {'on' if recompute else 'off'}; "
                              "run hal profile again")
        near = min({p.seq for p in pts}, key=lambda s: abs(s - seq))
        pts = sorted((p for p in pts if p.seq == near), key=lambda p: p.rows)
        scale = seq / near
        xs = [p.rows * scale for p in pts]
        fwd, bwd, act = (max(_fit(xs, [float(getattr(p, v)) for p in pts], x), 0.0)
                         for v in ("forward_s", "backward_s", "activation_bytes"))
        return fwd, bwd, act

    def head_for(self, fused: bool) -> PerToken:
        """The last stage's head as the plan runs it: fused with the loss where it is and that was measured."""
        return self.fused_head if fused and self.fused_head is not None else self.head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> DeviceProfile:
        fused = data.get("fused_head")
        return DeviceProfile(**{**data, "layers": tuple(LayerPoint(**p) for p in data["layers"]),
                                "embedding": PerToken(**data["embedding"]), "head": PerToken(**data["head"]),
                                "fused_head": PerToken(**fused) if fused is not None else None,
                                "contention": tuple(tuple(map(float, p)) for p in data.get("contention", ())),
                                "tp_all_reduce": tuple(tuple(map(float, p)) for p in data.get("tp_all_reduce", ())),
                                "split_cost": tuple(map(float, data["split_cost"])) if data.get("split_cost") else None})


def _fit(xs: list[float], ys: list[float], x: float) -> float:
    """Least squares a + b·x through the points at ``x``; one point (or one x): proportional to x."""
    if len(xs) == 1 or len(set(xs)) == 1:
        return ys[0] * x / xs[0]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((a - mx) * (c - my) for a, c in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    return (my - b * mx) + b * x


@dataclass(frozen=True)
class LinkProfile:
    """A point-to-point link measured (or defaulted): inside one island, or across the bridge."""

    kind: str  # island | bridge
    backend: str
    bandwidth_gbps: float
    latency_us: float
    source: str
    basis: str = ""
    # seconds of a collective between two ranks ({op: (at loaded_sizes)}): on an island a dp-sync collective while every
    # pair of the node runs one (``measure.measure_node_links``); on the bridge its all-reduce, as the replicas' exchange
    # sums its buckets (``measure.link_rank``); empty where not measured
    loaded_collectives: dict[str, tuple[float, float]] = field(default_factory=dict)
    loaded_sizes: tuple[int, int] = (0, 0)

    def collective_s(self, op: str, nbytes: float, ranks: int) -> float | None:
        """Seconds of ``op`` over ``nbytes`` (the whole buffer) among ``ranks`` ranks of a loaded node, from the two
        measured sizes between two ranks: latency + bytes × seconds per byte, the bytes part scaled by the ring's
        2(n−1)/n (1 at n = 2) and the latency part by n − 1; None where not measured."""
        times = self.loaded_collectives.get(op)
        if times is None or ranks <= 1:
            return None if times is None else 0.0
        (small, large), (t_small, t_large) = self.loaded_sizes, times
        per_byte = max(0.0, (t_large - t_small) / (large - small)) if large > small else 0.0
        latency = max(0.0, t_small - small * per_byte)
        return latency * (ranks - 1) + nbytes * per_byte * 2 * (ranks - 1) / ranks


@dataclass
class Profile:
    """Every device type's costs for one model shape and precision, and the links measured."""

    model: dict[str, Any]
    precision: str
    devices: dict[str, DeviceProfile]
    links: dict[str, LinkProfile] = field(default_factory=dict)
    seq: int = 0  # the sequence length the layers were measured at
    meta: dict[str, Any] = field(default_factory=dict)  # torch version, host, when, how long

    @property
    def model_key(self) -> str:
        return model_key(self.model)

    def estimated(self) -> list[str]:
        """Device types whose numbers are estimates (said in every report that uses them)."""
        return [d for d, p in self.devices.items() if p.estimated]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "model": self.model, "model_key": self.model_key, "precision": self.precision,
                "seq": self.seq, "devices": {k: v.to_dict() for k, v in self.devices.items()},
                "links": {k: asdict(v) for k, v in self.links.items()}, "estimated": self.estimated(), "meta": self.meta}

    def save(self, path: str | os.PathLike[str]) -> None:
        """The profile as JSON, written whole or not at all."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def model_key(model: Mapping[str, Any]) -> str:
    """A short digest of the model shape (every key but the sequence length, which points carry)."""
    shape = {k: v for k, v in sorted(model.items()) if k not in ("max_seq_len", "rope_theta", "rope_scaling", "norm_eps")}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
