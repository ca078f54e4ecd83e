"""Capabilities as data: the shipped device catalog merged with what a backend probes.

Code asks "does this device have native bf16?" (``caps.is_native("bf16")``), never "is this
Ascend?". The catalog (``hal/catalog/devices.yaml``) holds datasheet facts, each with its
source; a backend's probe overrides or adds facts it can measure, and says so in ``sources``.
An unknown device model still works: it simply has probed facts only.
"""
from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Mapping

import yaml

DTYPE_KEYS: tuple[str, ...] = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8")


class DtypeSupport(str, enum.Enum):
    NATIVE = "native"  # the hardware computes in this format at its listed rate
    EMULATED = "emulated"  # accepted, but computed through another format (slow or rounded)
    ABSENT = "absent"  # not usable for compute on this device
    UNKNOWN = "unknown"  # neither the catalog nor the probe could tell

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth_gbps: float | None


@dataclass(frozen=True)
class CatalogEntry:
    """One device model from the shipped catalog (datasheet facts)."""

    id: str
    vendor: str
    model: str
    backends: tuple[str, ...]
    match: tuple[str, ...]
    memory_gb: float | None
    memory_bandwidth_gbps: float | None
    interconnect: Interconnect | None
    peak_tflops: Mapping[str, float | None]
    dtypes: Mapping[str, DtypeSupport]
    source: str
    sources: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""

    def matches(self, backend: str, device_name: str) -> bool:
        return backend in self.backends and any(re.search(p, device_name, re.IGNORECASE) for p in self.match)

    def source_of(self, key: str) -> str:
        return self.sources.get(key, self.source)


@dataclass(frozen=True)
class ProbedFacts:
    """What a backend measured on the device in hand; ``None`` means "not probed"."""

    name: str
    total_memory_bytes: int | None = None
    dtypes: Mapping[str, DtypeSupport] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. compute capability, SM count
    how: str = "probed at run time"


