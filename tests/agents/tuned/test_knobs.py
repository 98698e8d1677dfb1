"""Tests of agents.tuned.knobs: the canonical points of the knob grid (counted by hand), knob
validation, the imbalance threshold and the replica rules.
"""

from __future__ import annotations

import pytest

from agents.tuned.knobs import LP_SHARES, KnobGrid, TunedKnobs
from hdamoe_env.config.errors import ConfigError

GRID = KnobGrid(gating_levels=(0.0, 1.0, 2.0, 3.0, 4.0), protect_top=(0, 1),
                dispatch_rules=("least_loaded", "first", "home"), k_b=(None,))


def test_grid_canonical_points_are_counted_by_hand():
    """levels (0, 1) × protect (0, 1) × rules (a, b) × k_b (budget, 0) = 16 raw points.

    Level 0 ignores protect; k_b = 0 ignores the rule: level 0 → 2 (budget, rules) + 1 (k_b 0);
    level 1 → 4 (budget: 2 protect × 2 rules) + 2 (k_b 0: 2 protect) = 9 distinct points.
    """
    grid = KnobGrid(gating_levels=(0.0, 1.0), protect_top=(0, 1),
                    dispatch_rules=("least_loaded", "first"), k_b=(None, 0))
    assert grid.size == 16
    pts = grid.points()
    assert len(pts) == 9
    assert len({p.key() for p in pts}) == 9
    assert all(p.protect_top == 0 for p in pts if p.gating_level == 0)
    assert all(p.dispatch_rule == "least_loaded" for p in pts if p.k_b == 0)


def test_min_imbalance_knob():
    """Gating off ignores the threshold: levels (0, 1) × thresholds (None, 1.2) → 1 + 2 points."""
    grid = KnobGrid(gating_levels=(0.0, 1.0), protect_top=(0,), dispatch_rules=("first",),
                    min_imbalance=(None, 1.2))
    pts = grid.points()
    assert [(p.gating_level, p.min_imbalance) for p in pts] == [(0.0, None), (1.0, None),
                                                                 (1.0, 1.2)]
    assert "min_imbalance" in grid.to_dict() and "min_imbalance" not in GRID.to_dict()
    assert "min_imbalance=1.2" in pts[2].label()
    with pytest.raises(ConfigError, match="min_imbalance"):
        TunedKnobs(min_imbalance=-1.0)


def test_knob_validation_and_replica_rule():
    with pytest.raises(ConfigError, match="gating_level"):
        TunedKnobs(gating_level=-1)
    with pytest.raises(ConfigError, match="dispatch_rule"):
        TunedKnobs(dispatch_rule="nearest")
    with pytest.raises(ConfigError, match="replica_rule"):
        TunedKnobs(replica_rule="bogus")
    with pytest.raises(ConfigError, match="repeats"):
        KnobGrid(protect_top=(0, 0))
    with pytest.raises(ConfigError, match="oracle"):
        KnobGrid(replica_rules=(None, LP_SHARES))
    assert TunedKnobs(replica_rule="nearest").env_kwargs()["replica_rule"] == "nearest"
    assert TunedKnobs(replica_rule=LP_SHARES).env_kwargs()["replica_rule"] == "least_loaded"
    kw = TunedKnobs(gating_level=8.0, protect_top=1, k_b=2).env_kwargs()
    assert kw["gating_levels"] == (0.0, 8.0) and kw["gating_protect_top"] == 1
    assert kw["k_b"] == 2


def test_replica_rules_survive_k_b_zero():
    """k_b = 0 makes the dispatch rule irrelevant, not the replica rule (it acts on replicas)."""
    grid = KnobGrid(gating_levels=(0.0,), protect_top=(0,), dispatch_rules=("least_loaded",
                                                                            "first"),
                    k_b=(0,), replica_rules=("least_loaded", "round_robin"))
    assert [p.replica_rule for p in grid.points()] == ["least_loaded", "round_robin"]
