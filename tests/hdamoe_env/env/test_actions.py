"""Tests of hdamoe_env.env.actions: the ``ActionLayout`` of ``HdMoE-v1`` (paper-model.md §10.1).

Sizes and slots of the ``MultiDiscrete`` action with and without the replica-rule dimension,
encoding (truncated broadcasts, rule and level indices, the closest gating level), splitting a
flat action mask, validation, and reading the layout back from an env or a wrapper of one.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.env.actions import DEFAULT_DISPATCH_RULES, DEFAULT_GATING_LEVELS, ActionLayout


def _fake_env(nvec, dispatch_rules=DEFAULT_DISPATCH_RULES, gating_levels=DEFAULT_GATING_LEVELS,
              replica_rules=()):
    """The attributes ``ActionLayout.from_env`` reads, without an env behind them."""
    return SimpleNamespace(action_space=SimpleNamespace(nvec=np.array(nvec)),
                           dispatch_rules=dispatch_rules, gating_levels=gating_levels,
                           replica_rules=replica_rules)


def test_sizes_and_slots_without_replicas():
    lay = ActionLayout(4, 2)
    assert lay.nvec.tolist() == [5, 5, 3, 4] and lay.nvec.dtype == np.int64
    assert lay.size == 4 and lay.none == 4
    assert (lay.rule_slot, lay.level_slot, lay.replica_slot) == (2, 3, None)
    assert lay.noop().tolist() == [4, 4, 0, 0]
    empty = ActionLayout(4, 0)
    assert empty.nvec.tolist() == [3, 4] and empty.encode([1, 2]).tolist() == [0, 0]


def test_sizes_and_slots_with_a_replica_rule_dimension():
    lay = ActionLayout(4, 2, replica_rules=("least_loaded", "round_robin"))
    assert lay.nvec.tolist() == [5, 5, 3, 4, 2] and lay.size == 5 and lay.replica_slot == 4
    assert lay.noop().tolist() == [4, 4, 0, 0, 0]               # the env's default rule first
    assert lay.encode(replica_rule="round_robin")[-1] == 1
    assert lay.replica_rule_index("least_loaded") == 0
    with pytest.raises(ConfigError, match="replica rule 'nearest' is not offered"):
        lay.encode(replica_rule="nearest")


def test_encode_truncates_broadcasts_and_indexes_rules_and_levels():
    lay = ActionLayout(4, 2)
    a = lay.encode([1, 3, 2], "home", 0.6)                      # third expert dropped
    assert a.tolist() == [1, 3, 2, 1]                           # home = 2, 0.6 → level 0.5
    assert lay.encode([2]).tolist() == [2, 4, 0, 0]             # a free slot says "none"
    with pytest.raises(ConfigError, match="dispatch rule 'nearest' is not offered"):
        lay.rule_index("nearest")
    with pytest.raises(ConfigError, match="offers none"):
        lay.encode(replica_rule="least_loaded")                 # no replica dimension


@pytest.mark.parametrize(("level", "index"), [(0.0, 0), (-1.0, 0), (0.3, 1), (1.4, 2),
                                              (1.6, 3), (100.0, 3)])
def test_level_index_is_the_closest_level(level, index):
    assert ActionLayout(4, 2).level_index(level) == index       # levels (0, 0.5, 1, 2)


def test_gating_off_is_the_zero_level_wherever_it_sits():
    lay = ActionLayout(4, 1, gating_levels=(1.0, 0.0, 2.0))
    assert lay.level_index(0.0) == 1 and lay.level_index(0.9) == 0
    assert lay.noop().tolist() == [4, 0, 1]


def test_split_mask_per_dimension():
    lay = ActionLayout(4, 2)
    flat = np.arange(17) % 3 == 0                               # 5 + 5 + 3 + 4 entries
    parts = lay.split_mask(flat)
    assert [p.size for p in parts] == [5, 5, 3, 4]
    np.testing.assert_array_equal(np.concatenate(parts), flat)
    assert parts[2].tolist() == [False, False, True]            # flat[10:13]: only 12
    with pytest.raises(ConfigError, match="mask has 16 entries; this layout needs 17"):
        lay.split_mask(np.ones(16, dtype=bool))


@pytest.mark.parametrize("kwargs", [dict(num_experts=0), dict(num_experts=4, max_broadcast=-1),
                                    dict(num_experts=4, dispatch_rules=()),
                                    dict(num_experts=4, gating_levels=())])
def test_bad_layouts_are_refused(kwargs):
    with pytest.raises(ConfigError, match="ActionLayout needs"):
        ActionLayout(**kwargs)


def test_sequences_become_tuples_and_levels_floats():
    lay = ActionLayout(4, 1, dispatch_rules=["first", "home"], gating_levels=[0, 1],
                       replica_rules=["least_loaded"])
    assert lay.dispatch_rules == ("first", "home") and lay.replica_rules == ("least_loaded",)
    assert lay.gating_levels == (0.0, 1.0) and all(type(v) is float for v in lay.gating_levels)
    assert lay == ActionLayout(4, 1, ("first", "home"), (0.0, 1.0), ("least_loaded",))
    assert hash(lay) == hash(ActionLayout(4, 1, ("first", "home"), (0.0, 1.0), ("least_loaded",)))


def test_from_env_reads_the_layout_through_wrappers():
    env = _fake_env([5, 5, 5, 3, 4])
    lay = ActionLayout.from_env(env)
    assert (lay.num_experts, lay.max_broadcast, lay.replica_rules) == (4, 3, ())
    assert ActionLayout.from_env(SimpleNamespace(unwrapped=env)) == lay
    replicated = _fake_env([5, 5, 3, 4, 2], replica_rules=("least_loaded", "round_robin"))
    assert ActionLayout.from_env(replicated).max_broadcast == 2
    with pytest.raises(ConfigError, match="does not match the layout"):
        ActionLayout.from_env(_fake_env([5, 5, 3, 4], dispatch_rules=("first", "home")))


def test_from_env_matches_the_real_env(make_tiny_env, replicated_placements):
    env = make_tiny_env()
    lay = ActionLayout.from_env(env)
    np.testing.assert_array_equal(lay.nvec, env.action_space.nvec)
    assert lay.replica_slot is None and env.action_space.contains(lay.noop())
    rep_env = make_tiny_env(placement=replicated_placements[1])
    rep = ActionLayout.from_env(rep_env)
    assert rep.replica_rules == rep_env.replica_rules and rep.replica_slot == rep.size - 1
    np.testing.assert_array_equal(rep.nvec, rep_env.action_space.nvec)
    assert rep_env.action_space.contains(rep.encode(replica_rule=rep.replica_rules[-1]))
