"""The one multi-node path: plain torchrun command lines, one per node, for the user to run there.

hal starts nothing on other machines; it prints what to run. ``hal launch`` uses torchrun's
dynamic (c10d) rendezvous; ``hal train`` uses static rendezvous (``--node-rank`` fixes which ranks,
hence which stages, a node runs). Both put the environment first and the rank program last.
"""
from __future__ import annotations

import shlex
from typing import Mapping, Sequence

DEFAULT_PORT = 29500
HEAD = "NODE0_HOST"  # placeholder the user replaces with node 0's address


def command(args: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """``K=V ... torchrun ARGS`` as one shell line."""
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in (env or {}).items())
    return f"{prefix}torchrun {shlex.join(args)}"


def rendezvous_lines(nodes: int, nproc: int, program: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """One line per node, dynamic (c10d) rendezvous at node 0: the same line but for ``--node-rank``."""
    return [
        command([
            f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--node-rank={node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={HEAD}:{DEFAULT_PORT}", "--rdzv-id=JOB_ID", *program,
        ], env)
        for node in range(nodes)
    ]


def static_line(nodes: int, node: int, nproc: int, program: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Node ``node``'s line under static rendezvous: its ranks follow node ``node - 1``'s."""
    return command([
        f"--nnodes={nodes}", f"--node-rank={node}", f"--nproc-per-node={nproc}",
        f"--master-addr={HEAD}", f"--master-port={DEFAULT_PORT}", *program,
    ], env)
