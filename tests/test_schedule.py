"""The learning-rate schedule (``lr_factor``) and the fp16 loss scale (``LossScale``), against hand-computed
values. Unit tests: no Horovod, no data."""
import math

import pytest

from hvd_partialfc.run.parts import LossScale
from hvd_partialfc.run.step import lr_factor


# --- lr_factor(step, total, warmup, schedule, min_ratio, power) ------------------------------------------

@pytest.mark.parametrize("schedule", ["cosine", "poly", "constant"])
def test_warmup_is_linear_from_one_step_to_the_peak(schedule):
    # warmup 4: (step + 1) / 4 at steps 0..3, whatever follows; step 4 starts the decay at the peak
    got = [lr_factor(s, 20, 4, schedule, 0.1, 2.0) for s in range(5)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0], abs=1e-12)


def test_cosine_at_chosen_points():
    # no warmup, 8 steps: progress = step / 8; factor = min + (1 - min) * (1 + cos(pi * progress)) / 2
    f = [lr_factor(s, 8, 0, "cosine", 0.1, 2.0) for s in (0, 2, 4, 6, 8)]
    c = math.sqrt(0.5) / 2                      # (1 + cos(pi/4)) / 2 = 1/2 + sqrt(2)/4
    assert f == pytest.approx([1.0, 0.1 + 0.9 * (0.5 + c), 0.1 + 0.9 * 0.5, 0.1 + 0.9 * (0.5 - c), 0.1], abs=1e-12)
    assert lr_factor(4, 8, 0, "cosine", 0.1, 2.0) == pytest.approx(0.55, abs=1e-12)


def test_cosine_progress_counts_from_the_end_of_warmup():
    # warmup 2, total 12: step 7 is halfway through the 10 decay steps
    assert lr_factor(7, 12, 2, "cosine", 0.0, 2.0) == pytest.approx(0.5, abs=1e-12)
    assert lr_factor(2, 12, 2, "cosine", 0.0, 2.0) == pytest.approx(1.0, abs=1e-12)
    assert lr_factor(12, 12, 2, "cosine", 0.0, 2.0) == pytest.approx(0.0, abs=1e-12)


def test_poly_at_chosen_points():
    # total 10, power 2: (1 - progress)^2
    assert lr_factor(5, 10, 0, "poly", 0.0, 2.0) == pytest.approx(0.25, abs=1e-12)
    assert lr_factor(8, 10, 0, "poly", 0.0, 2.0) == pytest.approx(0.04, abs=1e-12)
    assert lr_factor(8, 10, 0, "poly", 0.2, 2.0) == pytest.approx(0.2 + 0.8 * 0.04, abs=1e-12)
    # the power is used: 3 gives (0.5)^3, 1 is linear
    assert lr_factor(5, 10, 0, "poly", 0.0, 3.0) == pytest.approx(0.125, abs=1e-12)
    assert lr_factor(3, 10, 0, "poly", 0.0, 1.0) == pytest.approx(0.7, abs=1e-12)


def test_constant_stays_at_the_peak():
    assert [lr_factor(s, 10, 0, "constant", 0.3, 2.0) for s in (0, 5, 9, 10, 50)] == [1.0] * 5
    assert lr_factor(1, 10, 3, "constant", 0.3, 2.0) == pytest.approx(2 / 3, abs=1e-12)   # warmup still applies


@pytest.mark.parametrize("schedule", ["cosine", "poly"])
def test_min_ratio_at_the_end_and_clamped_past_it(schedule):
    # the last step's factor is above the floor, step == total reaches it, later steps stay on it
    assert lr_factor(9, 10, 0, schedule, 0.05, 2.0) > 0.05 + 1e-3
    for step in (10, 11, 15, 1000):
        assert lr_factor(step, 10, 0, schedule, 0.05, 2.0) == pytest.approx(0.05, abs=1e-12)
    # and the factor never rises again after the peak
    f = [lr_factor(s, 10, 2, schedule, 0.05, 2.0) for s in range(2, 40)]
    assert all(a >= b for a, b in zip(f, f[1:]))


# --- LossScale(enabled, init, growth_interval): .scale, .good_steps, .update(finite) ---------------------

def test_scale_doubles_after_exactly_growth_interval_finite_updates():
    ls = LossScale(True, init=8.0, growth_interval=3)
    assert (ls.scale, ls.good_steps) == (8.0, 0)
    scales = []
    for _ in range(7):
        ls.update(True)
        scales.append(ls.scale)
    # doubles at the 3rd and 6th consecutive finite update, not before, not in between
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert ls.good_steps == 7


def test_non_finite_update_halves_and_restarts_the_count():
    ls = LossScale(True, init=8.0, growth_interval=3)
    ls.update(True), ls.update(True)           # one short of growing
    ls.update(False)
    assert (ls.scale, ls.good_steps) == (4.0, 0)
    ls.update(True), ls.update(True)           # the count restarted: two are not enough ...
    assert ls.scale == 4.0
    ls.update(True)                            # ... the third is
    assert ls.scale == 8.0


def test_back_off_stops_at_one():
    ls = LossScale(True, init=2.0, growth_interval=3)
    ls.update(False)
    assert ls.scale == 1.0
    ls.update(False)
    assert ls.scale == 1.0


def test_disabled_scale_is_one_whatever_happens():
    ls = LossScale(False, init=8.0, growth_interval=1)
    assert ls.scale == 1.0
    for finite in (True, True, False, True, False, False, True):
        ls.update(finite)
        assert ls.scale == 1.0
    assert ls.good_steps == 0
