"""Tests of baselines.pipeline_layer: the ``best`` guard's choice under the placement objective
(latency, energy, EDP; issue 30)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines import pipeline_layer
from baselines.pipeline import run_pipeline
from baselines.pipeline_layer import GUARD_CANDIDATES, LayerTask, _best_guard, layer_simulator


def _candidates(E: int, D: int) -> dict[str, tuple[np.ndarray, np.ndarray, bool]]:
    ident = np.arange(D, dtype=np.int64)
    tp = np.full((E, D), 1.0 / D)
    ep = np.zeros((E, D))
    ep[np.arange(E), np.arange(E) % D] = 1.0
    hyb = 0.5 * (ep + np.roll(ep, 1, axis=1))            # every expert on two clusters
    return {"nb-lb": (ep.copy(), ident, False), "tp": (tp, ident, False),
            "tp-tiled": (tp.copy(), ident, True), "ep": (ep, ident, False),
            "hybrid": (hyb, ident, False)}


#: Constructed scores: TP the fastest, tile-aligned TP the least energy, hybrid the lowest EDP.
_SCORES = {"nb-lb": (20.0, 9.0), "tp": (10.0, 8.0), "tp-tiled": (12.0, 6.0), "ep": (15.0, 7.0),
           "hybrid": (11.0, 6.5)}


class _FakeScorer:
    """Scores candidates by identity (the arrays of :func:`_candidates`), not by simulation."""

    table: dict[int, str] = {}

    def __init__(self, sim, layer, steps, seed) -> None:
        self.sim, self.step_sets = sim, steps

    def score(self, P, pi, red, *, account=None):
        name = self.table[id(P)]
        lat, en = _SCORES[name]
        return {"total_us": lat, "compute_us": lat, "comm_us": 0.0, "mode": "tp",
                "energy_uj": en, "layer_us": lat, "edp_js": en * lat * 1e-12}


@pytest.mark.parametrize("objective, winner", [("latency", "tp"), ("energy", "tp-tiled"),
                                               ("edp", "hybrid")])
def test_best_guard_picks_the_candidate_of_the_objective(cfg, monkeypatch, objective, winner):
    """The winner is the argmin of the objective's score, and the record names both winners."""
    config = dataclasses.replace(cfg, objective=objective, ls_moves=0)
    sim = layer_simulator(config)
    E, D = sim.model.num_experts, sim.hw.num_nodes
    cands = _candidates(E, D)
    _FakeScorer.table = {id(c[0]): name for name, c in cands.items()}
    monkeypatch.setattr(pipeline_layer, "LayerScorer", _FakeScorer)
    if winner == "hybrid":       # Link Balance would re-map the hybrid: keep its mapping here
        monkeypatch.setattr(pipeline_layer, "link_balance", lambda obj, pi, *a, **k: type(
            "R", (), {"pi": pi, "record": {"stub": True}})())
    rows = np.array([[0, 1], [2, 3], [1, 2]] * 20, dtype=np.int64)
    task = LayerTask(config.to_dict(), "h", 0, np.full(E, 0.5), np.array([[0, 1]]),
                     np.array([1.0]), rows, cands["ep"][0])
    P, pi, red, guard, costs = _best_guard(sim, config, task, cands, None,
                                           np.random.SeedSequence(0))
    assert guard["warm_start"] == winner and guard["objective"] == objective
    assert P is cands[winner][0] and red == (winner != "hybrid")   # TP shares: all-reduce
    assert set(costs) == {*GUARD_CANDIDATES, "node-link"}
    if objective == "latency":
        assert "latency_winner" not in guard
    else:
        assert guard["latency_winner"] == "tp"
        assert guard["latency_cost_us"] == pytest.approx(_SCORES[winner][0] - 10.0)


def test_energy_objective_never_uses_more_energy_than_the_latency_choice(cfg, trace, tmp_path):
    """Tiny model, 2 layers: same scored steps in both runs (same seed); the energy run scores
    the latency run's choice as a candidate (``latency-choice``, equal to the latency run's
    final layer), and its final layer uses no more energy than any candidate."""
    runs = {obj: run_pipeline(dataclasses.replace(cfg, objective=obj, seed=2), tmp_path / obj,
                              trace=trace) for obj in ("latency", "energy")}
    differs = False
    for layer in (0, 1):
        lat = runs["latency"].layers[layer].record["method_costs_us"]
        en = runs["energy"].layers[layer].record["method_costs_us"]
        for name in ("tp", "tp-tiled", "ep", "hybrid"):   # objective-free candidates agree
            assert en[name] == lat[name]
        assert en["latency-choice"] == lat["node-link"]     # the latency pipeline's layer
        assert en["node-link"]["energy_uj"] <= min(en[m]["energy_uj"] for m in en) + 1e-12
        assert en["node-link"]["energy_uj"] <= lat["node-link"]["energy_uj"] + 1e-12
        assert lat["node-link"]["total_us"] <= min(lat[m]["total_us"] for m in lat) + 1e-9
        differs |= en["node-link"]["energy_uj"] < lat["node-link"]["energy_uj"]
        parts = lat["tp"]["energy_parts_uj"]
        assert set(parts) == {"dram", "noc", "compute", "static"}
        assert sum(parts.values()) == pytest.approx(lat["tp"]["energy_uj"])
    assert differs     # on this trace and seed the energy objective saves energy in a layer
    meta = runs["energy"].placement.meta
    assert meta["objective"] == "energy" and meta["config"]["objective"] == "energy"
    assert runs["latency"].placement.meta["objective"] == "latency"
    assert "objective" not in runs["latency"].placement.meta["config"]


