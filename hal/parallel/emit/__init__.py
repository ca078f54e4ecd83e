"""What ``hal train CONFIG --emit FORMAT`` prints: a plan's islands as the cluster's own job — a Slurm heterogeneous
job, a Kubernetes JobSet, plain torchrun lines, or a FlagScale-style hostfile. hal starts nothing: torchrun, Slurm
and Kubernetes do the starting. ``components`` cuts the plan into components (one an island); each format is one
module registered in ``EMITTERS``."""
from __future__ import annotations

from typing import Callable

from hal.parallel.config.job import Job

from . import hostfile, kubernetes, slurm, torchrun_lines
from .components import Layout

Emitter = Callable[[Job, Layout], str]

EMITTERS: dict[str, Emitter] = {
    "slurm": slurm.emit,
    "kubernetes": kubernetes.emit,
    "torchrun": torchrun_lines.emit,
    "hostfile": hostfile.emit,
}
