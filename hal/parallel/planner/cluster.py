"""The cluster a plan is made for: groups of devices (declared, or probed on this host) and the links between them.

Why a declaration: a user plans a cluster before owning it. The ``cluster:`` section (in the run config,
or a file of its own given by ``--cluster C``) lists groups of devices by catalog id and the links:

    cluster:
      groups:
        - {backend: cuda, device: nvidia-h100-sxm, count: 8, node: 0}
        - {backend: ascend, device: huawei-ascend-910b, count: 8, node: 1,
           peak_tflops: {bf16: 313}, memory_gb: 64, memory_bandwidth_gbps: 1600}   # figures the catalog lacks
        - {backend: cpu, device: cpu-generic, count: 4, node: 2, cores: 2}        # 4 cpu ranks sharing 2 cores
      links:                      # every key optional; the defaults below
        intra_node_gbps: null     # null: each device's catalog interconnect, halved (the catalog prints both directions)
        intra_node_latency_us: 10
        inter_node_gbps: 25       # one 200 Gb/s NIC per device (InfiniBand HDR), a common data-centre figure
        inter_node_latency_us: 10
        bridge_gbps: 10           # between islands of different backends: device -> host -> wire -> host -> device
        bridge_latency_us: 100

A group's figures come from the catalog (``hal/catalog/devices.yaml``); a group may declare the ones
the catalog lacks (Huawei and Cambricon publish few), and every figure keeps its source ("catalog",
"declared", "default", later "measured") so reports can say what each number rests on. Without a
section, ``probe_cluster`` lists the devices present, as ``hal devices`` does. Every problem is one
``ConfigError`` line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from hal.capabilities import DTYPE_KEYS, CatalogEntry, load_catalog
from hal.config import limits
from hal.config.schema import Custom, ListOf, NonNegativeInt, Nullable, Number, PositiveInt, did_you_mean, key, parse_section, require_mapping
from hal.errors import ConfigError

# Documented defaults where neither the catalog nor the user gives a figure (GB/s one direction, µs).
DEFAULT_INTER_NODE_GBPS = 25.0  # 200 Gb/s InfiniBand HDR per device
DEFAULT_INTER_NODE_LATENCY_US = 10.0
DEFAULT_INTRA_NODE_LATENCY_US = 10.0
DEFAULT_BRIDGE_GBPS = 10.0  # host-staged copy + one TCP/RDMA hop between different vendors' islands
DEFAULT_BRIDGE_LATENCY_US = 100.0
# What a declared figure may be: physics, with room on both sides. A wire slower than 1 MB/s or a device link faster
# than 100 TB/s, a latency above 10 s, memory under 1 MB or above 100 TB a device, HBM faster than 1 PB/s, or a
# device below 1 GFLOP/s or above 100 PFLOP/s is a typo (or a unit mistake), never hardware.
LINK_GBPS = Number(positive=True, minimum=1e-3, maximum=1e5, unit="GB/s")
LATENCY_US = Number(positive=False, maximum=1e7, unit="µs")
MEMORY_GB = Number(positive=True, minimum=1e-3, maximum=1e5, unit="GB")
MEMORY_GBPS = Number(positive=True, minimum=1.0, maximum=1e6, unit="GB/s")
TFLOPS = Number(positive=True, minimum=1e-3, maximum=1e5, unit="TFLOP/s")
CPU_LOOPBACK_GBPS = 2.0  # gloo over loopback TCP between processes of one host (hal profile measures it)
CPU_LOOPBACK_LATENCY_US = 50.0
PCIE_GBPS = 25.0  # PCIe Gen4 x16, one direction: a device whose catalog entry names no interconnect


def _device_id(origin: str, name: str, value: Any) -> str:
    ids = [e.id for e in load_catalog()]
    if not isinstance(value, str) or value not in ids:
        hint = did_you_mean(value, ids) if isinstance(value, str) else ""
        raise ConfigError(f"{origin}: key '{name}': {value!r} is not a catalog device{hint}; use one of {', '.join(ids)} "
                          "(see hal/catalog/devices.yaml)")
    return value


def _backend(origin: str, name: str, value: Any) -> str:
    """A backend name; it need not be available here (a declared cluster is planned, not run, on this host)."""
    from hal.backend_registry import backend_names
    from hal.config.schema import check_choice

    return check_choice(origin, name, value, backend_names())


def _peaks(origin: str, name: str, value: Any) -> dict[str, float]:
    """Declared peak TFLOP/s per dtype, e.g. {bf16: 313}: the figures a catalog entry lacks."""
    require_mapping(origin, name, value, "e.g. peak_tflops: {bf16: 313}")
    out = {}
    for dtype, number in value.items():
        if dtype not in DTYPE_KEYS:
            raise ConfigError(f"{origin}: key '{name}.{dtype}' is not a dtype{did_you_mean(str(dtype), DTYPE_KEYS)}; "
                              f"use {', '.join(DTYPE_KEYS)}")
        out[dtype] = TFLOPS.check(origin, f"{name}.{dtype}", number, f"{dtype}: 313")
    return out


@dataclass(frozen=True)
class DeviceGroup:
    """``count`` devices of one catalog model on one node, run by one backend."""

    backend: str = key(Custom(_backend), example="backend: cuda")
    device: str = key(Custom(_device_id), example="device: nvidia-h100-sxm")
    count: int = key(PositiveInt(limits.DEVICES), example="count: 8")
    node: int = key(NonNegativeInt(limits.DEVICES), 0)
    cores: int | None = key(Nullable(PositiveInt(limits.LOCAL_RANKS)), None, example="cores: 8")  # cpu: cores the ranks share (default: this host's)
    memory_gb: float | None = key(Nullable(MEMORY_GB), None)  # declared where the catalog has none
    memory_bandwidth_gbps: float | None = key(Nullable(MEMORY_GBPS), None)
    peak_tflops: dict[str, float] | None = key(Nullable(Custom(_peaks)), None, example="peak_tflops: {bf16: 313}")


@dataclass(frozen=True)
class Links:
    """Bandwidth (GB/s, one direction) and latency (µs) of each kind of link; None: from the catalog."""

    intra_node_gbps: float | None = key(Nullable(LINK_GBPS), None)
    intra_node_latency_us: float | None = key(Nullable(LATENCY_US), None)
    inter_node_gbps: float = key(LINK_GBPS, DEFAULT_INTER_NODE_GBPS)
    inter_node_latency_us: float = key(LATENCY_US, DEFAULT_INTER_NODE_LATENCY_US)
    bridge_gbps: float = key(LINK_GBPS, DEFAULT_BRIDGE_GBPS)
    bridge_latency_us: float = key(LATENCY_US, DEFAULT_BRIDGE_LATENCY_US)


def _links(origin: str, name: str, value: Any) -> Links:
    links: Links = parse_section(origin, name, value, Links)
    return links


@dataclass(frozen=True)
class ClusterSpec:
    """The ``cluster:`` section as written."""

    groups: tuple[DeviceGroup, ...] = key(ListOf(DeviceGroup, "group"),
                                          example="groups: [{backend: cuda, device: nvidia-h100-sxm, count: 8}]")
    links: Links = key(Custom(_links), Links())


@dataclass(frozen=True)
class Figure:
    """One number and what it rests on: catalog | declared | default | measured | estimated."""

    value: float
    source: str


@dataclass(frozen=True)
class DeviceType:
    """Every device of one (backend, catalog id): what the planner assigns stages to."""

    backend: str
    device: str
    nodes: tuple[tuple[int, int], ...]  # (node, count) in node order
    memory_bytes: Figure | None
    memory_bandwidth_gbps: Figure | None
    peak_tflops: Mapping[str, Figure]
    link_gbps: Figure  # between two devices of this type on one node
    link_latency_us: Figure
    cores: int | None = None  # cpu: cores the node's ranks share

    @property
    def name(self) -> str:
        return self.device

    @property
    def count(self) -> int:
        return sum(c for _, c in self.nodes)

    @property
    def per_node(self) -> int:
        """Devices on the smallest node: a tp group must fit on one node."""
        return min(c for _, c in self.nodes)

    @property
    def is_cpu(self) -> bool:
        return self.backend == "cpu"

    def node_of(self, index: int) -> int:
        """The node holding this type's ``index``-th device (devices numbered node by node)."""
        for node, count in self.nodes:
            if index < count:
                return node
            index -= count
        raise IndexError(index)

    def to_dict(self) -> dict[str, Any]:
        fig = lambda f: None if f is None else {"value": f.value, "source": f.source}
        return {"backend": self.backend, "device": self.device, "count": self.count, "nodes": [list(n) for n in self.nodes],
                "cores": self.cores, "memory_bytes": fig(self.memory_bytes), "memory_bandwidth_gbps": fig(self.memory_bandwidth_gbps),
                "peak_tflops": {k: fig(v) for k, v in self.peak_tflops.items()},
                "link_gbps": fig(self.link_gbps), "link_latency_us": fig(self.link_latency_us)}


