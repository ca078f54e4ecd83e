"""Which vendor stand-ins this process may load: ``HAL_STANDIN`` (what ``--standin`` sets; ranks and scripts inherit
it), read in one place.

A stand-in is a vendor runtime over host memory (``hal.backends.standins``): explicit, never chosen by ``auto``, and
everything made on one says ``STANDIN_NOTE``. The runtimes live in ``hal.backends``; this module is the contract
the floors below them read (backend selection, the CLI's flag).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from hal.errors import ConfigError

STANDIN_ENV = "HAL_STANDIN"
COUNT_ENV = "HAL_STANDIN_COUNT"
DEFAULT_COUNT = 8
MAX_COUNT = 64
STANDIN_NOTE = "stand-in: host-backed, not hardware"
VENDORS = ("ascend", "cambricon")  # the backends that have a stand-in


def requested(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The stand-ins ``HAL_STANDIN`` asks for: {backend: model or None} (``ascend,cambricon:MLU370-X8``); one
    ConfigError line for a vendor without one."""
    text = (os.environ if env is None else env).get(STANDIN_ENV, "").strip()
    out: dict[str, str | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        backend, _, model = item.partition(":")
        if backend not in VENDORS:
            raise ConfigError(f"{STANDIN_ENV}={text!r}: {backend!r} has no stand-in; use one or more of "
                              f"{', '.join(VENDORS)} (e.g. --standin ascend,cambricon)")
        out[backend] = model.strip() or None
    return out


def host_backends(env: Mapping[str, str] | None = None) -> set[str]:
    """The backends whose ranks run in host memory under ``env``: the CPU and the stand-ins it asks for (their ranks
    may be forked from a zygote; a device runtime never is)."""
    return {"cpu", *requested(env)}


def device_count(env: Mapping[str, str] | None = None) -> int:
    """Devices each stand-in shows (``HAL_STANDIN_COUNT``, 8 by default, as an 8-card node)."""
    text = (os.environ if env is None else env).get(COUNT_ENV, str(DEFAULT_COUNT)).strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_COUNT:
        raise ConfigError(f"{COUNT_ENV}={text!r}: give the stand-in's device count, 1 to {MAX_COUNT} "
                          f"(default {DEFAULT_COUNT})")
    return int(text)


def flag_value(value: str) -> str:
    """``--standin VENDOR[,VENDOR]`` checked and returned as ``HAL_STANDIN``'s value (the CLI sets the variable, so
    every process it starts inherits it)."""
    requested({STANDIN_ENV: value})
    return value


__all__ = ["COUNT_ENV", "DEFAULT_COUNT", "STANDIN_ENV", "STANDIN_NOTE", "VENDORS", "device_count", "flag_value",
           "requested"]
