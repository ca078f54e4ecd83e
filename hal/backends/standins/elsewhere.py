"""A stand-in's answers from a child process, for a process whose PrivateUse1 device another vendor runtime owns.

Why: one vendor runtime per process, yet a launcher (``hal train``, ``hal plan``) checks every stage's backend before
any rank starts: availability, device count, capabilities, memory. For a second vendor's stand-in it asks a child
process that holds that runtime alone, and keeps the answers; the device itself stays unusable in the launcher
(``DeviceModuleBackend`` says so in one line), as it is on the ranks of other vendors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from hal.errors import HalError
from hal.standin import STANDIN_ENV, requested

TIMEOUT_S = 300


@dataclass(frozen=True)
class Answers:
    """What the child's backend answered: availability, and per device its name, capabilities and memory."""

    available: bool
    reason: str
    standin: str | None
    names: tuple[str, ...]
    capabilities: tuple[dict[str, Any], ...]  # DeviceCapabilities.to_dict() per device
    memory: tuple[tuple[int, int], ...]  # mem_get_info() per device

    @property
    def count(self) -> int:
        return len(self.names)


def answers_of(name: str) -> dict[str, Any]:
    """This process's answers for backend ``name`` (what the child prints)."""
    from hal.backend_registry import get_backend

    backend = get_backend(name)
    status = backend.availability()
    count = backend.device_count() if status.available else 0
    return {"available": status.available, "reason": status.reason, "standin": backend.standin,
            "names": [backend.device_name(i) for i in range(count)],
            "capabilities": [backend.capabilities(i).to_dict() for i in range(count)],
            "memory": [list(backend.mem_get_info(i)) for i in range(count)]}


def probe(name: str) -> Answers:
    """Backend ``name``'s answers from a child process whose ``HAL_STANDIN`` names its stand-in alone: a fork of this
    process where that is safe (one thread, PrivateUse1 still free: a fork, not an interpreter importing torch), else
    a fresh interpreter."""
    data = in_child(name, "hal.backends.standins.elsewhere:answers_of")
    return Answers(bool(data["available"]), str(data["reason"]), data["standin"], tuple(data["names"]),
                   tuple(data["capabilities"]), tuple((int(f), int(t)) for f, t in data["memory"]))


def in_child(name: str, target: str) -> dict[str, Any]:
    """``target(name)`` (``"module:function"``, returning JSON-able data) in a child process whose ``HAL_STANDIN``
    names backend ``name``'s stand-in alone: a fork of this process where that is safe (one thread, PrivateUse1 still
    free), else a fresh interpreter."""
    model = requested().get(name)
    value = name if model is None else f"{name}:{model}"
    return _forked(name, value, target) if _can_fork() else _spawned(name, value, target)


def _call(target: str, name: str) -> Any:
    import importlib

    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)(name)


def _can_fork() -> bool:
    import torch

    if os.environ.get("HAL_ZYGOTE", "") == "exec" or torch._C._get_privateuse1_backend_name() != "privateuseone":
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1  # no thread whose held locks a fork would copy
    except OSError:
        return False


def _forked(name: str, value: str, target: str) -> dict[str, Any]:
    """``target(name)`` in a forked child under ``HAL_STANDIN=value``, its JSON read back through a pipe (the child
    may load the stand-in: ``standins``' fork hook lifts ``keep_free`` there)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: load the stand-in here, answer, leave without running the parent's exit handlers
        code = 1
        try:
            os.close(read_end)
            os.environ[STANDIN_ENV] = value
            text = json.dumps(_call(target, name), default=str)
            code = 0
        except BaseException as exc:  # reported to the parent, one line
            text = json.dumps({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
        with os.fdopen(write_end, "w") as out:
            out.write(text)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    data: dict[str, Any] = json.loads(text) if text else {"error": f"the child ended with status {status} and no answer"}
    if "error" in data:
        raise HalError(f"probing the {name} stand-in in a child process failed: {data['error']}")
    return data


def _spawned(name: str, value: str, target: str) -> dict[str, Any]:
    """``target(name)`` in a fresh interpreter under ``HAL_STANDIN=value``."""
    env = {**os.environ, STANDIN_ENV: value}
    code = (f"import json; from hal.backends.standins.elsewhere import _call; "
            f"print(json.dumps(_call({target!r}, {name!r}), default=str))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise HalError(f"probing the {name} stand-in in a child process took over {TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise HalError(f"probing the {name} stand-in in a child process failed: {lines[-1]}")
    data: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return data


__all__ = ["Answers", "answers_of", "in_child", "probe"]
