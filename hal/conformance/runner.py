"""Run conformance cases against one backend: build the context, pick the cases, run them with progress.

The runner never judges numbers (cases do); it turns whatever a case does into one recorded result:
the case's ``Outcome``, or an ``error`` outcome with the exception's one-line message (the full
traceback is kept for the JSON report). A suite whose module fails to import or whose ``cases()``
raises becomes one ``error`` result named ``<suite>::(collect)``, so the other suites still run and
the run still fails. Every case starts from the same seed, so a ``-k``-filtered run reproduces the
numbers of the full run.

Selecting cases (``-k``): comma-separated patterns, a case is kept when ANY pattern matches it. A
pattern with a glob character (``*?[``) must match the whole id (``suite::name``) or the whole name
(``fnmatch``, case-sensitive); any other pattern is a substring of the id. A pattern that matches
no case is an error (it is almost always a typo).
"""
from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import importlib
import platform
import random
import shutil
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Sequence, TextIO

import torch

from hal.config.limits import SEED, check_local_ranks
from hal.conformance.cases import FAILING, SELECTED_OPTION, Case, Context, Outcome
from hal.conformance.suite_names import SUITES
from hal.conformance.verdicts.host_watch import FALLBACK_WARNING
from hal.conformance.verdicts.profiles import looser_than
from hal.errors import ConfigError, HalError

STATUSES: tuple[str, ...] = ("pass", "fail", "error", "skip", "unsupported")
DEFAULT_SEED = 1234
CPU_WORLD_SIZE = 4  # CPU "devices" for collectives/training: processes on gloo
COLLECT = "(collect)"  # the case name of a suite that could not produce its cases


# --- results ------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """One case's recorded result: identity, the outcome, and the traceback when it raised."""

    id: str
    suite: str
    name: str
    outcome: Outcome
    description: str = ""
    tags: tuple[str, ...] = ()
    traceback: str | None = None

    @property
    def status(self) -> str:
        return self.outcome.status

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "suite": self.suite, "name": self.name, "description": self.description,
               "tags": list(self.tags), **self.outcome.to_dict()}
        out["seconds"] = round(self.outcome.seconds, 4)
        if self.traceback:
            out["traceback"] = self.traceback
        return out


@dataclass
class RunResult:
    """A finished run: metadata (backend, device, versions, timing) and every case's result."""

    meta: dict[str, Any]
    results: list[CaseResult]

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in FAILING]

    @property
    def exit_code(self) -> int:
        """0 when no case failed or errored, 1 otherwise."""
        return 1 if self.failed else 0

    def counts(self) -> dict[str, Any]:
        """Per suite (in run order) and in total: cases per status, case count and seconds."""
        by_suite: dict[str, dict[str, Any]] = {s: _empty_counts() for s in self.meta.get("suites", [])}
        total = _empty_counts()
        for r in self.results:
            for bucket in (by_suite.setdefault(r.suite, _empty_counts()), total):
                bucket[r.status] += 1
                bucket["total"] += 1
                bucket["seconds"] = round(bucket["seconds"] + r.outcome.seconds, 4)
        return {"by_suite": by_suite, "total": total}

    def to_dict(self) -> dict[str, Any]:
        """The results.json document (see ``conformance.reports.report`` for the schema)."""
        from hal.conformance.reports.results import json_safe

        return json_safe({**self.meta, "verdict": "fail" if self.failed else "pass", "counts": self.counts(),
                          "cases": [r.to_dict() for r in self.results]})


def _empty_counts() -> dict[str, Any]:
    return {**{s: 0 for s in STATUSES}, "total": 0, "seconds": 0.0}


# --- context ------------------------------------------------------------------------------------------


def build_context(backend: str | None = None, *, world_size: int | None = None, seed: int = DEFAULT_SEED,
                  options: dict[str, Any] | None = None, launch: Callable[..., Any] | None = None) -> tuple[Context, str]:
    """The Context for ``backend`` (None: HAL_BACKEND or auto) on device 0, and why that backend.

    ``max_world_size``: every device on an accelerator (``world_size`` may ask for fewer), 4 CPU
    processes on cpu unless ``world_size`` says otherwise. Raises a one-line HalError for an unknown or
    unavailable backend and a bad world size. ``launch`` starts the multi-rank jobs (collectives,
    training): ``hal.launch.run_function``, from the floor above; without it those cases error.
    """
    from hal.config import load_config
    from hal.selection import choose_backend

    if not 0 <= seed <= SEED.maximum:
        raise ConfigError(f"--seed {seed}: give a whole number from 0 to {SEED.maximum} ({SEED.why})")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size {world_size}: give a positive number of ranks")
    config = load_config(None, overrides={"backend": backend})
    chosen, reason = choose_backend(config.backend)
    if chosen.device_type == "cpu":
        if world_size is not None:
            check_local_ranks(world_size, "--world-size")  # every rank a process of this host
        slots = world_size or CPU_WORLD_SIZE
    else:
        count = chosen.device_count()
        if world_size is not None and world_size > count:
            raise ConfigError(f"--world-size {world_size}: backend '{chosen.name}' has {count} device(s) here; "
                              f"give at most {count}")
        slots = world_size or count
    chosen.set_device(0)
    ctx = Context(backend=chosen, device=chosen.device(0), capabilities=chosen.capabilities(0), seed=seed,
                  max_world_size=slots, options=dict(options or {}), launch=launch)
    return ctx, reason