@dataclass(frozen=True)
class Cluster:
    """The resolved cluster: device types in declaration order, and the links between islands and nodes."""

    types: tuple[DeviceType, ...]
    links: Links
    origin: str
    probed: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def device_count(self) -> int:
        return sum(t.count for t in self.types)

    def type(self, device: str) -> DeviceType:
        for t in self.types:
            if t.device == device:
                return t
        raise KeyError(device)

    def between(self, a: DeviceType, b: DeviceType, same_node: bool) -> tuple[Figure, Figure]:
        """(GB/s, µs) of the link from a device of ``a`` to one of ``b``: native CCL, inter-node, or the bridge."""
        links = self.links
        if a.backend != b.backend:
            return self.bridge(same_node)
        if same_node and a.device == b.device:
            return a.link_gbps, a.link_latency_us
        if same_node:  # two models of one backend on one node: the slower device's link (often PCIe)
            return min(a.link_gbps, b.link_gbps, key=lambda f: f.value), max(a.link_latency_us, b.link_latency_us, key=lambda f: f.value)
        return (Figure(links.inter_node_gbps, _src(links.inter_node_gbps, DEFAULT_INTER_NODE_GBPS)),
                Figure(links.inter_node_latency_us, _src(links.inter_node_latency_us, DEFAULT_INTER_NODE_LATENCY_US)))

    def bridge(self, same_node: bool) -> tuple[Figure, Figure]:
        """(GB/s, µs) of the bridge between two islands (different backends, or islands declared apart): host-staged,
        and between nodes no faster than the nodes' link."""
        links = self.links
        bw, lat = Figure(links.bridge_gbps, _src(links.bridge_gbps, DEFAULT_BRIDGE_GBPS)), \
            Figure(links.bridge_latency_us, _src(links.bridge_latency_us, DEFAULT_BRIDGE_LATENCY_US))
        if not same_node and links.inter_node_gbps < bw.value:
            bw = Figure(links.inter_node_gbps, _src(links.inter_node_gbps, DEFAULT_INTER_NODE_GBPS))
        return bw, Figure(lat.value + (0.0 if same_node else links.inter_node_latency_us), lat.source)

    def estimated_or_default(self) -> list[str]:
        """Every figure of this cluster that is not catalog, declared or measured: said in every report."""
        out = []
        for t in self.types:
            for what, fig in (("link", t.link_gbps), ("memory", t.memory_bytes)):
                if fig is not None and fig.source in ("default", "estimated"):
                    out.append(f"{t.device} {what} ({fig.source})")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"origin": self.origin, "probed": self.probed, "devices": self.device_count,
                "types": [t.to_dict() for t in self.types], "links": self.links.__dict__, "notes": list(self.notes)}


