"""The batch guard (baselines.batch_guard): per-layer selection at the evaluation's batch."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.batch_guard import BatchGuardSpec, batch_guard
from baselines.pipeline import run_pipeline
from baselines.pipeline_layer import layer_simulator
from baselines.store import PlacementStore, StoreConfig
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.placement import expert_parallel, tensor_parallel

CANDIDATES = {"tp", "tp-tiled", "ep", "hybrid", "node-link@B16", "nb-lb"}


def _store(cfg, trace, directory, batch, **kwargs):
    return PlacementStore(StoreConfig.create(model=cfg.model_spec, mesh="2x2",
                                             setting=cfg.setting, batch=batch,
                                             placement_dir=str(directory),
                                             cache_dir=str(directory / "cache"), **kwargs),
                          trace)


@pytest.fixture
def placed(cfg, trace, tmp_path):
    """A pipeline run of the tiny model optimised at B = 16."""
    import dataclasses

    cfg16 = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, batch=16))
    run_pipeline(cfg16, tmp_path, trace=trace)
    return tmp_path


def test_store_guards_node_link_at_the_run_batch(cfg, trace, placed):
    store = _store(cfg, trace, placed, batch=4)
    pl, source = store.get("node_link")
    guard = pl.meta["batch_guard"]
    artifact = guard["artifact"]
    assert source.endswith("placement.npz") and artifact.endswith(".npz") and artifact != source
    assert guard["batch"] == 4 and guard["place_batch"] == 16
    assert set(guard["winner"]) == {"0", "1"}
    for layer, costs in guard["method_costs_us"].items():
        assert CANDIDATES | {"node-link", "decision"} == set(costs)
        winner = guard["winner"][layer]
        assert winner in CANDIDATES and costs["node-link"]["chosen"] == winner
        # the chosen layer is never slower on the guard's steps than the default baseline
        assert costs["node-link"]["total_us"] <= costs[guard["default"]]["total_us"] + 1e-9
        # and the layer's arrays are the winner's
        src = {"tp": "tp", "tp-tiled": "tp_tiled", "ep": "ep", "hybrid": "hybrid",
               "nb-lb": "node_link_raw"}.get(winner)
        if src is not None:
            ref = store.get(src)[0]
            np.testing.assert_array_equal(pl.P[int(layer)], ref.P[int(layer)])
    # cached: a new store loads the same file; the same inputs give the same placement
    again = _store(cfg, trace, placed, batch=4).get("node_link")[0]
    assert again.meta["batch_guard"]["artifact"] == artifact
    np.testing.assert_array_equal(again.P, pl.P)
    # another batch is another artifact; batch_guard=False gives the pipeline's placement
    other = _store(cfg, trace, placed, batch=8).get("node_link")[0]
    assert other.meta["batch_guard"]["artifact"] != artifact
    raw, path = _store(cfg, trace, placed, batch=4, batch_guard=False).get("node_link")
    assert "batch_guard" not in raw.meta and path == source


def test_rule_keeps_the_default_baseline_on_ties_and_small_gains(cfg, trace):
    sim = layer_simulator(cfg)
    model, D = cfg.model_spec, 4
    tp = tensor_parallel(model.num_moe_layers, model.num_experts, D)
    ep = expert_parallel(model.num_moe_layers, model.num_experts, D, np.random.default_rng(3))
    # an optimised placement that is a baseline: every layer keeps the default (a tie)
    tie = batch_guard(sim, {"tp": tp, "ep": ep}, {"opt": ep}, trace, 8)
    g = tie.meta["batch_guard"]
    assert set(g["winner"].values()) == {g["default"]}
    totals = {m: sum(c[m]["total_us"] for c in g["method_costs_us"].values())
              for m in ("tp", "ep")}
    assert g["default"] == min(totals, key=totals.get)
    # without margin and noise test the faster one wins; with a 99 % margin the default does
    free = batch_guard(sim, {"tp": tp}, {"opt": ep}, trace, 8,
                       BatchGuardSpec(margin=0.0, z=0.0))
    strict = batch_guard(sim, {"tp": tp}, {"opt": ep}, trace, 8, BatchGuardSpec(margin=0.99))
    for layer, costs in free.meta["batch_guard"]["method_costs_us"].items():
        fastest = "opt" if costs["opt"]["total_us"] < costs["tp"]["total_us"] else "tp"
        assert free.meta["batch_guard"]["winner"][layer] == fastest
        assert strict.meta["batch_guard"]["winner"][layer] == "tp"
        assert costs["decision"]["default"] == "tp"
    # deterministic: the same inputs, the same choice and costs
    again = batch_guard(sim, {"tp": tp}, {"opt": ep}, trace, 8,
                        BatchGuardSpec(margin=0.0, z=0.0))
    assert again.meta["batch_guard"]["method_costs_us"] == \
        free.meta["batch_guard"]["method_costs_us"]


def test_guard_steps_are_env_like_and_seeded(trace):
    from baselines.batch_guard import guard_steps

    a = guard_steps(trace, 8, 5, np.random.default_rng(1))
    b = guard_steps(trace, 8, 5, np.random.default_rng(1))
    assert a.shape == (5, 8) and a.dtype == np.int64
    np.testing.assert_array_equal(a, b)
    assert ((a >= 0) & (a < trace.topk_ids.shape[1])).all()


def test_small_batches_are_scored_on_at_least_min_tokens():
    """Steps grow to hold ``min_tokens`` tokens (a rare tile-boundary step must be sampled at
    small B), never below ``steps`` nor above ``max_steps``."""
    spec = BatchGuardSpec()
    assert [spec.steps_for(b) for b in (1, 8, 16, 32, 64, 128, 512)] == [128, 128, 64, 32, 16,
                                                                           16, 16]
    assert BatchGuardSpec(steps=4, min_tokens=0).steps_for(16) == 4
    assert BatchGuardSpec(min_tokens=100, max_steps=20).steps_for(1) == 20


def test_bad_guard_inputs(cfg, trace):
    with pytest.raises(ConfigError, match="steps must be an integer >= 2"):
        BatchGuardSpec(steps=1)
    with pytest.raises(ConfigError, match="max_steps=8 is below steps=16"):
        BatchGuardSpec(max_steps=8)
    with pytest.raises(ConfigError, match="min_tokens must be an integer >= 0"):
        BatchGuardSpec(min_tokens=-1)
    with pytest.raises(ConfigError, match="margin"):
        BatchGuardSpec(margin=1.5)
    sim = layer_simulator(cfg)
    tp = tensor_parallel(2, 4, 4)
    with pytest.raises(ConfigError, match="expected names from"):
        batch_guard(sim, {"best": tp}, {"opt": tp}, trace, 4)
    with pytest.raises(ConfigError, match="at least one baseline"):
        batch_guard(sim, {}, {"opt": tp}, trace, 4)
