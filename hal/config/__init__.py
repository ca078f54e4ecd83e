"""The user's settings: YAML file, then environment, then CLI flags (later wins).

Precedence, lowest to highest: built-in defaults < config file (``--config F``) <
environment (``HAL_BACKEND``, ``HAL_PRECISION``, ``HAL_FALLBACK``) < CLI flags. Every problem is
one ``ConfigError`` line naming where the value came from, the key, the value and what is
allowed. YAML is read with ``yaml.safe_load`` only; duplicate keys are refused (safe_load would
silently keep the last one).

The same file may also carry the engine's sections ``model:``, ``parallel:`` and ``train:``, and the
planner's ``cluster:`` and ``planned:`` (``SECTIONS``). They come from the file only (no environment or flag overrides them), and hal
checks only that each is a mapping and keeps it as a plain dict: ``hal.parallel.config.run``
parses them with the same schema machinery (``hal.config.schema``). The data flows config → run
config; ``hal`` never imports ``parallel`` at import time.

The top level is declared once, as ``HalConfig``'s fields (rule, default, choices); the file, the
environment and the flags are all checked by those declarations.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from hal.config.schema import Choice, Custom, RawSection, check_value, key, reject_unknown, section_specs
from hal.downgrades import FALLBACK_MODES
from hal.errors import ConfigError
from hal.precision import PRECISIONS
from hal.run_dirs import read_at_most

ENV_VARS: dict[str, str] = {"backend": "HAL_BACKEND", "precision": "HAL_PRECISION", "fallback": "HAL_FALLBACK"}
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 32  # levels of nesting; the schema itself uses 4
MAX_CONFIG_VALUES = 100_000  # scalars, keys and collections after alias expansion

Devices = "str | tuple[int, ...]"  # "all" or explicit indices


def _backend_choices() -> list[str]:
    from hal.backend_registry import backend_names

    return ["auto", *backend_names()]


def _check_devices(origin: str, name: str, value: Any) -> str | tuple[int, ...]:
    fix = "use 'all', one index like 0, or a list like [0, 1]"
    if value == "all":
        return "all"
    if isinstance(value, bool):
        raise ConfigError(f"{origin}: key '{name}' must be 'all', an index or a list of indices, got {value!r}; {fix}")
    if isinstance(value, int):
        value = [value]
    if isinstance(value, str):
        raise ConfigError(f"{origin}: key '{name}': {value!r} is not allowed; {fix}")
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{origin}: key '{name}' must be 'all', an index or a non-empty list, got {value!r}; {fix}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ConfigError(f"{origin}: key '{name}': {item!r} is not a device index (an integer ≥ 0); {fix}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{origin}: key '{name}': {value!r} lists a device twice; list each index once")
    return tuple(value)


@dataclass(frozen=True)
class HalConfig:
    """The top level of the config file: hal's own keys, then the engine's sections (plain dicts)."""

    backend: str = key(Choice(_backend_choices), "auto")
    devices: str | tuple[int, ...] = key(Custom(_check_devices), "all")
    precision: str = key(Choice(PRECISIONS), "fp32")
    fallback: str = key(Choice(FALLBACK_MODES), "warn")
    # The engine's sections as read from the file (None where the file has none).
    model: Mapping[str, Any] | None = key(RawSection(), None)
    parallel: Mapping[str, Any] | None = key(RawSection(), None)
    train: Mapping[str, Any] | None = key(RawSection(), None)
    cluster: Mapping[str, Any] | None = key(RawSection(), None)  # the planner's device inventory (parallel.planner.cluster)
    planned: Mapping[str, Any] | None = key(RawSection(), None)  # the planner's prediction a written plan keeps (planner.planned)
    origins: Mapping[str, str] = field(default_factory=lambda: {k: "default" for k in KEYS})  # not a config key

    def section(self, name: str) -> Mapping[str, Any] | None:
        """``model``, ``parallel`` or ``train`` as a plain mapping, or None when the file has none."""
        if name not in SECTIONS:
            raise KeyError(f"unknown config section {name!r}; use one of {', '.join(SECTIONS)}")
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "devices": self.devices if isinstance(self.devices, str) else list(self.devices),
            "precision": self.precision,
            "fallback": self.fallback,
            "origins": dict(self.origins),
        }


SECTIONS: tuple[str, ...] = tuple(n for n, s in section_specs(HalConfig).items() if isinstance(s.rule, RawSection))
KEYS: tuple[str, ...] = tuple(n for n in section_specs(HalConfig) if n not in SECTIONS)


def _allowed(values: tuple[str, ...] | list[str]) -> str:
    return ", ".join(values)


# --- reading a file -----------------------------------------------------------------------------------


def _compose(text: str, origin: str) -> yaml.Node | None:
    """The YAML node graph, before anything is constructed (PyYAML's composer recurses per nesting level)."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ConfigError(f"{origin}: nested too deeply for a config file (limit {MAX_CONFIG_DEPTH} levels); "
                          "flatten it") from None


