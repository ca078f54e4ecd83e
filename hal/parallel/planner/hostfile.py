"""A FlagScale-style hostfile as a cluster: one line a host, ``HOST slots=N type=DEVICE`` — the way mixed clusters are
described where torchrun is started per host over ssh. ``DEVICE`` is a catalog id (``hal/catalog/devices.yaml``, as
``hal devices`` names them); each line becomes one group of the cluster (its backend the catalog entry's first,
its node the line's). ``hal plan --search --cluster HOSTFILE`` and ``hal profile --cluster HOSTFILE`` read it
where they read a ``cluster:`` YAML; a file whose every line has this form is taken as a hostfile."""
from __future__ import annotations

import re
from typing import Any

from hal.errors import ConfigError

LINE = re.compile(r"^\s*(?P<host>[^\s#=]+)\s+slots=(?P<slots>\S+)(?:\s+type=(?P<type>\S+))?\s*(?:#.*)?$")
MAX_HOSTS = 100_000


def _lines(text: str) -> list[tuple[int, str]]:
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.lstrip().startswith("#")]


def is_hostfile(text: str) -> bool:
    """Whether every line (comments and blank lines aside) is ``HOST slots=...``."""
    lines = _lines(text)
    return bool(lines) and all(LINE.match(line) for _, line in lines)


def parse_hostfile(text: str, origin: str) -> dict[str, Any]:
    """The ``cluster:`` section a hostfile describes (``{"groups": [...]}``); one ConfigError line for the first bad line."""
    from hal.backend_registry import backend_names
    from hal.capabilities import load_catalog
    from hal.config.schema import did_you_mean

    catalog = {e.id: e for e in load_catalog()}
    groups = []
    lines = _lines(text)
    if len(lines) > MAX_HOSTS:
        raise ConfigError(f"{origin}: {len(lines)} hosts; a hostfile holds at most {MAX_HOSTS}")
    for node, (number, line) in enumerate(lines):
        found = LINE.match(line)
        if found is None:
            raise ConfigError(f"{origin}:{number}: {line.strip()[:80]!r} is not 'HOST slots=N type=DEVICE'")
        slots, device = found.group("slots"), found.group("type")
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigError(f"{origin}:{number}: slots={slots}: give the host's device count, a whole number of 1 or more")
        if device is None:
            raise ConfigError(f"{origin}:{number}: {found.group('host')} names no type=; give the catalog id of its devices "
                              f"(e.g. type=nvidia-h100-sxm; hal devices lists them)")
        if device not in catalog:
            if device in backend_names():
                ids = [e for e, entry in catalog.items() if device in entry.backends]
                raise ConfigError(f"{origin}:{number}: type={device} is a backend, not a device; give its catalog id "
                                  f"({', '.join(ids[:6])}{', ...' if len(ids) > 6 else ''})")
            raise ConfigError(f"{origin}:{number}: type={device} is not a catalog device{did_you_mean(device, list(catalog))}; "
                              "hal devices and hal/catalog/devices.yaml list them")
        groups.append({"backend": catalog[device].backends[0], "device": device, "count": int(slots), "node": node})
    return {"groups": groups}
