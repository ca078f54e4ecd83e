"""Orders played from measured stage times (``parallel.order: measured``): the plays, the choice, the config key.

The engine runs of these orders (equal to one device) are in tests/ranks/test_engine.py ("timed ..." plans);
``hal train`` with ``order: measured`` in tests/cli/test_measured_order.py.
"""
from __future__ import annotations

import itertools
import math

import pytest

from hal.errors import ConfigError
from hal.parallel.config.model import ModelConfig
from hal.parallel.config.plan import parse_plan, validate_plan
from hal.parallel.loop.measured_order import choose, due, skipped, stage_times, wanted
from hal.parallel.schedules import Kind, get_schedule, simulate
from hal.parallel.schedules.stage_times import StageTimes, fit_variants, unit_times

from ..ranks.test_engine import LINK_HEAVY_2X2, TIMED, ZBV_TIMED

PLAYED = ("zero-bubble", "interleaved-zero-bubble", "zbv")


def _chunks(name: str) -> int:
    return 2 if get_schedule(name).interleaved else 1


def _orders(schedule, S: int, M: int, V: int) -> list:  # type: ignore[no-untyped-def]
    return [schedule.compute_order(S, M, s, V) for s in range(S)]


def _grid(S: int, V: int) -> list[StageTimes]:
    """Stage times a real plan may have: even, a slow first stage, uneven layers, slow links, a small W."""
    out = []
    for weights, speeds, link in itertools.product((1.0, 0.3), ((1, 1, 1, 1), (3, 1, 1, 1), (1, 1.5, 2, 2.5)), (0.0, 0.4, 2.0)):
        f = [[speeds[s] / V] * V for s in range(S)]
        out.append(StageTimes.of(f, f, [[weights * speeds[s] / V] * V for s in range(S)],
                                 [link] * (S - 1) + ([link] if V > 1 else [])))
    return out


@pytest.mark.parametrize("name", PLAYED)
def test_unit_times_play_the_unit_order(name: str) -> None:
    """``timed(unit_times)`` plays the same rules with the same times: the order every earlier release ran."""
    schedule, V = get_schedule(name), _chunks(name)
    for S, M in ((2, 4), (3, 6), (4, 8)):
        assert _orders(schedule.timed(unit_times(S, V)), S, M, V) == _orders(schedule, S, M, V), (S, M)


@pytest.mark.parametrize("name", PLAYED)
def test_measured_order_never_predicted_slower_and_keeps_the_memory_bound(name: str) -> None:
    """On every time set of a grid the measured order's simulated step is at most the unit order's, and its peak
    in-flight activations never exceed the unit order's (the schedule's bound); it is faster somewhere."""
    schedule, V = get_schedule(name), _chunks(name)
    faster = 0
    for S, M in ((2, 8), (4, 8)):
        for times in _grid(S, V):
            unit = simulate(schedule, S, M, times=times, virtual_stages=V)
            timed = simulate(schedule.timed(times), S, M, times=times, virtual_stages=V)
            assert timed.makespan <= unit.makespan + 1e-9, (S, M, times)
            assert all(t <= u for t, u in zip(timed.peak_in_flight, unit.peak_in_flight)), (timed.peak_in_flight, unit.peak_in_flight)
            faster += timed.makespan < unit.makespan - 1e-9
    if name != "zero-bubble":  # ZB-H1 under 1F1B's bound has no room on this grid (docs/schedules.md)
        assert faster > 0


def test_link_heavy_times_change_the_order_and_gain() -> None:
    """Two stages with transfers 3x a chunk's compute: the V's unit order waits on the links, the timed play does not."""
    times = StageTimes.of(**LINK_HEAVY_2X2)
    zbv = get_schedule("zbv")
    assert _orders(zbv.timed(times), 2, 8, 2) != _orders(zbv, 2, 8, 2)
    unit = simulate(zbv, 2, 8, times=times, virtual_stages=2).makespan
    timed = simulate(zbv.timed(times), 2, 8, times=times, virtual_stages=2).makespan
    assert unit / timed > 1.15, (unit, timed)


@pytest.mark.parametrize("plan", sorted(TIMED))
def test_engine_test_times_give_a_different_order(plan: str) -> None:
    """The engine equivalence runs of timed orders run an order the unit play does not (else they prove nothing
    new) — except ZB-H1, whose timed run exercises the transfers derived from a played order."""
    from ..ranks.test_engine import PLANS

    raw = PLANS[plan]
    schedule = get_schedule(raw["schedule"])
    S, M, V = len(raw["stages"]), raw["micro_batches"], _chunks(raw["schedule"])
    times = StageTimes.of(**TIMED[plan][0])
    timed = schedule.timed(times)
    if raw["schedule"] == "zero-bubble":
        assert timed.program(S, M, 0) != schedule.program(S, M, 0)  # the round-derived transfers
    else:
        assert _orders(timed, S, M, V) != _orders(schedule, S, M, V), plan
    assert plan != ZBV_TIMED or TIMED[plan][1] == 0