def _src(value: float, default: float) -> str:
    return "default" if value == default else "declared"


def parse_cluster(raw: Any, origin: str = "cluster") -> ClusterSpec:
    """The ``cluster:`` section as a ClusterSpec (keys, types, catalog ids), or one ConfigError line."""
    spec: ClusterSpec = parse_section(origin, "cluster", raw, ClusterSpec)
    for i, g in enumerate(spec.groups):
        entry = _entry(g.device)
        if g.backend not in entry.backends:
            raise ConfigError(f"{origin}: cluster.groups[{i}]: device {g.device} runs on backend(s) {', '.join(entry.backends)}, "
                              f"not {g.backend!r}; set backend: {entry.backends[0]}")
        if g.cores is not None and g.backend != "cpu":
            raise ConfigError(f"{origin}: cluster.groups[{i}].cores: only cpu groups share cores; drop cores or set backend: cpu")
    seen: dict[tuple[str, int], int] = {}
    for i, g in enumerate(spec.groups):
        if (g.device, g.node) in seen:
            raise ConfigError(f"{origin}: cluster.groups[{i}] repeats device {g.device} on node {g.node} "
                              f"(groups[{seen[(g.device, g.node)]}]); give one group with the total count")
        seen[(g.device, g.node)] = i
    return spec


