"""Tests of agents.tuned.oracle: the balanced replica fractions (hand case) and the per-layer
oracle on the tiny env (L = 2, E = 4, k = 2, 2×2 mesh) — below every fixed knob point, equal to
the env run at a fixed point, with replica rules and LP shares.
"""

from __future__ import annotations

import numpy as np
import pytest

from agents.tuned.knobs import LP_SHARES, KnobGrid, TunedKnobs
from agents.tuned.oracle import balanced_replica_fractions, per_layer_oracle
from agents.tuned.search import EpisodeEvaluator
from hdamoe_env.config.errors import ConfigError


def test_balanced_replica_fractions_hand_case():
    """2 nodes; expert 0 on node 0 with a replica on node 1 (6 tokens), expert 1 on node 0 (4
    tokens), expert 2 on node 1 (2 tokens).

    With y of expert 0's tokens on the primary, node 0 carries 4 + y and node 1 2 + 6 − y; the
    busiest is smallest at y = 2: fraction 2/6 on the primary, 4/6 on the replica. Experts 1
    and 2 have no replica and keep fraction 1.
    """
    pytest.importorskip("scipy")
    P = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    reps = np.zeros((3, 2), dtype=bool)
    reps[0, 1] = True
    sets = np.array([[0, 1]] * 4 + [[0, 2]] * 2)
    fr = balanced_replica_fractions(sets, P, reps)
    assert fr.shape == (3, 3)
    assert fr[0, 0] == pytest.approx(2 / 6) and fr[0, 2] == pytest.approx(4 / 6)
    assert fr[0, 1] == 0.0 and fr[1, 0] == 1.0 and fr[2, 0] == 1.0
    with pytest.raises(ConfigError, match="shape"):
        balanced_replica_fractions(sets, P, reps[:, :1])


# ------------------------------------------------------------------------ env-backed (tiny)
@pytest.fixture
def tiny_kwargs(tiny_agent_model):
    return dict(model=tiny_agent_model, mesh="2x2", setting="1/1", batch=8,
                steps_per_episode=2, placement="ep", trace_requests=4, trace_tokens=256)


TINY_GRID = KnobGrid(gating_levels=(0.0, 1.0, 64.0), protect_top=(0, 1),
                     dispatch_rules=("least_loaded", "first"), k_b=(0, 2))


def test_oracle_is_below_every_fixed_point(tiny_kwargs):
    pts = TINY_GRID.points()
    o = per_layer_oracle(tiny_kwargs, pts, seeds=[0, 1], target=0.99)
    S = o.constrained_tbt_us.size
    assert S == 4 and o.fixed_tbt_us.shape == (len(pts), S)
    eps = 1e-9
    assert np.all(o.unconstrained_tbt_us <= o.fixed_tbt_us.min(axis=0) + eps)
    assert np.all(o.unconstrained_tbt_us <= o.constrained_tbt_us + eps)
    # a point that keeps every layer's top-1 (here: gating off) is never faster than the bound
    for i, p in enumerate(pts):
        if p.gating_level == 0:
            assert np.all(o.constrained_tbt_us <= o.fixed_tbt_us[i] + eps)
    assert o.constrained_top1 >= 0.99
    assert int(o.choices.sum()) == S * 2                       # one choice per layer
    s = o.summary()
    assert s["constrained_over_best_fixed"] <= 1.0 + 1e-12
    # the per-layer terms reproduce every fixed point and the unconstrained oracle
    assert o.layer_s.shape == o.layer_top1.shape == (S, len(pts), 2)
    np.testing.assert_allclose((o.layer_s.sum(axis=2).T + o.dense_s) * 1e6, o.fixed_tbt_us)
    np.testing.assert_allclose((o.layer_s.min(axis=1).sum(axis=1) + o.dense_s) * 1e6,
                               o.unconstrained_tbt_us)


def test_oracle_fixed_point_matches_the_env_run(tiny_kwargs):
    """The oracle's fixed-point TBT is the env's TBT up to the aggregator draws (within 5 %)."""
    k = TunedKnobs(gating_level=0.0, k_b=0)
    o = per_layer_oracle(tiny_kwargs, [k], seeds=[0])
    m = EpisodeEvaluator(tiny_kwargs, seeds=[0])(k)
    assert o.fixed_tbt_us[0].mean() == pytest.approx(m.tbt_us, rel=0.05)


def _replicated_kwargs(tiny_kwargs):
    """The tiny env on EP plus one whole copy of expert 0 per layer on another node."""
    from hdamoe_env.sim.placement import Placement, expert_parallel

    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    reps = np.zeros(ep.P.shape, dtype=bool)
    for layer in range(2):
        reps[layer, 0, int(np.flatnonzero(ep.P[layer, 0] == 0)[0])] = True
    return {**tiny_kwargs, "placement": Placement(ep.P, ep.pi, "ep+rep", replicas=reps)}


def test_oracle_with_replicas_runs_each_rule_and_adds_lp_shares(tiny_kwargs):
    """Each point runs its own replica rule (round-robin's fixed TBT is the env's, within the
    aggregator draws) and every point gets an LP-shares twin, which the constrained oracle may
    pick; the oracle stays below every fixed point."""
    pytest.importorskip("scipy")
    kw = _replicated_kwargs(tiny_kwargs)
    pts = [TunedKnobs(gating_level=0.0, k_b=0, replica_rule=r)
           for r in ("least_loaded", "round_robin")]
    pts.append(TunedKnobs(gating_level=64.0, k_b=0, replica_rule="round_robin"))
    o = per_layer_oracle(kw, pts, seeds=[0])
    # one LP twin per point up to its replica rule: levels 0 and 64
    assert [p.replica_rule for p in o.points] == ["least_loaded", "round_robin", "round_robin",
                                                  LP_SHARES, LP_SHARES]
    ev = EpisodeEvaluator(kw, seeds=[0])
    for i in (1, 2):                        # the replica rule and the gating level both act
        m = ev(pts[i])
        assert o.fixed_tbt_us[i].mean() == pytest.approx(m.tbt_us, rel=0.05)
        assert o.fixed_top1[i] == pytest.approx(m.top1_retention)
    assert o.fixed_top1[2] < 1.0                 # level 64 gates (the oracle read the level)
    assert np.all(o.unconstrained_tbt_us <= o.fixed_tbt_us.min(axis=0) + 1e-9)
    ungated = [i for i, p in enumerate(o.points) if p.gating_level == 0]   # incl. an LP twin
    assert np.all(o.constrained_tbt_us <= o.fixed_tbt_us[ungated].min(axis=0) + 1e-9)
    assert len(per_layer_oracle(kw, pts, seeds=[0], lp_shares=False).points) == 3
    # without replicas nothing is added
    assert len(per_layer_oracle(tiny_kwargs, pts[:1], seeds=[0]).points) == 1
