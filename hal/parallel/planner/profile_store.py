"""Reading a profile file: ``load_profile`` refuses, in one line naming the key, a file that is not one.

Why apart from ``profile``: the profile's types say what the cost model reads; this module says what a file
must hold before any of it is believed — a file of any size, any nesting and any number reaches it (a
hand-edited profile, a truncated copy, a device path), and each has to be one ``ConfigError`` line.
"""
from __future__ import annotations

import json
import math
import os
import reprlib
import stat
from typing import Any, Callable, Mapping, NamedTuple, NoReturn

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.planner.device_profile import ESTIMATED, MEASURED, SCHEMA, DeviceProfile, LayerPoint, LinkProfile, PerToken, Profile, model_key
from hal.run_dirs import read_at_most

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
    try:
        raw = read_at_most(path, MAX_PROFILE_BYTES)
    except OSError as exc:
        raise ConfigError(f"--profile {path}: cannot read it ({exc.strerror}); run hal profile --config F --out {path}") from None
    if raw is None:
        raise ConfigError(f"--profile {path}: larger than {MAX_PROFILE_BYTES >> 20} MiB, the most a profile may be (hal "
                          "profile writes a few KB to a few hundred KB); give the JSON file hal profile --out wrote")

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
_FRACTION = _Rule(_between(0.0, 1.0), "a fraction between 0 and 1")
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
_PER_TOKEN_RULES = {"forward_s": _SECONDS, "backward_s": _SECONDS, "activation_bytes": _BYTES, "transient_bytes": _BYTES,
                    "fixed_bytes": _BYTES}
_DEVICE_RULES = {"device": _TEXT, "backend": _TEXT, "source": _SOURCE, "basis": _TEXT, "optimizer_s_per_param": _SECONDS,
                 "threads": _nullable(_COUNT), "achieved_tflops": _nullable(_FIGURE), "efficiency": _nullable(_FIGURE),
                 "action_host_s": _nullable(_SECONDS), "weight_share": _nullable(_FRACTION)}
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
        for part in ("embedding", "head", "fused_head"):
            if part in data and not (part == "fused_head" and data[part] is None):  # null: not measured
                parts[part] = self.per_token(f"{where}.{part}", data[part])
        for part, columns in (("contention", _CONTENTION), ("tp_all_reduce", _TP_ALL_REDUCE)):
            if part in data:
                parts[part] = self.table(f"{where}.{part}", data[part], columns)
        if data.get("split_cost") is not None:
            cost = data["split_cost"]
            if not isinstance(cost, list) or len(cost) != 2:
                self.fail(f"{where}.split_cost", f"must be a list of 2 numbers (host, device) or null (got {_shown(cost)})")
            for j, v in enumerate(cost):
                self.value(f"{where}.split_cost[{j}]", v, _POSITIVE)
            parts["split_cost"] = (float(cost[0]), float(cost[1]))
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