def _entry(device: str) -> CatalogEntry:
    return next(e for e in load_catalog() if e.id == device)


def resolve(spec: ClusterSpec, origin: str = "cluster", *, probed: bool = False) -> Cluster:
    """Device types with every figure and its source (group declaration > catalog > documented default)."""
    by_type: dict[tuple[str, str], list[DeviceGroup]] = {}
    for g in spec.groups:
        by_type.setdefault((g.backend, g.device), []).append(g)
    types = []
    for (backend, device), groups in by_type.items():
        entry, first = _entry(device), groups[0]
        for g in groups[1:]:
            facts = lambda d: (d.memory_gb, d.memory_bandwidth_gbps, d.peak_tflops, d.cores)
            if facts(g) != facts(first):
                raise ConfigError(f"{origin}: cluster groups of {device} declare different figures on nodes {first.node} and "
                                  f"{g.node}; one device model has one set of figures — declare them alike")
        types.append(_device_type(entry, backend, groups, spec.links))
    return Cluster(tuple(types), spec.links, origin, probed)


def _figure(declared: float | None, catalog: float | None, scale: float = 1.0) -> Figure | None:
    if declared is not None:
        return Figure(declared * scale, "declared")
    if catalog is not None:
        return Figure(catalog * scale, "catalog")
    return None


def _device_type(entry: CatalogEntry, backend: str, groups: list[DeviceGroup], links: Links) -> DeviceType:
    g = groups[0]
    peaks = {k: f for k in DTYPE_KEYS if (f := _figure((g.peak_tflops or {}).get(k), entry.peak_tflops.get(k))) is not None}
    memory = _figure(g.memory_gb, entry.memory_gb, 1e9)
    cores = None
    if backend == "cpu":
        cores = g.cores or os.cpu_count() or 1
        if memory is None:
            memory = Figure(float(_host_memory()), "probed (host memory, shared by the node's cpu ranks)")
    if links.intra_node_gbps is not None:
        bw = Figure(links.intra_node_gbps, "declared")
    elif backend == "cpu":
        bw = Figure(CPU_LOOPBACK_GBPS, "default")
    elif entry.interconnect is not None and entry.interconnect.bandwidth_gbps:
        bw = Figure(entry.interconnect.bandwidth_gbps / 2, "catalog")
    else:
        bw = Figure(PCIE_GBPS, "default")
    if links.intra_node_latency_us is not None:
        lat = Figure(links.intra_node_latency_us, "declared")
    else:
        lat = Figure(CPU_LOOPBACK_LATENCY_US if backend == "cpu" else DEFAULT_INTRA_NODE_LATENCY_US, "default")
    nodes = tuple(sorted((grp.node, grp.count) for grp in groups))
    return DeviceType(backend, entry.id, nodes, memory, _figure(g.memory_bandwidth_gbps, entry.memory_bandwidth_gbps),
                      peaks, bw, lat, cores)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise ConfigError("cluster: this host's memory cannot be read; declare memory_gb on the cpu group") from None


