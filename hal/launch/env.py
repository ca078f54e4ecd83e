"""Each rank's environment: torchrun's variables, so ``init_distributed()`` and torch find their place."""
from __future__ import annotations

import os
import socket
import sys
from typing import Mapping

INIT_METHOD_ENV = "HAL_INIT_METHOD"  # a file:// store private to one run; rank functions pass it to init_distributed


def free_port() -> int:
    """A TCP port free right now on this host (torchrun's --standalone picks its port the same way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_path(base: Mapping[str, str]) -> str:
    """PYTHONPATH for a rank: this process's import path first, so a rank imports what its launcher does."""
    entries = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p)), *base.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in entries if p))


def rank_env(
    rank: int,
    world_size: int,
    port: int,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``base`` (default: this process's environment) plus the rank's torchrun variables, then ``extra``."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size if local_world_size is None else local_world_size),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    if world_size > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # N ranks share the host's cores (torchrun's default)
    env.update(extra or {})
    return env