def test_scored_energy_prices_what_the_mapping_changes(cfg, make_trace):
    """The guard's Link-Balance energy objective on its own steps: mean NoC J + static W·t."""
    from baselines.node_balance.local_search import LayerScorer, sample_steps
    from hdamoe_env.cost import energy

    sim = layer_simulator(cfg)
    E, D = sim.model.num_experts, sim.hw.num_nodes
    rows = np.asarray(make_trace(2, E, 2, 200, seed=3).topk_ids[0], dtype=np.int64)
    steps = sample_steps(rows, 16, 4, np.random.default_rng(0))
    scorer = LayerScorer(sim, 0, steps, 1)
    P = _candidates(E, D)["hybrid"][0]
    pi = np.array([2, 0, 3, 1])
    results = scorer.step_results(P, pi, False)
    comm = [r.t_comm_moe_s for r in results]
    busy = np.sum([r.link_busy_s for r in results], axis=0)
    noc = float(energy.noc_energy_j(energy.link_byte_hops(busy, sim.topology.link_bw_Bps),
                                    sim.energy_spec)) / 4
    static = float(energy.static_energy_j(float(np.mean(comm)), D, sim.energy_spec))
    assert noc > 0
    en = pipeline_layer._ScoredEnergy(scorer, P, False, "energy")
    edp = pipeline_layer._ScoredEnergy(scorer, P, False, "edp")
    assert en(pi) == pytest.approx(noc + static, rel=1e-12)
    assert edp(pi) == pytest.approx((noc + static) * float(np.mean(comm)), rel=1e-12)


def test_lb_kind_resolves_auto_by_guard_and_profile(cfg):
    """``auto``: the guard's steps under the ``best`` guard of a tile-model profile, the static
    group task set under ``paper`` and without that guard; explicit values are kept."""
    from baselines.pipeline_config import PlaceConfig

    assert cfg.lb_objective == "auto" and cfg.lb_kind == "steps"
    assert dataclasses.replace(cfg, guard="tp").lb_kind == "des"
    assert dataclasses.replace(cfg, lb_objective="des").lb_kind == "des"
    paper = PlaceConfig.create(model="mixtral-8x7b", conventions="paper")
    assert paper.lb_kind == "des"
    assert PlaceConfig.create(model="mixtral-8x7b", conventions="paper",
                              lb_objective="steps").lb_kind == "steps"


def test_link_balance_on_the_guard_steps_never_worsens_them(cfg, trace, tmp_path):
    """Under ``steps`` the Node-Balance mapping π_l is optimised on the guard's scored steps
    (recorded as such), so on those steps it costs no more than the start π_0; under ``des``
    the record says the static task set was used."""
    from baselines.node_balance.local_search import ScoredMapping

    runs = {kind: run_pipeline(dataclasses.replace(cfg, lb_objective=kind, seed=3),
                               tmp_path / kind, trace=trace) for kind in ("steps", "des")}
    config = dataclasses.replace(cfg, lb_objective="steps", seed=3)
    sim = layer_simulator(config)
    moved = False
    for layer, outcome in runs["steps"].layers.items():
        lb = outcome.record["link_balance"]
        if lb.get("skipped"):
            continue
        assert lb["lb_objective"] == "steps"
        assert runs["des"].layers[layer].record["link_balance"]["lb_objective"] == "des"
        ss = np.random.SeedSequence(config.seed).spawn(sim.model.num_moe_layers + 1)[layer]
        s_score = ss.spawn(7)[6]
        task = LayerTask(config.to_dict(), "h", layer, None, None, None,
                         np.asarray(trace.topk_ids[layer, trace.view(config.view)], dtype=np.int64),
                         None)
        scorer, _ = pipeline_layer._guard_scorer(sim, config, task, s_score)
        arrays = outcome.arrays
        objective = ScoredMapping(scorer, arrays["P_nb"], False)
        assert objective(arrays["pi_lb"]) <= objective(arrays["pi0"]) + 1e-15
        moved |= not np.array_equal(arrays["pi_lb"], arrays["pi0"])
    assert moved or all(o.record["link_balance"].get("skipped")
                        for o in runs["steps"].layers.values())
