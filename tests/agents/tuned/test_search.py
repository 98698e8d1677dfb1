"""Tests of ``agents.tuned.search``: the search under the quality constraint (grid, Bayesian,
auto), its resumable journal, the tuned-heuristic file and the episode evaluator.

Constructed objectives make the optimum known by hand; the env-backed test uses the tiny model
(L = 2, E = 4, k = 2) on a 2×2 mesh and takes well under a second.
"""

from __future__ import annotations

import json

import pytest

from agents.tuned.knobs import KnobGrid, TunedKnobs
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


