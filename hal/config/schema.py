"""One config schema: each section of the YAML file is a frozen dataclass whose fields carry their rule.

Why: the top-level keys, ``model:``, ``parallel:`` (and each stage) and ``train:`` had three
hand-written validators with three wordings. Now a section is declared once — a dataclass whose
fields say type, default, bounds or choices and the example shown in the fix (``key(...)``) — and
one validator (``parse_section``) turns a raw mapping into that dataclass or raises one
``ConfigError`` line: unknown key (with did-you-mean), missing key, wrong type, out of range.

The sections are declared where their dataclass lives (``hal.config`` the top level,
``hal.parallel`` the rest); this module is the machinery only. It imports no torch, so
``hal --help`` stays fast.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from hal.errors import ConfigError

_SPEC = "hal.config.schema"  # the dataclass-field metadata key holding a field's Spec


# --- rules: one kind of value each, with today's one-line wording ------------------------------------


class Rule:
    """Checks one value; returns it (converted where YAML reads it oddly) or raises one ConfigError line."""

    def check(self, origin: str, key: str, value: Any, example: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Limit:
    """An upper bound and why it is there (shown in the message): checked before anything is allocated."""

    maximum: int
    why: str

    def check(self, origin: str, key: str, value: int, example: str) -> int:
        if value > self.maximum:
            raise ConfigError(f"{origin}: key '{key}' is {value}, above the limit {self.maximum} ({self.why}); e.g. {example}")
        return value


@dataclass(frozen=True)
class _Integer(Rule):
    """An int (not a bool) of at least ``minimum``, under an optional ``Limit``."""

    limit: Limit | None = None
    minimum: ClassVar[int]

    def refuse(self, origin: str, key: str, value: Any, example: str) -> ConfigError:
        raise NotImplementedError

    def check(self, origin: str, key: str, value: Any, example: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.minimum:
            raise self.refuse(origin, key, value, example)
        return self.limit.check(origin, key, value, example) if self.limit else value


class PositiveInt(_Integer):
    minimum = 1

    def refuse(self, origin: str, key: str, value: Any, example: str) -> ConfigError:
        return ConfigError(f"{origin}: key '{key}' must be a positive integer, got {value!r}; e.g. {example}")


class NonNegativeInt(_Integer):
    minimum = 0

    def refuse(self, origin: str, key: str, value: Any, example: str) -> ConfigError:
        return ConfigError(f"{origin}: key '{key}' must be an integer ≥ 0, got {value!r}")


@dataclass(frozen=True)
class Number(Rule):
    positive: bool  # True: > 0; False: ≥ 0
    maximum: float | None = None  # a bound past which the value is a mistake (an overflow in fp32, say), not a choice
    minimum: float | None = None  # a bound below which the value is a mistake (a link slower than any wire)
    unit: str = ""  # said with the range: "GB/s", "µs"

    def check(self, origin: str, key: str, value: Any, example: str) -> float:
        # PyYAML reads ``1e-3`` (no dot) as a string (YAML 1.1); a number written that way is still a number.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (self.positive and value == 0):
            bound = "a positive number" if self.positive else "a number ≥ 0"
            raise ConfigError(f"{origin}: key '{key}' must be {bound}, got {value!r}")
        low = self.minimum is not None and value < self.minimum
        if low or (self.maximum is not None and value > self.maximum):
            unit = f" {self.unit}" if self.unit else ""
            if self.minimum is not None and self.maximum is not None:
                bound = f"between {self.minimum:g} and {self.maximum:g}{unit}"
            else:
                bound = f"at least {self.minimum:g}{unit}" if low else f"at most {self.maximum:g}{unit}"
            raise ConfigError(f"{origin}: key '{key}' must be {bound}, got {value!r}"
                              + ("; a figure outside that is no device or link that exists" if self.unit else ""))
        return float(value)


class Flag(Rule):
    def check(self, origin: str, key: str, value: Any, example: str) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{origin}: key '{key}' must be true or false, got {value!r}")
        return value


@dataclass(frozen=True)
class Choice(Rule):
    """One of a list of names; ``choices`` may be a callable (registries are read when checked, not declared)."""

    choices: Sequence[str] | Callable[[], Sequence[str]]

    def names(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def check(self, origin: str, key: str, value: Any, example: str) -> str:
        return check_choice(origin, key, value, self.names())


class PathStr(Rule):
    def check(self, origin: str, key: str, value: Any, example: str) -> str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{origin}: key '{key}' must be a path (a non-empty string) or null, got {value!r}")
        return value


@dataclass(frozen=True)
class Nullable(Rule):
    """``null`` means "not set" (the field's default None); anything else must pass ``rule``."""

    rule: Rule

    def check(self, origin: str, key: str, value: Any, example: str) -> Any:
        return None if value is None else self.rule.check(origin, key, value, example)


@dataclass(frozen=True)
class Custom(Rule):
    """A value with its own grammar (e.g. ``devices``): ``check(origin, key, value)`` returns it or raises."""

    fn: Callable[[str, str, Any], Any]

    def check(self, origin: str, key: str, value: Any, example: str) -> Any:
        return self.fn(origin, key, value)


@dataclass(frozen=True)
class RawSection(Rule):
    """A nested section kept as a plain dict (another layer parses it into its own dataclass)."""

    def check(self, origin: str, key: str, value: Any, example: str) -> dict[str, Any]:
        require_mapping(origin, key, value, f"indent its keys under '{key}:'")
        return dict(value)


@dataclass(frozen=True)
class ListOf(Rule):
    """A non-empty list of sub-sections, each parsed into ``item`` (a section dataclass)."""

    item: type
    noun: str  # what one item is called in messages ("stage")

    def check(self, origin: str, key: str, value: Any, example: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise ConfigError(f"{origin}: key '{key}' must be a list of {self.noun}s, got {type(value).__name__} {value!r}; e.g. {example}")
        if not value:
            raise ConfigError(f"{origin}: key '{key}' is empty; give at least one {self.noun}, e.g. {example}")
        return tuple(parse_section(origin, f"{key}[{i}]", raw, self.item) for i, raw in enumerate(value))


# --- declaring a section ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    rule: Rule
    default: Any = MISSING  # MISSING (and no derive): the key is required
    example: str | None = None  # the fix text's example; default "<name>: <default>"
    derive: Callable[[dict[str, Any]], Any] | None = None  # default computed from the keys before it

    @property
    def required(self) -> bool:
        return self.default is MISSING and self.derive is None


def key(rule: Rule, default: Any = MISSING, *, example: str | None = None,
        derive: Callable[[dict[str, Any]], Any] | None = None, positional: bool = False) -> Any:
    """A section field: its rule, schema default, example and (optionally) a derived default.

    ``positional``: the dataclass constructor still requires the value (code that builds the
    dataclass directly passes it); the schema default applies to the YAML only.
    """
    spec = Spec(rule, default, example, derive)
    if positional or default is MISSING:
        return field(metadata={_SPEC: spec})
    return field(default=default, metadata={_SPEC: spec})


def section_specs(cls: type) -> dict[str, Spec]:
    """The keys of section ``cls`` in declaration order (fields without a Spec are not config keys)."""
    if not is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a section dataclass")
    return {f.name: f.metadata[_SPEC] for f in fields(cls) if _SPEC in f.metadata}


def _example(name: str, spec: Spec) -> str:
    if spec.example is not None:
        return spec.example
    return f"{name}: {spec.default}" if spec.default is not MISSING else name


# --- the one validator -------------------------------------------------------------------------------


def did_you_mean(value: str, choices: Sequence[str]) -> str:
    hint = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


def check_choice(origin: str, key: str, value: Any, choices: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{origin}: key '{key}' must be a string, got {type(value).__name__} {value!r}; use one of {', '.join(choices)}")
    if value not in choices:
        raise ConfigError(f"{origin}: key '{key}': {value!r} is not allowed{did_you_mean(value, choices)}; use one of {', '.join(choices)}")
    return value


def reject_unknown(origin: str, where: str, raw: Mapping[Any, Any], allowed: Sequence[str]) -> None:
    """Unknown key → one line with did-you-mean; ``where`` is the section's dotted path ("" at the top)."""
    for name in raw:
        if isinstance(name, str) and name in allowed:
            continue
        maybe = did_you_mean(str(name), allowed)
        if where:
            raise ConfigError(f"{origin}: unknown key '{where}.{name}'{maybe}; allowed keys in {where}: {', '.join(allowed)}")
        raise ConfigError(f"{origin}: unknown key {name!r}{maybe}; allowed keys: {', '.join(allowed)}")


def require_mapping(origin: str, where: str, value: Any, fix: str) -> None:
    """A section must be a mapping with string keys."""
    if not isinstance(value, Mapping):
        got = "nothing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{origin}: section '{where}' must be a mapping of keys, got {got}; {fix}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{origin}: section '{where}' has a non-string key {bad[0]!r}; quote it or use a key name (see README, Configuration)")


def check_value(origin: str, cls: type, name: str, value: Any) -> Any:
    """One top-level key of section ``cls`` checked on its own (a value from the environment or a flag)."""
    spec = section_specs(cls)[name]
    return spec.rule.check(origin, name, value, _example(name, spec))


def parse_section(origin: str, where: str, raw: Any, cls: type) -> Any:
    """``raw`` as an instance of section dataclass ``cls``, or one ConfigError line for its first problem.

    Order: not a mapping, unknown key, missing key, then each key in declaration order (absent
    keys take their default, or their derived default from the keys before them).
    """
    specs = section_specs(cls)
    required = [name for name, spec in specs.items() if spec.required]
    example = "{" + ", ".join(_example(n, specs[n]) for n in required) + "}" if required else ""
    require_mapping(origin, where, raw, f"e.g. {example}" if example else f"indent its keys under '{where}:'")
    reject_unknown(origin, where, raw, list(specs))
    for name in required:
        if name not in raw:
            raise ConfigError(f"{origin}: '{where}' is missing key '{name}'; add it, e.g. {_example(name, specs[name])} "
                              f"(required: {', '.join(required)})")
    values: dict[str, Any] = {}
    for name, spec in specs.items():
        dotted = f"{where}.{name}" if where else name
        if name in raw:
            values[name] = spec.rule.check(origin, dotted, raw[name], _example(name, spec))
        elif spec.derive is not None:
            values[name] = spec.derive(values)
        else:
            values[name] = spec.default
    return cls(**values)


__all__ = [
    "Choice", "Custom", "Flag", "ListOf", "NonNegativeInt", "Nullable", "Number", "PathStr", "PositiveInt", "RawSection",
    "Rule", "Spec", "check_choice", "check_value", "did_you_mean", "key", "parse_section", "reject_unknown",
    "require_mapping", "section_specs",
]
