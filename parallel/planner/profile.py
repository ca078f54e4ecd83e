"""A device profile: what one decoder layer, the embedding, the head and the optimizer cost on each device type.

Why a file: measuring takes time and a cluster is planned many times; the cost model reads numbers,
not devices. A profile is stamped with the model shape and the precision it was measured for, and one
made for another model or precision is refused in one line (its numbers would mean nothing).

Every number carries where it comes from: a device type is ``measured`` (``hal profile`` on this host,
``parallel.planner.measure``) or ``estimated`` (from the catalog, ``parallel.planner.estimate``), and
every report that uses an estimated number says so. Layer points are per dp replica: ``rows`` rows of
``seq`` tokens through one layer at tensor-parallel degree ``tp``; ``lookup`` fits time = a + b × rows
over the points measured, so the cost model can ask for any row count.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import reprlib
import stat
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, NoReturn

from hal.errors import ConfigError
from hal.run_dirs import write_text_atomic

from ..model_config import ModelConfig

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
    # cpu: (node occupancy, slowdown, seconds of wait each action adds) measured by calibration pipelines
    # (``planner.calibrate``; a profile written before the wait was measured has two columns: no wait)
    contention: tuple[tuple[float, ...], ...] = ()
    # cpu: (node occupancy, seconds one tp all-reduce inside a layer costs, seconds one sequence-parallel exchange
    # costs), calibrated (``planner.calibrate``; a profile from before sp was calibrated has the first two only)
    tp_all_reduce: tuple[tuple[float, ...], ...] = ()
    # accelerators: the engine's own host seconds per compute action (its P2P posts and bookkeeping included), beyond
    # the layers' enqueue time, calibrated on a pipeline of this device (``planner.calibrate.calibrate_host``)
    action_host_s: float | None = None

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "DeviceProfile":
        return DeviceProfile(**{**data, "layers": tuple(LayerPoint(**p) for p in data["layers"]),
                                "embedding": PerToken(**data["embedding"]), "head": PerToken(**data["head"]),
                                "contention": tuple(tuple(map(float, p)) for p in data.get("contention", ())),
                                "tp_all_reduce": tuple(tuple(map(float, p)) for p in data.get("tp_all_reduce", ()))})


def _fit(xs: list[float], ys: list[float], x: float) -> float:
    """Least squares a + b·x through the points at ``x``; one point (or one x): proportional to x."""
    if len(xs) == 1 or len(set(xs)) == 1:
        return ys[0] * x / xs[0]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
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
    # seconds of a dp-sync collective between two ranks while every pair of the node runs one ({op: (at LINK_SIZES)}),
    # measured on the island (``measure.measure_loaded_collectives``); empty where not measured
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


# A profile as ``hal profile`` writes it is a few KB to a few hundred KB; anything past these bounds is not one, and is
# refused before it is read (a device or a sparse file would otherwise be read whole into memory) or used (a count or
# a time this large overflows the cost model's floats, a list this long slows every prediction of a search).
MAX_PROFILE_BYTES = 16 << 20  # 16 MiB
MAX_ENTRIES = 4096  # devices, links, layer points, calibration points
MAX_KEY = 200  # characters of a device type, link or collective name
MAX_COUNT = 1 << 20  # tp, rows, seq, threads
MAX_BYTES = 1 << 53  # activation bytes, link sizes: exact as floats
MAX_SECONDS = 86_400.0  # one layer call, one token, one parameter: a day is already absurd
MAX_FIGURE = 1e12  # GB/s, TFLOP/s, occupancy, slowdown, efficiency


def load_profile(path: str | os.PathLike[str], model: ModelConfig, precision: str) -> Profile:
    """Read ``path`` and refuse it in one line unless it was made for ``model`` at ``precision`` and every number in it
    is one the cost model can use (each refusal names the key, as ``devices.cpu-generic.layers[3].forward_s``)."""
    data = _read(path)
    if not isinstance(data, dict) or type(data.get("schema")) is not int or data["schema"] != SCHEMA:
        raise ConfigError(f"--profile {path}: not a hal profile of schema {SCHEMA}; run hal profile again")
    check = _Checker(path)
    for key, kind in (("model", dict), ("model_key", str), ("precision", str), ("devices", dict)):
        if key not in data:
            check.fail(key, "missing")
        if not isinstance(data[key], kind):
            check.fail(key, f"must be {'an object' if kind is dict else 'a string'} (got {_shown(data[key])})")
    want = model_key(model.to_dict())
    if data["model_key"] != want:
        differ = [k for k, v in model.to_dict().items() if data["model"].get(k) != v and k != "max_seq_len"]
        raise ConfigError(f"--profile {path}: measured for another model (differs in {', '.join(differ) or 'shape'}); "
                          "run hal profile with this config")
    if data["precision"] != precision:
        said = data["precision"] if len(data["precision"]) <= 40 else _shown(data["precision"])
        raise ConfigError(f"--profile {path}: measured at precision {said}, the config trains {precision}; "
                          "run hal profile with this config")
    links, meta = data.get("links", {}), data.get("meta", {})
    check.value("links", links, _OBJECT)
    check.value("meta", meta, _OBJECT)
    if "seq" in data:
        check.value("seq", data["seq"], _COUNT)
    devices = {k: check.device(f"devices.{k}", k, v) for k, v in check.entries("devices", data["devices"])}
    return Profile(data["model"], data["precision"], devices,
                   {k: check.link(f"links.{k}", v) for k, v in check.entries("links", links)}, data.get("seq", 0), meta)


def _read(path: str | os.PathLike[str]) -> Any:
    """The JSON at ``path``: a regular file of at most MAX_PROFILE_BYTES (stat first: nothing is read otherwise),
    UTF-8, without NaN or Infinity (Python's json reads those; a profile never holds them)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"--profile {path}: cannot read it ({exc.strerror}); run hal profile --config F --out {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--profile {path}: not a regular file; give the JSON file hal profile --out wrote")
    too_big = (f"--profile {path}: larger than {MAX_PROFILE_BYTES >> 20} MiB, the most a profile may be (hal profile writes "
               "a few KB to a few hundred KB); give the JSON file hal profile --out wrote")
    if st.st_size > MAX_PROFILE_BYTES:
        raise ConfigError(too_big)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PROFILE_BYTES + 1)  # a file grown since the stat is still read only this far
    except OSError as exc:
        raise ConfigError(f"--profile {path}: cannot read it ({exc.strerror}); run hal profile --config F --out {path}") from None
    if len(raw) > MAX_PROFILE_BYTES:
        raise ConfigError(too_big)

    def no_constant(name: str) -> Any:
        raise ConfigError(f"--profile {path}: not a profile ({name} is not a JSON number); run hal profile again")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--profile {path}: not a profile (not UTF-8 text at byte {exc.start}); run hal profile again") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--profile {path}: not a profile (invalid JSON at line {exc.lineno}); run hal profile again") from None
    except RecursionError:
        raise ConfigError(f"--profile {path}: not a profile (JSON nested too deeply); run hal profile again") from None
    except ValueError:  # an integer of more digits than Python converts
        raise ConfigError(f"--profile {path}: not a profile (a number of too many digits); run hal profile again") from None


