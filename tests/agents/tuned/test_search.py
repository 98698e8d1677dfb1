"""Tests of ``agents.tuned``: knob grid, search under the quality constraint, journal, oracle.

Constructed objectives make the optimum known by hand; the env-backed tests use the tiny model
(L = 2, E = 4, k = 2) on a 2×2 mesh and take well under a second each.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents.tuned.knobs import LP_SHARES, KnobGrid, TunedKnobs
from agents.tuned.oracle import balanced_replica_fractions, per_layer_oracle
from agents.tuned.search import (EpisodeEvaluator, Measurement, load_tuned, penalised_objective,
                                 tune, write_tuned)
from hdamoe_env.config.errors import ConfigError, OutputPathError

RULE_COST = {"least_loaded": 0.0, "first": 1.0, "home": 2.0}


def constructed(knobs: TunedKnobs) -> Measurement:
    """TBT = 100 + (level − 3)² + 5·protect + rule cost; top-1 = 1 − 0.004·level.

    By hand: the unconstrained optimum is level 3 (TBT 100, top-1 0.988 < 0.99: infeasible);
    with target 0.99 the feasible levels are ≤ 2.5, so the optimum is level 2, protect 0,
    least_loaded: TBT 100 + 1 = 101, top-1 0.992.
    """
    tbt = (100.0 + (knobs.gating_level - 3.0) ** 2 + 5.0 * knobs.protect_top
           + RULE_COST[knobs.dispatch_rule])
    return Measurement(tbt, 1.0 - 0.004 * knobs.gating_level, 1)


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


def test_penalised_objective_hand_values():
    """1000 µs at 0.985 vs 0.99: 1000 · (1 + 100 · 0.005) = 1500; feasible points: their TBT."""
    assert penalised_objective(Measurement(1000.0, 0.985), 0.99) == pytest.approx(1500.0)
    assert penalised_objective(Measurement(1000.0, 0.995), 0.99) == 1000.0


def test_grid_search_finds_the_constrained_optimum():
    res = tune(constructed, GRID, target=0.99, method="grid")
    assert res.method == "grid"
    assert len(res.points) == len(GRID.points()) == 5 * 2 * 3 - 3      # level 0 ignores protect
    assert res.best is not None
    assert res.best.knobs == TunedKnobs(2.0, 0, "least_loaded", None)
    assert res.best.tbt_us == pytest.approx(101.0)
    fastest = min(res.points, key=lambda p: p.tbt_us)
    assert fastest.knobs.gating_level == 3.0 and not fastest.feasible   # never selected
    assert all(p.feasible == (p.top1_retention >= 0.99) for p in res.points)


def test_no_feasible_point_gives_none():
    grid = KnobGrid(gating_levels=(3.0, 4.0), protect_top=(0,), dispatch_rules=("first",))
    assert tune(constructed, grid, target=0.99).best is None


def test_resume_skips_evaluated_points_and_equals_an_uninterrupted_run(tmp_path):
    journal = tmp_path / "points.jsonl"
    calls: list[str] = []

    def flaky(knobs):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(knobs.key())
        return constructed(knobs)

    with pytest.raises(KeyboardInterrupt):
        tune(flaky, GRID, journal=journal, run_key="k")
    assert len(journal.read_text().splitlines()) == 4
    with pytest.raises(OutputPathError):
        tune(constructed, GRID, journal=journal, run_key="k")
    with pytest.raises(ConfigError, match="another configuration"):
        tune(constructed, GRID, journal=journal, run_key="other", resume=True)
    again: list[str] = []

    def counting(knobs):
        again.append(knobs.key())
        return constructed(knobs)

    res = tune(counting, GRID, journal=journal, run_key="k", resume=True)
    assert res.resumed == 4
    assert not set(again) & set(calls)
    assert len(again) == len(GRID.points()) - 4
    full = tune(constructed, GRID)
    assert [p.knobs for p in res.points] == [p.knobs for p in full.points]
    assert res.best == full.best
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    assert len(lines) == len(GRID.points()) and all(x["run_key"] == "k" for x in lines)


def test_bayesian_search_is_deterministic_and_resumable(tmp_path):
    """Same seed → same proposals; a resume from a partial journal replays them exactly."""
    pytest.importorskip("skopt")
    grid = KnobGrid(gating_levels=(0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0),
                    protect_top=(0, 1), dispatch_rules=("least_loaded", "first", "home"))
    a = tune(constructed, grid, method="bo", n_calls=8, n_initial=4, seed=3)
    assert a.method == "bo"
    assert a.best is not None and a.best.feasible and a.best.top1_retention >= 0.99
    journal = tmp_path / "j.jsonl"
    journal.write_text("".join(json.dumps(p.to_dict("r")) + "\n" for p in a.points[:3]))
    c = tune(constructed, grid, method="bo", n_calls=8, n_initial=4, seed=3,
                   journal=journal, run_key="r", resume=True)
    assert c.resumed == 3
    assert [p.knobs for p in c.points] == [p.knobs for p in a.points]
    assert c.best == a.best


def test_auto_uses_the_grid_when_small():
    assert tune(constructed, GRID, method="auto", max_grid=100).method == "grid"


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


def test_tuned_file_round_trip(tmp_path):
    res = tune(constructed, GRID)
    path = write_tuned(tmp_path / "tuned.json", res, config={"x": 1}, grid=GRID,
                             held_out=Measurement(99.0, 1.0, 3))
    knobs, data = load_tuned(tmp_path)
    assert knobs == res.best.knobs
    assert data["held_out"]["tbt_us"] == 99.0 and len(data["points"]) == len(res.points)
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a tuned-heuristic file"):
        load_tuned(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_tuned(tmp_path / "missing.json")


# ------------------------------------------------------------------------ env-backed (tiny)
@pytest.fixture
def tiny_kwargs(tiny_agent_model):
    return dict(model=tiny_agent_model, mesh="2x2", setting="1/1", batch=8,
                steps_per_episode=2, placement="ep", trace_requests=4, trace_tokens=256)


TINY_GRID = KnobGrid(gating_levels=(0.0, 1.0, 64.0), protect_top=(0, 1),
                     dispatch_rules=("least_loaded", "first"), k_b=(0, 2))


def test_episode_evaluator_is_deterministic(tiny_kwargs):
    ev = EpisodeEvaluator(tiny_kwargs, seeds=[0, 1])
    k = TunedKnobs(gating_level=1.0, k_b=2)
    a = ev(k)
    b = EpisodeEvaluator(tiny_kwargs, seeds=[0, 1])(k)
    assert a == b and a.decode_steps == 4 and 0.0 <= a.top1_retention <= 1.0
    # an unreachable threshold turns gating off in every layer: the same as level 0
    never = ev(TunedKnobs(gating_level=1.0, k_b=2, min_imbalance=1e9))
    assert never.tbt_us == pytest.approx(ev(TunedKnobs(gating_level=0.0, k_b=2)).tbt_us)
    assert never.top1_retention == 1.0
    off = ev(TunedKnobs(gating_level=0.0))
    assert off.top1_retention == 1.0


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
