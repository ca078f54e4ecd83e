"""Parity's statistics against closed forms, and its verdict on curves built to sit on each side of each line."""
from __future__ import annotations

import math

import pytest

from hal.conformance.parity import stats
from hal.conformance.parity.band import Band
from hal.conformance.parity.runs import Curve
from hal.conformance.parity.verdict import convergence, grad_norms, loss_band, steps_to


@pytest.mark.parametrize("t", [-3.0, -0.7, 0.0, 0.4, 1.0, 2.5, 9.0])
def test_student_t_tail_matches_its_closed_forms(t: float) -> None:
    assert stats.t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert stats.t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(t * t + 2)), abs=1e-12)


def test_welch_says_which_way_and_how_sure() -> None:
    slower = stats.welch([50.0, 52.0, 51.0], [40.0, 41.0, 39.0, 40.5])
    assert slower.p_greater < 0.01 and slower.p_less > 0.99
    same = stats.welch([40.0, 41.0], [40.0, 41.0, 39.0, 40.5])
    assert same.p_greater > 0.05 and same.p_less > 0.05
    assert stats.welch([40.0, 40.0], [40.0, 40.0, 40.0, 40.0]).p_less == 1.0  # identical runs: nothing to see
    assert stats.welch([39.0, 39.0], [40.0, 40.0, 40.0, 40.0]).p_less == 0.0  # no spread can explain a shift


def _band(curves: list[list[float]]) -> Band:
    return Band("cpu", "host", list(range(len(curves))), [Curve(i, c, [1.0] * len(c)) for i, c in enumerate(curves)])


def test_the_loss_band_is_the_larger_of_one_percent_and_three_sigma() -> None:
    band = _band([[2.0] * 30, [2.0] * 30, [2.0] * 30, [2.0] * 30])  # no spread: the 1 % floor, ±0.02
    assert band.width(10) == pytest.approx(0.02)
    inside = Curve(0, [2.0] * 10 + [2.019] * 20, [1.0] * 30)
    outside = Curve(1, [2.0] * 10 + [2.021] + [2.0] * 19, [1.0] * 30)
    assert loss_band(band, [inside], warmup=5).passed
    check = loss_band(band, [inside, outside], warmup=5)
    assert not check.passed and check.numbers["worst_step"] == 10 and check.numbers["worst_seed"] == 1
    early = Curve(1, [9.0] * 5 + [2.0] * 25, [1.0] * 30)  # warm-up steps are not judged
    assert loss_band(band, [early], warmup=5).passed


def test_gradient_norms_within_ten_percent_or_three_sigma_of_the_reference() -> None:
    band = _band([[2.0] * 20] * 4)
    ok = Curve(0, [2.0] * 20, [1.09] * 20)
    off = Curve(0, [2.0] * 20, [1.0] * 12 + [1.2] + [1.0] * 7)
    assert grad_norms(band, [ok], warmup=5).passed
    assert not grad_norms(band, [off], warmup=5).passed


def test_converging_faster_is_as_suspect_as_slower() -> None:
    ref = [[3.0 - 0.02 * t + 0.001 * s for t in range(100)] for s in range(4)]
    band = _band(ref)
    same = [Curve(s, ref[s], [1.0] * 100) for s in range(2)]
    faster = [Curve(s, [x - 0.2 for x in ref[s]], [1.0] * 100) for s in range(2)]
    assert convergence(band, same, 100).passed
    check = convergence(band, faster, 100)
    assert not check.passed and "faster" in check.summary
    assert steps_to([5.0] * 20, 1.0) is None


def test_the_cli_names_every_planted_fault_as_the_faults_module_does() -> None:
    from hal.cli.conformance.parity import FAULT_HELP
    from hal.conformance.parity.faults import FAULTS

    assert FAULT_HELP == {name: what for name, (what, _) in FAULTS.items()}