class _Rule(NamedTuple):
    """What a value must be: ``ok`` tests it, ``says`` words the requirement for the refusal."""

    ok: Callable[[Any], bool]
    says: str


def _finite(v: Any) -> float | None:
    """``v`` as a float where it is a JSON number (a bool is not) and finite; None otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float
        return None
    return f if math.isfinite(f) else None


def _between(lo: float, hi: float, *, above: bool = False) -> Callable[[Any], bool]:
    """A finite number in [lo, hi] (``above``: lo excluded, for the values the cost model divides by)."""
    def ok(v: Any) -> bool:
        f = _finite(v)
        return f is not None and (f > lo if above else f >= lo) and f <= hi
    return ok


def _integer(lo: int, hi: int) -> Callable[[Any], bool]:
    """An int in [lo, hi]: not a bool, not 2.0 (a count or a byte size is whole)."""
    return lambda v: type(v) is int and lo <= v <= hi


def _nullable(rule: _Rule) -> _Rule:
    """``rule`` or None (the fields a device type may lack: the cpu's clocks, an accelerator's threads)."""
    return _Rule(lambda v: v is None or rule.ok(v), rule.says + " or null")


_SECONDS = _Rule(_between(0.0, MAX_SECONDS), f"a finite number of seconds >= 0 and <= {MAX_SECONDS:g}")
_FIGURE = _Rule(_between(0.0, MAX_FIGURE), f"a finite number >= 0 and <= {MAX_FIGURE:g}")
_POSITIVE = _Rule(_between(0.0, MAX_FIGURE, above=True), f"a finite number > 0 and <= {MAX_FIGURE:g}")  # a divisor
_COUNT = _Rule(_integer(1, MAX_COUNT), f"an integer >= 1 and <= {MAX_COUNT}")  # a divisor
_BYTES = _Rule(_integer(0, MAX_BYTES), "an integer >= 0 and <= 2**53")
_BOOL = _Rule(lambda v: isinstance(v, bool), "true or false")
_TEXT = _Rule(lambda v: isinstance(v, str), "a string")
_OBJECT = _Rule(lambda v: isinstance(v, dict), "an object")
_SOURCE = _Rule(lambda v: v in (MEASURED, ESTIMATED), f"{MEASURED!r} or {ESTIMATED!r}")

_LAYER_RULES = {"tp": _COUNT, "rows": _COUNT, "seq": _COUNT, "recompute": _BOOL, "forward_s": _SECONDS,
                "backward_s": _SECONDS, "activation_bytes": _BYTES, "host_forward_s": _nullable(_SECONDS),
                "host_backward_s": _nullable(_SECONDS), "device_forward_s": _nullable(_SECONDS),
                "device_backward_s": _nullable(_SECONDS), "sp": _BOOL}
_CLOCKS = ("host_forward_s", "host_backward_s", "device_forward_s", "device_backward_s")
_PER_TOKEN_RULES = {"forward_s": _SECONDS, "backward_s": _SECONDS, "activation_bytes": _BYTES, "transient_bytes": _BYTES}
_DEVICE_RULES = {"device": _TEXT, "backend": _TEXT, "source": _SOURCE, "basis": _TEXT, "optimizer_s_per_param": _SECONDS,
                 "threads": _nullable(_COUNT), "achieved_tflops": _nullable(_FIGURE), "efficiency": _nullable(_FIGURE),
                 "action_host_s": _nullable(_SECONDS)}
_LINK_RULES = {"kind": _TEXT, "backend": _TEXT, "bandwidth_gbps": _POSITIVE, "latency_us": _FIGURE, "source": _TEXT,
               "basis": _TEXT}
# calibration tables, row by row as DeviceProfile._contended reads them: occupancy, then the columns it interpolates
_CONTENTION = (_FIGURE, _POSITIVE, _SECONDS)  # occupancy, slowdown (a 0 would make every computation free), wait s
_TP_ALL_REDUCE = (_FIGURE, _SECONDS, _SECONDS)  # occupancy, all-reduce s, sp exchange s


class _Checker:
    """Checks one profile's parts against the rules above and builds them; each failure is one ConfigError line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> NoReturn:
        raise ConfigError(f"--profile {self.path}: {where}: {problem}; run hal profile again")

    def value(self, where: str, v: Any, rule: _Rule) -> None:
        if not rule.ok(v):
            self.fail(where, f"must be {rule.says} (got {_shown(v)})")

    def fields(self, where: str, data: Any, rules: Mapping[str, _Rule]) -> None:
        """``data`` is an object and each of its keys that has a rule keeps it (missing and unknown keys: ``build``)."""
        self.value(where, data, _OBJECT)
        for key, rule in rules.items():
            if key in data:
                self.value(f"{where}.{key}", data[key], rule)

    def entries(self, where: str, data: dict[str, Any]) -> list[tuple[str, Any]]:
        """An object's (key, value) pairs, few, under short keys (each key is quoted in any later refusal)."""
        if len(data) > MAX_ENTRIES:
            self.fail(where, f"{len(data)} entries, more than the {MAX_ENTRIES} a profile may have")
        for key in data:
            if len(key) > MAX_KEY:
                self.fail(where, f"a key of {len(key)} characters ({_shown(key)}), more than the {MAX_KEY} a profile uses")
        return list(data.items())

    def items(self, where: str, data: Any) -> list[Any]:
        if not isinstance(data, list):
            self.fail(where, f"must be a list (got {_shown(data)})")
        if len(data) > MAX_ENTRIES:
            self.fail(where, f"{len(data)} entries, more than the {MAX_ENTRIES} a profile may have")
        return data

    def build(self, where: str, cls: Callable[..., Any], data: Mapping[str, Any]) -> Any:
        """``cls(**data)``: a missing or unknown key is said as the damage it is."""
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"--profile {self.path}: a damaged profile (TypeError: {where}: {exc}); run hal profile again") from None

    def table(self, where: str, data: Any, columns: tuple[_Rule, ...]) -> tuple[tuple[float, ...], ...]:
        """A calibration table: rows of 2 or 3 numbers (a profile from before the third column was measured has 2)."""
        rows = []
        for i, row in enumerate(self.items(where, data)):
            if not isinstance(row, list) or len(row) not in (2, 3):
                self.fail(f"{where}[{i}]", f"must be a list of 2 or 3 numbers (got {_shown(row)})")
            for j, v in enumerate(row):
                self.value(f"{where}[{i}][{j}]", v, columns[j])
            rows.append(tuple(float(v) for v in row))
        return tuple(rows)

    def layer(self, where: str, data: Any) -> LayerPoint:
        self.fields(where, data, _LAYER_RULES)
        if len({data.get(k) is None for k in _CLOCKS}) > 1:  # DeviceProfile.clocks reads the four together
            self.fail(where, f"{', '.join(_CLOCKS)} must be all numbers or all null")
        return self.build(where, LayerPoint, data)

    def per_token(self, where: str, data: Any) -> PerToken:
        self.fields(where, data, _PER_TOKEN_RULES)
        return self.build(where, PerToken, data)

    def device(self, where: str, key: str, data: Any) -> DeviceProfile:
        self.fields(where, data, _DEVICE_RULES)
        if "device" in data and data["device"] != key:
            self.fail(f"{where}.device", f"names {_shown(data['device'])}, not the device type {key!r} it is filed under")
        parts: dict[str, Any] = {}
        if "layers" in data:
            points = self.items(f"{where}.layers", data["layers"])
            parts["layers"] = tuple(self.layer(f"{where}.layers[{i}]", p) for i, p in enumerate(points))
        for part in ("embedding", "head"):
            if part in data:
                parts[part] = self.per_token(f"{where}.{part}", data[part])
        for part, columns in (("contention", _CONTENTION), ("tp_all_reduce", _TP_ALL_REDUCE)):
            if part in data:
                parts[part] = self.table(f"{where}.{part}", data[part], columns)
        return self.build(where, DeviceProfile, {**data, **parts})

    def link(self, where: str, data: Any) -> LinkProfile:
        self.fields(where, data, _LINK_RULES)
        parts: dict[str, Any] = {}
        if "loaded_collectives" in data:
            self.value(f"{where}.loaded_collectives", data["loaded_collectives"], _OBJECT)
            collectives = {}
            for op, times in self.entries(f"{where}.loaded_collectives", data["loaded_collectives"]):
                if not isinstance(times, list) or len(times) != 2:
                    self.fail(f"{where}.loaded_collectives.{op}", f"must be a list of 2 numbers (got {_shown(times)})")
                for j, v in enumerate(times):
                    self.value(f"{where}.loaded_collectives.{op}[{j}]", v, _SECONDS)
                collectives[op] = (float(times[0]), float(times[1]))
            parts["loaded_collectives"] = collectives
        if "loaded_sizes" in data:
            sizes = data["loaded_sizes"]
            if not isinstance(sizes, list) or len(sizes) != 2:
                self.fail(f"{where}.loaded_sizes", f"must be a list of 2 integers (got {_shown(sizes)})")
            for j, v in enumerate(sizes):
                self.value(f"{where}.loaded_sizes[{j}]", v, _BYTES)
            parts["loaded_sizes"] = tuple(sizes)
        return self.build(where, LinkProfile, {**data, **parts})


def _shown(v: Any) -> str:
    """A value as the refusal quotes it: short (a damaged file may hold a long string or a deep list)."""
    text = reprlib.repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
