"""Tests of hdamoe_env.decisions.quality: the matched-quality search over the gating scale on
constructed retention curves (the probe on a real env is tested in app/test_matched.py)."""

from __future__ import annotations

import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.quality import DEFAULT_SCALE_GRID, find_matched_level, monotone_violations


def _step(scale: float) -> float:
    """A constructed retention curve: 1 up to 0.1, then falling linearly."""
    return 1.0 if scale <= 0.1 else max(0.0, 1.0 - (scale - 0.1))


def test_found_level_meets_the_target_and_the_next_grid_level_does_not():
    for target in (0.99, 0.95, 0.5):
        m = find_matched_level(_step, target)
        assert m.value >= target and _step(m.level) >= target
        i = m.grid.index(max(g for g in m.grid if g <= m.level))
        assert m.grid_values[i] >= target
        assert all(v < target for g, v in zip(m.grid, m.grid_values, strict=True) if g > m.level)
        assert not m.capped and m.violations == 0


def test_bisection_refines_between_grid_neighbours():
    m = find_matched_level(lambda s: 1.0 - s, 0.95, grid=(0.0, 0.03125, 0.0625, 0.125),
                           refine_steps=8)
    assert m.level == pytest.approx(0.05, abs=0.0625 / 2 ** 8 + 1e-12) and m.level <= 0.05
    assert len(m.evaluated) == 4 + 8


def test_target_one_gives_level_zero_when_any_gating_moves_a_top1():
    m = find_matched_level(lambda s: 1.0 - s, 1.0)
    assert m.level == 0.0 and m.value == 1.0


def test_capped_when_the_strongest_scale_meets_the_target():
    m = find_matched_level(lambda s: 1.0, 0.99)
    assert m.level == DEFAULT_SCALE_GRID[-1] == 1.0 and m.capped


def test_search_is_robust_to_a_non_monotone_objective():
    # dips below the target at 0.25 but meets it again at 0.5: the largest meeting grid scale
    # wins, and every stronger grid scale fails
    values = {0.0: 1.0, 0.25: 0.9, 0.5: 0.97, 1.0: 0.5}
    m = find_matched_level(lambda s: values.get(s, 0.96 if s < 0.75 else 0.5), 0.95,
                           grid=tuple(values))
    assert 0.5 <= m.level < 1.0 and m.value >= 0.95 and m.violations == 1
    assert monotone_violations([1.0, 0.9, 0.97, 0.5]) == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"target": 1.5}, "outside"), ({"target": 0.0}, "outside"),
    ({"target": 0.9, "grid": (0.1, 1.0)}, "start at 0.0"),
    ({"target": 0.9, "grid": (0.0, 1.0, 0.5)}, "ascending"),
    ({"target": 0.9, "refine_steps": -1}, "refine_steps"),
])
def test_bad_search_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        find_matched_level(_step, **kwargs)


def test_objective_below_target_at_zero_is_an_error():
    with pytest.raises(ConfigError, match="never be met"):
        find_matched_level(lambda s: 0.5, 0.9)


