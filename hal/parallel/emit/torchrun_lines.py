"""``--emit torchrun``: the job file as a here-document, then one torchrun line per island, to run on each of its
nodes (over ssh, pdsh, or by hand). Every line joins one c10d rendezvous: no node is special, no host name is edited
into the lines — ``HAL_RDZV_ENDPOINT`` (host:port of any one node, reachable from all) and ``HAL_JOB_ID`` are set
in each node's shell."""
from __future__ import annotations

import shlex

from hal.parallel.config.job import Job, job_text

from .components import RDZV_PORT, Component, Layout, components, rank_env, torchrun_words

ENDPOINT = '"${HAL_RDZV_ENDPOINT:?set HAL_RDZV_ENDPOINT=host:port of one node}"'
JOB_ID = '"${HAL_JOB_ID:?set HAL_JOB_ID to one name for the whole job}"'
MARKER = "HAL_JOB_EOF"


def job_file_heredoc(job: Job) -> str:
    """The shell that writes the job file the ranks read, at the path the job names."""
    return (f"mkdir -p {shlex.quote(str(job.run_dir))} && cat > {shlex.quote(str(job.path))} <<'{MARKER}'\n"
            f"{job_text(job)}{MARKER}")


def line(job: Job, parts: list[Component], component: Component, endpoint: str, job_id: str) -> str:
    """``K=V ... torchrun ARGS`` with the endpoint and job id as given (shell words, unquoted)."""
    env = "".join(f"{k}={shlex.quote(v)} " for k, v in rank_env(job, component).items())
    return env + torchrun_words(job, parts, component, endpoint, job_id)


def emit(job: Job, layout: Layout) -> str:
    parts = components(job, layout)
    total = sum(c.nodes for c in parts)
    out = [f"# hal train: {len(parts)} island(s) on {total} node(s), one c10d rendezvous (torchrun; port {RDZV_PORT} "
           "by default). On every node: set HAL_RDZV_ENDPOINT and HAL_JOB_ID, write the job file (or once on a shared "
           "filesystem), then run its island's line. Ranks take the plan's roles by their island after rendezvous "
           "(HAL_ROLES, HAL_ISLAND_INDEX), whatever order the nodes join in.",
           "# the job file the ranks read",
           job_file_heredoc(job)]
    for c in parts:
        which = f"ranks {c.ranks.start}-{c.ranks.stop - 1}"
        out.append(f"# island {c.index}: {c.backend}, {which}: on each of its {c.nodes} node(s), {c.per_node} process(es) "
                   "a node" + (f" ({c.visible} selects the node's devices)" if c.visible else ""))
        out.append(line(job, parts, c, ENDPOINT, JOB_ID))
    return "\n".join(out) + "\n"