def check_yaml_tree(root: yaml.Node | None, origin: str) -> None:
    """Bound the tree that ``safe_load`` would build, and refuse repeated keys, before building it.

    Aliases make a graph: each node is walked once (memoized), so a "billion laughs" file costs its
    size, not its expansion; the expansion is counted and bounded instead, a node reached again while
    it is being walked is a recursive anchor, and depth is bounded on the way down.
    """
    expanded: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{origin}: nested deeper than {MAX_CONFIG_DEPTH} levels (line {node.start_mark.line + 1}); "
                              "a config file needs far fewer; flatten it")
        if id(node) in expanded:
            return expanded[id(node)]
        if id(node) in active:
            raise ConfigError(f"{origin}: a recursive alias (line {node.start_mark.line + 1}) refers to itself; "
                              "a config value must be finite")
        active.add(id(node))
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                if key in seen:
                    raise ConfigError(f"{origin}: key '{key}' appears twice (line {key_node.start_mark.line + 1}); keep one")
                seen.add(key)
                total += size(key_node, depth + 1) + size(value_node, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(child, depth + 1) for child in node.value)
        if total > MAX_CONFIG_VALUES:
            raise ConfigError(f"{origin}: expands to more than {MAX_CONFIG_VALUES} values (through aliases or sheer size); "
                              "a config file needs far fewer; check the anchors (&) and aliases (*)")
        active.discard(id(node))
        expanded[id(node)] = total
        return total

    if root is not None:
        size(root, 0)


def read_yaml_file(path: str | os.PathLike[str]) -> Any:
    """A YAML file's value, read within the config limits (a regular file, its size checked before it is read, its
    tree bounded before it is built), or one ConfigError line saying what is wrong."""
    origin = str(path)
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{origin}: config file not found; check the path")
    if not p.is_file():
        raise ConfigError(f"{origin}: is not a file; give the path of a YAML file")
    raw = read_at_most(p, MAX_CONFIG_BYTES)  # a huge file is refused, not loaded
    if raw is None:
        raise ConfigError(f"{origin}: over {MAX_CONFIG_BYTES} bytes is too large for a config file; check the path")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{origin}: not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save the file as UTF-8"
        ) from None
    try:
        check_yaml_tree(_compose(text, origin), origin)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{origin}: not valid YAML{where}: {exc.problem or exc.context}; fix the syntax there") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}: not valid YAML: {' '.join(str(exc).split())}; fix the syntax") from None
    return data


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a config file into a plain dict, or raise one ConfigError line saying what is wrong."""
    origin = str(path)
    data = read_yaml_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin}: the top level must be a mapping of keys ({_allowed(KEYS + SECTIONS)}), got a {type(data).__name__}"
        )
    reject_unknown(origin, "", data, KEYS + SECTIONS)
    for name in SECTIONS:
        if name in data:
            check_value(origin, HalConfig, name, data[name])
    return data


# --- putting the layers together ----------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> HalConfig:
    """Defaults < file < environment < overrides (CLI flags); each value validated where it enters."""
    env = os.environ if env is None else env
    config = HalConfig()
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path is not None:
        data = read_config_file(path)
        sections = {key: dict(data.pop(key)) for key in SECTIONS if key in data}
        config = replace(config, **sections, origins={**config.origins, **{key: str(path) for key in sections}})
        layers.append((str(path), data))
    env_layer = {key: env[var] for key, var in ENV_VARS.items() if env.get(var)}
    for name, value in env_layer.items():
        layers.append((f"environment {ENV_VARS[name]}", {name: value}))
    for name, value in (overrides or {}).items():
        if value is not None:
            layers.append((f"--{name}", {name: value}))
    for origin, values in layers:
        for name, value in values.items():
            checked = check_value(origin, HalConfig, name, value)
            config = replace(config, **{name: checked}, origins={**config.origins, name: origin})
    return config