def test_fit_variants_spare_the_busiest_stage() -> None:
    times = StageTimes.of([[1.0], [3.0], [1.0]], [[1.0], [3.0], [1.0]], [[1.0], [3.0], [1.0]])
    assert fit_variants(times) == [(False, False, False), (True, True, True), (True, False, True)]


def test_stage_times_validation_and_hops() -> None:
    with pytest.raises(ValueError, match="one row per stage"):
        StageTimes(((1.0,), (1.0, 1.0)), ((1.0,), (1.0,)), ((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="finite"):
        StageTimes.of([[math.nan]], [[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="at least 0"):
        StageTimes.of([[1.0]], [[-1.0]], [[1.0]])
    with pytest.raises(ValueError, match="links has 3 values"):
        StageTimes.of([[1.0]] * 2, [[1.0]] * 2, [[1.0]] * 2, [1.0, 1.0, 1.0])
    t = StageTimes.of([[1.0]] * 3, [[2.0]] * 3, [[0.5]] * 3, [0.1, 0.2, 0.3])
    assert (t.hop(0, 1), t.hop(2, 1), t.hop(2, 0), t.hop(1, 1)) == (0.1, 0.2, 0.3, 0.0)
    assert t.cost(Kind.BACKWARD, 1) == 2.5
    assert StageTimes.of([[1.00000001]], [[1.0]], [[1.0]]) == StageTimes.of([[1.0]], [[1.0]], [[1.0]])  # rounded alike
    with pytest.raises(ValueError, match="fixed order"):
        get_schedule("1f1b").timed(t)
    with pytest.raises(ValueError, match="stage times for 3 stages"):
        get_schedule("zero-bubble").timed(t).compute_order(2, 4, 0)


def test_stage_times_from_rank_records_take_the_slowest_rank() -> None:
    """Two ranks on stage 0 (dp2): the slower one's figures; a whole backward counts as I; the wrap link of a loop
    placement is the mean of the others."""
    records = [{"stage": 0, "actions": {"F0": 1.0, "I0": 2.0, "W0": 1.0, "F1": 1.0, "I1": 2.0, "W1": 1.0}, "link": 0.5},
               {"stage": 0, "actions": {"F0": 1.5, "I0": 2.0, "W0": 0.5, "F1": 1.0, "I1": 2.0, "W1": 1.0}, "link": 0.7},
               {"stage": 1, "actions": {"F0": 1.0, "B0": 3.0, "F1": 1.0, "I1": 2.0, "W1": 1.0}, "link": None}]
    times = stage_times(records, 2, 2, "loop")
    assert times.forward == ((1.5, 1.0), (1.0, 1.0))
    assert times.backward_input == ((2.0, 2.0), (3.0, 2.0)) and times.backward_weight == ((1.0, 1.0), (0.0, 1.0))
    assert times.links == (0.7, 0.7)
    assert stage_times(records, 2, 2, "v").links == (0.7,)


def test_choose_keeps_the_unit_order_when_no_faster_one_is_found() -> None:
    even = StageTimes.of([[1.0]] * 3, [[1.0]] * 3, [[1.0]] * 3, [0.0, 0.0])
    kept = choose(get_schedule("zero-bubble"), even, 6, step=3)
    assert kept.chosen == "unit" and kept.schedule.times is None and "stays" in kept.text()
    heavy = StageTimes.of(**LINK_HEAVY_2X2)
    picked = choose(get_schedule("zbv"), heavy, 8, step=3)
    assert picked.chosen == "measured" and picked.measured_s < picked.unit_s and "from step 3" in picked.text()
    assert picked.to_dict()["links_s"] == [3.0, 3.0]


def test_order_key_is_checked() -> None:
    model = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden_size=64,
                        max_seq_len=16)
    stages = [{"backend": "cpu", "devices": 1, "layers": 1}] * 2
    with pytest.raises(ConfigError, match="parallel.order: measured .* schedule 1f1b has a fixed order"):
        validate_plan(parse_plan({"schedule": "1f1b", "order": "measured", "micro_batches": 2, "stages": stages}), model,
                      world_size=2, check_backends=False)
    with pytest.raises(ConfigError, match="order"):
        parse_plan({"schedule": "zero-bubble", "order": "fastest", "stages": stages})
    plan = parse_plan({"schedule": "zero-bubble", "order": "measured", "micro_batches": 2, "stages": stages})
    validate_plan(plan, model, world_size=2, check_backends=False)
    assert plan.order == "measured" and type(plan).from_dict(plan.to_dict()).order == "measured"
    # the default: measured where the order is played, the fixed order elsewhere (no refusal)
    for schedule, calibrates in (("1f1b", False), ("zbv", True), ("dualpipev", False), ("interleaved-zero-bubble", True)):
        default = parse_plan({"schedule": schedule, "micro_batches": 4, "stages": stages})
        assert default.order == "auto" and wanted(default) is calibrates, schedule
        assert due(default, 0, 5, 1) is calibrates and not due(default, 0, 2, 1)
        assert skipped(default, 0, 2) is None  # auto asks nothing of a short run
    assert not wanted(parse_plan({"schedule": "zbv", "order": "unit", "micro_batches": 4, "stages": stages}))
