"""A plan cut into components, one an island: the consecutive ranks of one backend, their nodes and what each node
asks the cluster for (the vendor's device resource, its visible-devices variable, its Slurm GRES).

The vendor names, from each vendor's Kubernetes device plugin and runtime:
- NVIDIA: ``nvidia.com/gpu`` (NVIDIA k8s-device-plugin), ``CUDA_VISIBLE_DEVICES``;
- Huawei Ascend: ``huawei.com/Ascend910`` (Ascend device plugin, MindCluster), ``ASCEND_RT_VISIBLE_DEVICES``
  (torch_npu);
- Cambricon: ``cambricon.com/mlu`` (cambricon-k8s-device-plugin), ``MLU_VISIBLE_DEVICES`` (torch_mlu);
- AMD: ``amd.com/gpu`` (ROCm k8s-device-plugin), ``HIP_VISIBLE_DEVICES``; a Hygon DCU cluster's plugin names
  ``hygon.com/dcu`` (``--resource rocm=hygon.com/dcu``).
Slurm GRES names are the site's (``gres.conf``): ``gpu`` is the common one for GPUs; ``npu`` and ``mlu`` are what
Ascend and Cambricon sites usually declare — ``--gres-name BACKEND=NAME`` sets another.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Mapping

from hal.errors import ConfigError
from hal.parallel.config.job import Job

RESOURCES: dict[str, str] = {"cuda": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910", "cambricon": "cambricon.com/mlu",
                             "rocm": "amd.com/gpu"}
VISIBLE: dict[str, str] = {"cuda": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES",
                           "cambricon": "MLU_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
GRES: dict[str, str] = {"cuda": "gpu", "rocm": "gpu", "ascend": "npu", "cambricon": "mlu"}
DEFAULT_DEVICES_PER_NODE = 8
RDZV_PORT = 29400  # torchrun's default c10d rendezvous port


@dataclass(frozen=True)
class Component:
    """One island: ``ranks`` of ``backend`` on ``nodes`` nodes of ``per_node`` processes each."""

    index: int
    backend: str
    ranks: range
    nodes: int
    per_node: int
    resource: str | None
    gres: str | None
    visible: str | None

    @property
    def name(self) -> str:
        return f"island{self.index}-{self.backend}"


@dataclass(frozen=True)
class Layout:
    """How to cut: devices a node per backend, and the site's names where they differ from the defaults."""

    devices_per_node: Mapping[str, int] = field(default_factory=dict)
    resources: Mapping[str, str] = field(default_factory=dict)
    gres: Mapping[str, str] = field(default_factory=dict)
    job_name: str = "hal"


def islands(job: Job) -> list[tuple[str, range]]:
    """The plan's islands in rank order: (backend, the consecutive ranks that run it)."""
    backend_of = {r: t.backend_of(r) for t in job.topologies() for r in t.ranks}
    out: list[tuple[str, range]] = []
    start = 0
    for rank in range(1, job.world_size + 1):
        if rank == job.world_size or backend_of[rank] != backend_of[start]:
            out.append((backend_of[start], range(start, rank)))
            start = rank
    return out


def components(job: Job, layout: Layout) -> list[Component]:
    """The plan's islands with their nodes; a ConfigError line where an island's ranks do not fill whole nodes."""
    out: list[Component] = []
    for backend, ranks in islands(job):
        start, size = ranks.start, len(ranks)
        per_node = layout.devices_per_node.get(backend) or (size if backend == "cpu" else min(size, DEFAULT_DEVICES_PER_NODE))
        if size % per_node:
            raise ConfigError(f"island {len(out)} ({backend}, ranks {start}-{ranks.stop - 1}): {size} ranks do not fill nodes of "
                              f"{per_node}; give --devices-per-node {backend}=N with N dividing {size}")
        out.append(Component(len(out), backend, ranks, math.ceil(size / per_node), per_node,
                             layout.resources.get(backend, RESOURCES.get(backend)), layout.gres.get(backend, GRES.get(backend)),
                             VISIBLE.get(backend)))
    return out


def program(job: Job) -> list[str]:
    """What every rank runs: the trainer on the job file."""
    return ["-m", "hal.parallel.loop.trainer", *job.rank_args()]


def rank_env(job: Job, component: Component) -> dict[str, str]:
    """The environment every process of a component gets: its backend, the run's precision and fallback, and the
    role rule (``HAL_ROLES``, ``HAL_ISLAND_INDEX``: ranks take the plan's roles by island after rendezvous, not by join
    order: ``collectives.roles``), and ``HAL_RESUME=auto``: a requeued or recreated job continues from its run
    directory's latest checkpoint (``loop.restarts``)."""
    return {"HAL_BACKEND": component.backend, "HAL_PRECISION": job.precision, "HAL_FALLBACK": job.fallback,
            "HAL_ROLES": "by-island", "HAL_ISLAND_INDEX": str(component.index), "HAL_RESUME": "auto"}


def torchrun_args(job: Job, parts: list[Component], component: Component, endpoint: str, job_id: str) -> list[str]:
    """One component's torchrun arguments: c10d rendezvous at ``endpoint`` over every component's nodes."""
    nodes = sum(c.nodes for c in parts)
    return [f"--nnodes={nodes}", f"--nproc-per-node={component.per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}", *program(job)]


def torchrun_words(job: Job, parts: list[Component], component: Component, endpoint: str, job_id: str) -> str:
    """``torchrun ARGS`` as one shell line: every argument quoted but the endpoint and the job id, which go in as given
    (a shell expansion such as ``"$HAL_RDZV_ENDPOINT"``)."""
    args = torchrun_args(job, parts, component, endpoint, job_id)
    raw = (f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_id}")
    return "torchrun " + " ".join(a if a in raw else shlex.quote(a) for a in args)


def parse_pairs(values: list[str] | None, flag: str, as_int: bool = False) -> dict[str, object]:
    """``BACKEND=VALUE`` flags as a dict; a ConfigError line for a malformed one."""
    out: dict[str, object] = {}
    for value in values or []:
        backend, sep, given = value.partition("=")
        if not sep or not backend or not given:
            raise ConfigError(f"{flag} {value!r}: give BACKEND=VALUE, e.g. {flag} cuda=8")
        if as_int:
            if not given.isdigit() or int(given) < 1:
                raise ConfigError(f"{flag} {value!r}: the count must be a whole number of 1 or more")
            out[backend] = int(given)
        else:
            out[backend] = given
    return out