@dataclass(frozen=True)
class DeviceCapabilities:
    """Catalog facts for a device merged with its run-time probe."""

    backend: str
    name: str
    catalog_id: str | None
    vendor: str
    model: str
    memory_bytes: int | None
    memory_bandwidth_gbps: float | None
    interconnect: Interconnect | None
    peak_tflops: Mapping[str, float | None]
    dtypes: Mapping[str, DtypeSupport]
    sources: Mapping[str, str]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def support(self, dtype: str) -> DtypeSupport:
        if dtype not in DTYPE_KEYS:
            raise KeyError(f"unknown dtype key {dtype!r}; use one of {', '.join(DTYPE_KEYS)}")
        return self.dtypes.get(dtype, DtypeSupport.UNKNOWN)

    def is_native(self, dtype: str) -> bool:
        return self.support(dtype) is DtypeSupport.NATIVE

    def native_dtypes(self) -> list[str]:
        return [d for d in DTYPE_KEYS if self.is_native(d)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "name": self.name,
            "catalog_id": self.catalog_id,
            "vendor": self.vendor,
            "model": self.model,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
            "interconnect": None
            if self.interconnect is None
            else {"name": self.interconnect.name, "bandwidth_gbps": self.interconnect.bandwidth_gbps},
            "peak_tflops": dict(self.peak_tflops),
            "dtypes": {k: str(v) for k, v in self.dtypes.items()},
            "sources": dict(self.sources),
            "extra": {k: v for k, v in self.extra.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceCapabilities:
        """The inverse of ``to_dict`` (capabilities another process probed)."""
        link = data["interconnect"]
        return cls(backend=data["backend"], name=data["name"], catalog_id=data["catalog_id"], vendor=data["vendor"],
                   model=data["model"], memory_bytes=data["memory_bytes"],
                   memory_bandwidth_gbps=data["memory_bandwidth_gbps"],
                   interconnect=None if link is None else Interconnect(link["name"], link["bandwidth_gbps"]),
                   peak_tflops=dict(data["peak_tflops"]),
                   dtypes={k: DtypeSupport(v) for k, v in data["dtypes"].items()},
                   sources=dict(data["sources"]), extra=dict(data["extra"]))


class CatalogError(ValueError):
    """The shipped catalog is malformed (a packaging bug, caught by the tests)."""


def _number(entry_id: str, key: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(f"catalog entry {entry_id}: {key} must be a number or null, got {value!r}")
    return float(value)


def _parse_entry(raw: Mapping[str, Any]) -> CatalogEntry:
    entry_id = str(raw.get("id", "?"))
    required = ("id", "vendor", "model", "backends", "match", "peak_tflops", "dtypes", "source")
    missing = [k for k in required if k not in raw]
    if missing:
        raise CatalogError(f"catalog entry {entry_id}: missing {', '.join(missing)}")
    peaks = raw["peak_tflops"] or {}
    dtypes = raw["dtypes"] or {}
    if set(peaks) != set(DTYPE_KEYS) or set(dtypes) != set(DTYPE_KEYS):
        raise CatalogError(f"catalog entry {entry_id}: peak_tflops and dtypes need exactly the keys {DTYPE_KEYS}")
    try:
        support = {k: DtypeSupport(v) for k, v in dtypes.items()}
    except ValueError as exc:
        raise CatalogError(f"catalog entry {entry_id}: {exc}") from None
    link = raw.get("interconnect")
    for pattern in raw["match"]:
        re.compile(pattern)
    return CatalogEntry(
        id=entry_id,
        vendor=str(raw["vendor"]),
        model=str(raw["model"]),
        backends=tuple(raw["backends"]),
        match=tuple(raw["match"]),
        memory_gb=_number(entry_id, "memory_gb", raw.get("memory_gb")),
        memory_bandwidth_gbps=_number(entry_id, "memory_bandwidth_gbps", raw.get("memory_bandwidth_gbps")),
        interconnect=None
        if not link
        else Interconnect(str(link["name"]), _number(entry_id, "interconnect", link.get("bandwidth_gbps"))),
        peak_tflops={k: _number(entry_id, f"peak_tflops.{k}", v) for k, v in peaks.items()},
        dtypes=support,
        source=str(raw["source"]),
        sources={str(k): str(v) for k, v in (raw.get("sources") or {}).items()},
        notes=str(raw.get("notes") or ""),
    )


def parse_catalog(text: str) -> tuple[CatalogEntry, ...]:
    # libyaml's safe loader where PyYAML has it: every rank reads the catalog, 0.35 s in pure Python on a busy core
    data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("devices"), list):
        raise CatalogError("device catalog must be a mapping with schema: 1 and a devices list")
    entries = tuple(_parse_entry(raw) for raw in data["devices"])
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise CatalogError("device catalog has duplicate ids")
    return entries


@functools.lru_cache(maxsize=1)
def load_catalog() -> tuple[CatalogEntry, ...]:
    """The catalog shipped inside the package."""
    text = resources.files("hal").joinpath("catalog/devices.yaml").read_text(encoding="utf-8")
    return parse_catalog(text)


def lookup(backend: str, device_name: str) -> CatalogEntry | None:
    """First catalog entry (file order) whose patterns match the reported device name."""
    for entry in load_catalog():
        if entry.matches(backend, device_name):
            return entry
    return None


def merge(backend: str, entry: CatalogEntry | None, probe: ProbedFacts) -> DeviceCapabilities:
    """Catalog facts overridden by probed ones; ``sources`` says where each fact came from."""
    sources: dict[str, str] = {}
    if entry is not None:
        for key in ("memory", "memory_bandwidth_gbps", "interconnect", "peak_tflops", "dtypes"):
            sources[key] = f"catalog {entry.id}: {entry.source_of(key)}"
    dtypes: dict[str, DtypeSupport] = dict(entry.dtypes) if entry else {k: DtypeSupport.UNKNOWN for k in DTYPE_KEYS}
    for key, value in probe.dtypes.items():
        if dtypes.get(key) != value:
            sources[f"dtypes.{key}"] = probe.how
        dtypes[key] = value
    memory = probe.total_memory_bytes
    if memory is not None:
        sources["memory"] = probe.how
    elif entry is not None and entry.memory_gb is not None:
        memory = int(entry.memory_gb * 1e9)
    return DeviceCapabilities(
        backend=backend,
        name=probe.name,
        catalog_id=entry.id if entry else None,
        vendor=entry.vendor if entry else "unknown",
        model=entry.model if entry else probe.name,
        memory_bytes=memory,
        memory_bandwidth_gbps=entry.memory_bandwidth_gbps if entry else None,
        interconnect=entry.interconnect if entry else None,
        peak_tflops=dict(entry.peak_tflops) if entry else {k: None for k in DTYPE_KEYS},
        dtypes=dtypes,
        sources=sources,
        extra=dict(probe.extra),
    )
