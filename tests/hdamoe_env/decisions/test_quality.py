"""Matched-quality search over the gating scale (hdamoe_env.decisions.quality, hdamoe_env.app.matched)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.app.methods import parse_method
from hdamoe_env.app.matched import GatingQualityProbe, search_matched_levels
from hdamoe_env.env.environment import HdMoeEnv
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


# ------------------------------------------------------------------------------- parse_method
def test_parse_matched_and_scaled_methods():
    q = parse_method("hda-moe@q99")
    assert (q.name, q.placement, q.agent, q.quality_target) == (
        "hda-moe@q99", "node_link", "hda-moe", 0.99)
    assert parse_method("hda_moe@q95").quality_target == 0.95
    assert parse_method("hda-moe@q99.5").quality_target == pytest.approx(0.995)
    s = parse_method("hda-moe@s0.25")
    assert s.gating_scale == 0.25 and s.quality_target is None


@pytest.mark.parametrize("text", ["hda-moe@q150", "hda-moe@qx", "hda-moe@q0", "hda-moe@q",
                                  "hda-moe@s-1", "hda-moe@z9"])
def test_parse_rejects_bad_suffixes_in_one_line(text):
    with pytest.raises(ConfigError) as info:
        parse_method(text)
    msg = str(info.value)
    assert "\n" not in msg and repr(text) in msg and "hda-moe@qNN" in msg


# ------------------------------------------------------------------------------- real gating
@pytest.fixture(scope="module")
def mixtral_probe():
    """Mixtral-8x7B under ``paper`` on a synthetic trace with a skewed EP placement."""
    env = HdMoeEnv(model="mixtral-8x7b", conventions="paper", batch=64, steps_per_episode=2,
                   placement="ep", trace_requests=8)
    return GatingQualityProbe(env, seeds=(10_000,))


def test_top1_retention_is_monotone_in_the_gating_scale(mixtral_probe):
    curve = mixtral_probe.curve((*DEFAULT_SCALE_GRID, 1.5, 2.0))
    top1 = [c["top1_retention"] for c in curve]
    changed = [c["changed_fraction"] for c in curve]
    assert top1[0] == 1.0 and changed[0] == 0.0
    assert top1[-1] < 0.99, "gating at 2x the defaults should move some top-1 experts"
    # non-increasing up to sampling noise (one decode step can go either way by a token)
    assert monotone_violations(top1, tolerance=2.0 / (64 * 32)) == 0, top1
    assert np.all(np.diff(changed) >= -0.02), changed


def test_search_on_a_real_trace(mixtral_probe):
    found = search_matched_levels(mixtral_probe, (0.99, 0.95))
    assert found[0.99].level <= found[0.95].level
    for target, m in found.items():
        assert mixtral_probe.measure(m.level)["top1_retention"] >= target
        stronger = [g for g in m.grid if g > m.level]
        if stronger:
            assert mixtral_probe.measure(stronger[0])["top1_retention"] < target


def test_probe_rejects_bad_scales(mixtral_probe):
    with pytest.raises(ConfigError, match="scale"):
        mixtral_probe.measure(-1.0)


def test_top1_retention_is_monotone_on_the_real_mixtral_trace(reference_traces):
    """The recorded Mixtral router scores (reasoning trace), ``paper`` profile, EP placement."""
    path = reference_traces / "mixtral" / "experts_reasoning_mixtral.json"
    if not path.exists():
        pytest.skip(f"{path.name} not in the reference traces")
    env = HdMoeEnv(model="mixtral-8x7b", conventions="paper", batch=128, steps_per_episode=2,
                   placement="ep", trace=path)
    probe = GatingQualityProbe(env, seeds=(10_000,))
    top1 = [c["top1_retention"] for c in probe.curve(DEFAULT_SCALE_GRID)]
    assert top1[0] == 1.0 and top1[-1] < 0.9
    assert monotone_violations(top1, tolerance=2.0 / (2 * 128 * 32)) == 0, top1


def test_cli_rejects_a_bad_quality_target_in_one_line(capsys):
    from hdamoe_env.app.cli import main

    assert main(["bench", "--methods", "tp,hda-moe@qx", "--steps", "1", "--seeds", "0",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'hda-moe@qx'" in err and "hda-moe@qNN" in err
