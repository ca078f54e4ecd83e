"""``--emit slurm``: a Slurm heterogeneous job (``#SBATCH hetjob``), one component per island — its node count, one
task a node, the island's GRES and a ``--constraint`` of its backend (a site names its own features: edit them) —
then one ``srun`` that starts every component's torchrun at once, joined by c10d rendezvous on the first node of
component 0 (Slurm's heterogeneous job support: https://slurm.schedmd.com/heterogeneous_jobs.html). The job file
travels inside the script: it is written to the run directory, which must be on a filesystem the nodes share."""
from __future__ import annotations

from hal.parallel.config.job import Job

from .components import RDZV_PORT, Layout, components, rank_env, torchrun_words
from .torchrun_lines import job_file_heredoc


def emit(job: Job, layout: Layout) -> str:
    parts = components(job, layout)
    out = ["#!/bin/bash",
           f"# hal train as a Slurm heterogeneous job: {len(parts)} island(s), one component each "
           "(sbatch this file). GRES names and constraints are the site's: edit them to its gres.conf and features.",
           f"#SBATCH --job-name={layout.job_name}"]
    for c in parts:
        if c.index:
            out.append("#SBATCH hetjob")
        out.append(f"#SBATCH --nodes={c.nodes}")
        out.append("#SBATCH --ntasks-per-node=1")
        if c.gres:
            out.append(f"#SBATCH --gres={c.gres}:{c.per_node}")
        out.append(f"#SBATCH --constraint={c.backend}")
    out += ["set -euo pipefail",
            "# the job file the ranks read (the run directory must be on a filesystem every node shares)",
            job_file_heredoc(job),
            # a heterogeneous job names each component's nodes; a job of one component is a plain one
            f'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST{"_HET_GROUP_0" if len(parts) > 1 else ""}" | head -n 1)',
            f'export HAL_RDZV_ENDPOINT="$head:{RDZV_PORT}"']
    steps = []
    for c in parts:
        env = ",".join(f"{k}={v}" for k, v in rank_env(job, c).items())
        command = torchrun_words(job, parts, c, '"$HAL_RDZV_ENDPOINT"', '"$SLURM_JOB_ID"')
        group = f"--het-group={c.index} " if len(parts) > 1 else ""
        steps.append(f"{group}--export=ALL,{env} {command}")
    out.append("# every island's torchrun at once (one srun, its components joined by ':')")
    out.append("srun " + " \\\n  : ".join(steps))
    return "\n".join(out) + "\n"