def probe_cluster(cpu_ranks: int | None = None) -> Cluster:
    """The devices present (as ``hal devices`` lists them): one group per available accelerator backend's
    catalog model, plus the host's cpu as ``cpu_ranks`` ranks (default: one per core)."""
    from hal.backend_registry import all_backends

    groups: list[dict[str, Any]] = []
    notes = []
    for name, backend in all_backends().items():
        if backend.device_type == "cpu":
            continue
        try:
            if not backend.availability().available or backend.device_count() == 0:
                continue
            caps = backend.capabilities(0)
        except Exception as exc:  # a broken probe is reported, not raised
            notes.append(f"backend {name}: probe raised {type(exc).__name__}: {exc}")
            continue
        if caps.catalog_id is None:
            notes.append(f"backend {name}: device {caps.name!r} is not in the catalog; declare it in a cluster: section")
            continue
        groups.append({"backend": name, "device": caps.catalog_id, "count": backend.device_count(), "node": 0})
    cores = os.cpu_count() or 1
    groups.append({"backend": "cpu", "device": "cpu-generic", "count": cpu_ranks or cores, "node": 0, "cores": cores})
    cluster = resolve(parse_cluster({"groups": groups}, "probed"), "probed devices", probed=True)
    return Cluster(cluster.types, cluster.links, cluster.origin, True, tuple(notes))


def load_cluster(raw_cluster: Any, origin: str, cluster_file: str | None = None) -> Cluster:
    """``--cluster C`` (a file whose top level is ``cluster:`` or the section itself, or a FlagScale-style hostfile:
    ``planner.hostfile``), else the run config's ``cluster:`` section, else the probed devices."""
    if cluster_file is not None:
        from hal.config import read_yaml_file
        from hal.parallel.planner.hostfile import is_hostfile, parse_hostfile
        from hal.run_dirs import read_limited

        if os.path.isfile(cluster_file):  # a missing or odd path gets the config files' own words below
            fix = "give a YAML file with a cluster: section, or a hostfile of 'HOST slots=N type=DEVICE' lines"
            text = read_limited(cluster_file, 4 << 20, f"--cluster {cluster_file}", fix).decode("utf-8", errors="replace")
            if is_hostfile(text):
                return resolve(parse_cluster(parse_hostfile(text, cluster_file), cluster_file), cluster_file)

        try:  # within the config files' limits: a regular file, its size and its tree bounded before it is built
            data = read_yaml_file(cluster_file)
        except ConfigError as exc:
            raise ConfigError(f"--cluster {exc}") from None
        except OSError as exc:
            raise ConfigError(f"--cluster {cluster_file}: cannot read it ({exc.strerror}); give a YAML file with a cluster: section") from None
        if isinstance(data, Mapping) and "cluster" in data:
            data = data["cluster"]
        return resolve(parse_cluster(data, cluster_file), cluster_file)
    if raw_cluster is not None:
        return resolve(parse_cluster(raw_cluster, origin), origin)
    return probe_cluster()


def check_holds(cluster: Cluster, parameters: int, origin: str) -> None:
    """Refuse a cluster whose memory, all of it together, cannot hold the model's training state (16 B a
    parameter: fp32 weights and gradients, AdamW's two moments, even fully sharded). One line."""
    from hal.parallel.config.memory import GIB, OPTIMIZER_BYTES, WEIGHT_AND_GRADIENT_BYTES

    total, unknown = 0.0, []
    for t in cluster.types:
        if t.memory_bytes is None:
            unknown.append(t.device)
            continue
        per_node = 1 if t.is_cpu else None  # cpu ranks of a node share the host's memory
        total += t.memory_bytes.value * (len(t.nodes) if per_node else t.count)
    if unknown:
        raise ConfigError(f"{origin}: the catalog has no memory size for {', '.join(unknown)}; declare memory_gb on "
                          "its cluster group (e.g. memory_gb: 64)")
    need = parameters * (WEIGHT_AND_GRADIENT_BYTES + OPTIMIZER_BYTES)
    if need > total:
        raise ConfigError(f"{origin}: the model's training state needs at least {need / GIB:,.1f} GiB ({parameters / 1e9:,.2f} G "
                          f"parameters × 16 B) but the cluster's {cluster.device_count} devices have {total / GIB:,.1f} GiB in all; "
                          "add devices or shrink the model")
