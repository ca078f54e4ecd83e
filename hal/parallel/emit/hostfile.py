"""``--emit hostfile``: the plan's nodes as a FlagScale-style hostfile (``HOST slots=N type=DEVICE``, one line a
node), for tools that start torchrun per host from one; host names are placeholders to replace."""
from __future__ import annotations

from hal.parallel.config.job import Job

from .components import Layout, components


def emit(job: Job, layout: Layout) -> str:
    lines = ["# one line a node: HOST slots=PROCESSES type=BACKEND (replace the host names; for hal plan --cluster, replace "
             "each type with its devices' catalog id, e.g. nvidia-h100-sxm: hal devices lists them)"]
    node = 0
    for c in components(job, layout):
        for _ in range(c.nodes):
            lines.append(f"node{node} slots={c.per_node} type={c.backend}")
            node += 1
    return "\n".join(lines) + "\n"