# --- which cases ----------------------------------------------------------------------------------------


def parse_suites(spec: str | Sequence[str] | None) -> list[str]:
    """Suite names from ``--suite`` (comma-separated; None = all). A dotted name is a module path
    (your own suite module exposing ``cases(ctx)``); anything else must be a known suite."""
    if spec is None:
        return list(SUITES)
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            raise ConfigError(f"--suite {spec!r}: empty suite name; give comma-separated names from {', '.join(SUITES)}")
        if item not in SUITES and "." not in item:
            raise ConfigError(f"--suite: unknown suite {item!r}; use one or more of {', '.join(SUITES)} "
                              "(comma-separated) or a module path exposing cases(ctx)")
        if item not in names:
            names.append(item)
    return names


def parse_patterns(spec: str | Sequence[str] | None) -> list[str]:
    """``-k`` patterns (comma-separated); None or empty means every case."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    patterns = [i.strip() for i in items]
    if not patterns or any(not p for p in patterns):
        raise ConfigError(f"-k {spec!r}: empty pattern; give comma-separated substrings or globs of case ids")
    return patterns


def matches(case_id: str, pattern: str) -> bool:
    """Glob patterns match the whole id or the whole name; other patterns are substrings of the id."""
    if any(ch in pattern for ch in "*?["):
        name = case_id.split("::", 1)[-1]
        return fnmatch.fnmatchcase(case_id, pattern) or fnmatch.fnmatchcase(name, pattern)
    return pattern in case_id


def select(cases: Sequence[Case], patterns: Sequence[str]) -> list[Case]:
    """The cases any pattern matches, in order; a pattern matching nothing is a ConfigError."""
    if not patterns:
        return list(cases)
    unmatched = [p for p in patterns if not any(matches(c.id, p) for c in cases)]
    if unmatched:
        raise ConfigError(f"-k: {', '.join(repr(p) for p in unmatched)} matches none of the {len(cases)} case(s) "
                          "collected; see 'hal conformance run --list'")
    return [c for c in cases if any(matches(c.id, p) for p in patterns)]


@dataclass
class Plan:
    """What a run will do: the selected cases, plus suites that failed to produce cases."""

    suites: list[str]
    patterns: list[str]
    cases: list[Case]
    problems: list[CaseResult] = field(default_factory=list)
    collected: int = 0  # cases before -k


def _module_path(suite: str) -> str:
    return f"hal.conformance.suites.{suite}" if suite in SUITES else suite


def _suite_label(suite: str) -> str:
    return suite.rsplit(".", 1)[-1]


def _problem(suite: str, exc: BaseException, what: str) -> CaseResult:
    label = _suite_label(suite)
    reason = f"{what}: {one_line(exc)}"
    return CaseResult(f"{label}::{COLLECT}", label, COLLECT, Outcome("error", reason=reason),
                      description=f"collecting the {label} suite", traceback=traceback.format_exc())


def collect(ctx: Context, suites: Sequence[str], skip: Collection[str] = ()) -> tuple[list[Case], list[CaseResult], list[str]]:
    """Every case of ``suites`` (module imported lazily), a problem result per suite that failed, and the
    suite labels in order (a module path's label is the suite its cases declare). A suite in ``skip`` keeps its
    label and builds no case."""
    cases: list[Case] = []
    problems: list[CaseResult] = []
    labels: list[str] = []
    seen: set[str] = set()
    for suite in suites:
        labels.append(_suite_label(suite))
        if suite in skip:
            continue
        path = _module_path(suite)
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (path == exc.name or path.startswith(exc.name + ".")):
                where = f"{path.replace('.', '/')}.py is missing" if suite in SUITES else "no such module"
                raise HalError(f"suite {suite!r} cannot be loaded: {where}") from None
            problems.append(_problem(suite, exc, f"importing {path} failed"))
            continue
        except Exception as exc:  # the suite's own bug: recorded, the other suites still run
            problems.append(_problem(suite, exc, f"importing {path} failed"))
            continue
        make: Callable[[Context], Iterable[Case]] | None = getattr(module, "cases", None)
        if not callable(make):
            raise HalError(f"suite {suite!r}: module {path} has no cases(ctx) function")
        try:
            made = list(make(ctx))
            bad = [c for c in made if not isinstance(c, Case)]
            if bad:
                raise TypeError(f"cases() returned {type(bad[0]).__name__} objects, not conformance.cases.Case")
            counts = Counter(c.id for c in made)
            dupes = sorted(i for i, n in counts.items() if n > 1 or i in seen)
            if dupes:
                raise ValueError(f"{len(dupes)} duplicate case id(s), e.g. {dupes[0]}")
        except Exception as exc:
            problems.append(_problem(suite, exc, f"{path}.cases() failed"))
            continue
        seen.update(c.id for c in made)
        cases.extend(made)
        if suite not in SUITES and made:
            labels[-1:] = [c.suite for c in made]
    return cases, problems, list(dict.fromkeys(labels))


def _suites_named_by(patterns: Sequence[str]) -> set[str] | None:
    """The built-in suites ``-k`` can select from when every pattern starts with one by name (``collectives::...``):
    the others are not collected (their cases cost seconds to build: the ops suite loads the kernels, onnx reads
    its tests). None: a pattern may match any suite."""
    named: set[str] = set()
    for pattern in patterns:
        suite, sep, _ = pattern.partition("::")
        if not sep or suite not in SUITES:
            return None
        named.add(suite)
    return named or None


def plan(ctx: Context, suites: str | Sequence[str] | None = None, patterns: str | Sequence[str] | None = None) -> Plan:
    """Collect the chosen suites and apply ``-k``; bad input raises a one-line HalError."""
    names = parse_suites(suites)
    pats = parse_patterns(patterns)
    named = _suites_named_by(pats)
    unselectable = [n for n in names if named is not None and n in SUITES and n not in named]  # still a row (of zeros)
    cases, problems, labels = collect(ctx, names, skip=unselectable)
    try:
        chosen = select(cases, pats)
    except ConfigError as exc:
        if not problems:
            raise
        broken = "; ".join(f"{p.suite}: {p.outcome.reason}" for p in problems)
        raise ConfigError(f"{exc} (suites that produced no cases: {broken})") from None
    return Plan(labels, pats, chosen, problems, len(cases))


def plan_from_cases(cases: Sequence[Case], patterns: str | Sequence[str] | None = None) -> Plan:
    """A plan over cases given directly (embedding, tests): suites in order of first appearance."""
    pats = parse_patterns(patterns)
    suites = list(dict.fromkeys(c.suite for c in cases))
    return Plan(suites, pats, select(cases, pats), [], len(cases))


# --- running -------------------------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` — what the summary table shows for an error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _seed(ctx: Context) -> None:
    """The host generator and the backend's own: ``torch.manual_seed`` would also queue a lazy seed for every
    uninitialised device module (recording a stack each time: a fifth of a small case's time on the CPU)."""
    random.seed(ctx.seed)
    torch.random.default_generator.manual_seed(ctx.seed)
    ctx.backend.manual_seed_all(ctx.seed)


def run_case(ctx: Context, case: Case) -> CaseResult:
    """Run one case from the run's seed; time it (device synchronized); exceptions become ``error``."""
    _seed(ctx)
    tb: str | None = None
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as heard:  # under the caller's filters: what they would show
            outcome = case.run(ctx)
            ctx.backend.synchronize()
        for w in heard:  # shown as they would have been; the runtime's host fallback also noted on the case
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        fell_back = sorted({m.group(1) for w in heard if (m := FALLBACK_WARNING.search(str(w.message)))})
        if fell_back and isinstance(outcome, Outcome):
            outcome = dataclasses.replace(outcome, data={**(outcome.data or {}), "host_fallback": fell_back})
        if not isinstance(outcome, Outcome):
            raise TypeError(f"the case returned {type(outcome).__name__}, not an Outcome")
        if outcome.status not in STATUSES:
            raise ValueError(f"the case returned status {outcome.status!r}; use one of {', '.join(STATUSES)}")
    except (Exception, SystemExit) as exc:
        tb = traceback.format_exc()
        outcome = Outcome("error", reason=one_line(exc))
    seconds = time.perf_counter() - start
    return CaseResult(case.id, case.suite, case.name, dataclasses.replace(outcome, seconds=seconds),
                      case.description, tuple(case.tags), tb)


class Progress:
    """Case i/N, pass/fail counts, elapsed and the current id: in place on a terminal (failures printed
    above it as they happen), a line per case otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.counts = {s: 0 for s in STATUSES}
        self.start_time = time.perf_counter()
        self.width = len(str(total))

    def _prefix(self, index: int) -> str:
        c = self.counts
        elapsed = time.perf_counter() - self.start_time
        return (f"[{index:>{self.width}}/{self.total}] pass {c['pass']} fail {c['fail']} error {c['error']} "
                f"{elapsed:6.1f}s")

    def start(self, index: int, case_id: str) -> None:
        if self.tty:
            line = f"{self._prefix(index)}  {case_id}"
            columns = shutil.get_terminal_size((120, 20)).columns
            self.stream.write("\r" + line[: max(20, columns - 1)] + "\x1b[K")
            self.stream.flush()

    def done(self, index: int, result: CaseResult) -> None:
        self.counts[result.status] += 1
        if self.tty and result.status in FAILING:  # failures stay on screen above the redrawn line
            self.stream.write(f"\r\x1b[K{result.status} {result.id}: {result.outcome.reason}\n")
            self.stream.flush()
        if not self.tty:
            reason = f"  ({result.outcome.reason})" if result.status != "pass" and result.outcome.reason else ""
            self.stream.write(f"[{index:>{self.width}}/{self.total}] {result.status:<11} "
                              f"{result.outcome.seconds:7.3f}s {result.id}{reason}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _meta(ctx: Context, backend_reason: str, the_plan: Plan, started: datetime.datetime) -> dict[str, Any]:
    from hal.conformance.reports.results import KIND, SCHEMA_VERSION

    backend = ctx.backend
    try:
        from importlib.metadata import version

        hal_version = version("hetero-hal")
    except Exception:  # not installed as a distribution (a plain checkout on PYTHONPATH)
        hal_version = None
    return {
        "schema": SCHEMA_VERSION, "kind": KIND,
        "backend": backend.name, "backend_reason": backend_reason,
        "device": {"type": ctx.device.type, "index": ctx.device.index, "name": backend.device_name(0)},
        "verification": backend.verification,
        "verified_on_hardware": backend.hardware_verification is not None,
        "standin": backend.standin,  # "stand-in: host-backed, not hardware" on a vendor's stand-in, else None
        "capabilities": ctx.capabilities.to_dict(),
        "torch": torch.__version__, "python": platform.python_version(), "hal_version": hal_version,
        "host": platform.node(), "platform": platform.platform(),
        "started": started.isoformat(timespec="seconds"),
        "seed": ctx.seed, "max_world_size": ctx.max_world_size, "verdict_profile": ctx.verdict,
        "verdict_profile_looser": [x.line(ctx.verdict) for x in looser_than(ctx.verdict)],
        "suites": list(the_plan.suites), "patterns": list(the_plan.patterns),
        "collected": the_plan.collected,
    }


def execute(ctx: Context, the_plan: Plan, *, backend_reason: str = "", progress: bool = True,
            stream: TextIO | None = None) -> RunResult:
    """Run the plan's cases in order (problems recorded first) and return the result with metadata."""
    started = datetime.datetime.now(datetime.timezone.utc).astimezone()
    t0 = time.perf_counter()
    # the selection, for suites whose cases share a job (collectives): the job then runs only what is selected
    ctx = dataclasses.replace(ctx, options={**ctx.options, SELECTED_OPTION: frozenset(c.id for c in the_plan.cases)})
    results: list[CaseResult] = list(the_plan.problems)
    bar = Progress(len(the_plan.cases), stream) if progress else None
    try:
        for index, case in enumerate(the_plan.cases, 1):
            if bar:
                bar.start(index, case.id)
            result = run_case(ctx, case)
            results.append(result)
            if bar:
                bar.done(index, result)
    finally:
        if bar:
            bar.close()
    meta = _meta(ctx, backend_reason, the_plan, started)
    meta["wall_seconds"] = round(time.perf_counter() - t0, 3)
    return RunResult(meta, results)


def run(backend: str | None = None, *, suites: str | Sequence[str] | None = None,
        patterns: str | Sequence[str] | None = None, world_size: int | None = None, seed: int = DEFAULT_SEED,
        options: dict[str, Any] | None = None, progress: bool = True, stream: TextIO | None = None,
        launch: Callable[..., Any] | None = None) -> RunResult:
    """Build the context, plan and execute: ``hal conformance run`` without the files."""
    ctx, reason = build_context(backend, world_size=world_size, seed=seed, options=options, launch=launch)
    return execute(ctx, plan(ctx, suites, patterns), backend_reason=reason, progress=progress, stream=stream)
