"""The planner's prediction, carried by a written plan: the ``planned:`` section ``hal plan --search --write`` adds.

Why: the acceptance of a plan is its measured run against what the planner promised. ``hal train --profile``
draws the measured step beside the simulator fed with the measured compute (what differs there is
communication and waiting); the ``planned:`` section adds the planner's own timeline — the same simulator
with the inputs the cost model played from the profile — so the picture shows the promise, the schedule
and the run on one time axis. The section keeps the simulator's inputs, not its spans: a few numbers per
stage, however many micro-batches.

A plan edited after it was written no longer matches its prediction: ``parallel_digest`` says which
``parallel:`` section it was made for, and a mismatch is said, not drawn.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from hal.errors import ConfigError
from hal.parallel.config.plan import ParallelPlan

PER_STAGE = ("forward_s", "backward_s", "action_s", "host_forward_s", "host_backward_s", "host_action_s")
REQUIRED = ("forward_s", "backward_s")
SECTION_KEYS = ("by", "profile", "step_s", "schedule_s", "estimated", "parallel_digest", "simulate")
MAX_SECONDS = 1e6  # about 11 days for one stage's action or one step: beyond it a number is damage, not a plan
MAX_TEXT = 1024  # characters of the profile's description and of each estimated figure's
MAX_ESTIMATED = 256
FIX = "write the plan again with hal plan --search --write, or delete the planned: section"


def parallel_digest(plan: ParallelPlan) -> str:
    """A short digest of the plan's ``parallel:`` section, as ``ParallelPlan.to_dict`` spells it."""
    return hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def planned_section(plan: ParallelPlan, prediction: Any, profile: str) -> dict[str, Any]:
    """What ``write_plan`` adds: the prediction's headline numbers and the simulator's inputs it played."""
    inputs = {k: _plain(v) for k, v in prediction.simulated.items() if v is not None}
    return {"by": "hal plan --search", "profile": profile, "step_s": float(prediction.step_s),
            "schedule_s": float(prediction.schedule_s), "estimated": list(prediction.estimated),
            "parallel_digest": parallel_digest(plan), "simulate": inputs}


def _plain(value: Any) -> Any:
    """Floats and lists of floats as YAML writes them plainly (no numpy or tuple tags)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else float(value)


def profile_label(profile: str | None) -> str:
    """Where the prediction's numbers came from, as the section and the pictures say it."""
    return f"profile {profile}" if profile else "quick profile"


def mismatch_note(config: str) -> str:
    """What a command says where a plan's ``planned:`` section was written for another ``parallel:`` section."""
    return (f"{config}: planned: was written for another parallel: section (edited since hal plan --search wrote it); "
            "the planner's prediction is left out of the timeline")


@dataclass(frozen=True)
class Planned:
    """A checked ``planned:`` section; ``matches``: it was made for this run's ``parallel:`` section."""

    step_s: float
    profile: str
    estimated: tuple[str, ...]
    inputs: Mapping[str, Any]
    matches: bool


def read_planned(section: Any, plan: ParallelPlan, where: str) -> Planned | None:
    """The config's ``planned:`` section, checked against the plan's stages; None where the config has none.
    A malformed section is one ``ConfigError`` line naming the key: everything the replay and the drawing read
    is checked here, so a damaged section fails before a run, not after it."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: planned: must be a mapping (hal plan --search writes it); {FIX}")
    unknown = sorted(str(k) for k in set(section) - set(SECTION_KEYS))
    if unknown:
        raise ConfigError(f"{where}: planned: unknown key(s) {', '.join(unknown)}; {FIX}")
    inputs = section.get("simulate")
    if not isinstance(inputs, Mapping):
        raise ConfigError(f"{where}: planned.simulate: missing or not a mapping; {FIX}")
    unknown = sorted(str(k) for k in set(inputs) - {*PER_STAGE, "p2p_s", "virtual_stages", "chunk_share"})
    if unknown:
        raise ConfigError(f"{where}: planned.simulate: unknown key(s) {', '.join(unknown)}; {FIX}")
    matches = section.get("parallel_digest") == parallel_digest(plan)
    S = plan.num_stages
    for key in PER_STAGE:
        if key not in inputs:
            if key in REQUIRED:
                raise ConfigError(f"{where}: planned.simulate.{key}: missing; {FIX}")
            continue
        values = inputs[key]
        if not isinstance(values, list) or not all(_seconds(v) for v in values):
            raise ConfigError(f"{where}: planned.simulate.{key}: a list of seconds (finite, 0 to {MAX_SECONDS:g}) "
                              f"per stage; {FIX}")
        if matches and len(values) != S:
            raise ConfigError(f"{where}: planned.simulate.{key}: {len(values)} value(s) for {S} stage(s); {FIX}")
    for key, value in (("simulate.p2p_s", inputs.get("p2p_s", 0.0)), ("step_s", section.get("step_s")),
                       ("schedule_s", section.get("schedule_s", 0.0))):
        if not _seconds(value):
            raise ConfigError(f"{where}: planned.{key}: seconds (finite, 0 to {MAX_SECONDS:g}); {FIX}")
    profile = section.get("profile", "")
    if not isinstance(profile, str) or len(profile) > MAX_TEXT or not isinstance(section.get("by", ""), str):
        raise ConfigError(f"{where}: planned.profile and planned.by: text of at most {MAX_TEXT} characters; {FIX}")
    estimated = section.get("estimated") or []
    if (not isinstance(estimated, list) or len(estimated) > MAX_ESTIMATED
            or not all(isinstance(e, str) and len(e) <= MAX_TEXT for e in estimated)):
        raise ConfigError(f"{where}: planned.estimated: a list of the estimated figures' descriptions (at most "
                          f"{MAX_ESTIMATED}, {MAX_TEXT} characters each); {FIX}")
    planned = Planned(float(section["step_s"]), profile, tuple(estimated), dict(inputs), matches)
    if matches:  # what the simulator checks, checked here: the replay after the run must not be the first to fail
        _check_chunks(inputs, plan, where)
    return planned


def _seconds(value: Any) -> bool:
    """A number of seconds the simulator and the drawing can use (a huge int is refused, not overflowed)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        seconds = float(value)
    except OverflowError:
        return False
    return math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS


def _check_chunks(inputs: Mapping[str, Any], plan: ParallelPlan, where: str) -> None:
    V = inputs.get("virtual_stages", 1)
    if not isinstance(V, int) or isinstance(V, bool) or V != plan.virtual_stages:
        raise ConfigError(f"{where}: planned.simulate.virtual_stages: {V!r}, the plan has {plan.virtual_stages}; {FIX}")
    shares = inputs.get("chunk_share")
    if shares is None:
        return
    if (not isinstance(shares, list) or len(shares) != plan.num_stages
            or not all(isinstance(row, list) and len(row) == V and all(_share(x) for x in row)
                       and abs(sum(row) - 1.0) <= 1e-6 for row in shares)):
        raise ConfigError(f"{where}: planned.simulate.chunk_share: {plan.num_stages} row(s) of {V} shares, each "
                          f"row summing to 1; {FIX}")


def _share(value: Any) -> bool:
    return _seconds(value) and float(value) <= 1.0
