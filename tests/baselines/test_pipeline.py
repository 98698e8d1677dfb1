"""Offline pipeline (paper-model.md §8.5): artifacts, resume, determinism, backends."""

from __future__ import annotations

import json
import os

import dataclasses

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.store import PLACEMENT_ARTIFACTS, PlacementStore, StoreConfig
from baselines.pipeline import run_pipeline
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled
from hdamoe_env.sim.placement import Placement


def test_pipeline_artifacts(cfg, trace, tmp_path):
    res = run_pipeline(cfg, tmp_path, trace=trace)
    assert res.computed == [0, 1] and res.skipped == []
    for name in ("placement.npz", "placement_node_balance.npz", "placement_hybrid.npz",
                 "placement_ep.npz", "run.json", "layer_000.npz", "layer_001.json"):
        assert (tmp_path / name).exists(), name
    pl = Placement.load(tmp_path / "placement.npz")
    assert pl.P.shape == (2, 4, 4) and pl.meta["layers_missing"] == []
    assert pl.meta["trace_id"] == trace.trace_id and pl.meta["seed"] == 5
    assert set(pl.meta["latency_us"]["0"]) == {"tp", "tp_tiled", "ep", "hybrid", "node_balance",
                                               "node_link"}
    rec = json.loads((tmp_path / "layer_000.json").read_text())
    assert rec["node_balance"]["path"] in ("milp-optimal", "milp-feasible", "warm-start",
                                           "heuristic", "tp", "ep-repaired")
    assert "solver_version" in rec["node_balance"]["solver"]
    # the best guard keeps Node+Link no slower than any baseline on the scored steps
    costs = rec["method_costs_us"]
    assert set(costs) == {"nb-lb", "tp", "tp-tiled", "ep", "hybrid", "node-link"}
    assert costs["node-link"]["total_us"] <= min(
        costs[m]["total_us"] for m in ("nb-lb", "tp", "tp-tiled", "ep", "hybrid")) + 1e-9
    assert rec["warm_start"] in costs and pl.meta["warm_start"]["0"] == rec["warm_start"]
    store = PlacementStore(StoreConfig.create(model=cfg.model_spec, mesh="2x2", setting=cfg.setting,
                                       placement_dir=str(tmp_path)), trace)
    for name in ("tp", "tp_tiled", "ep", "hybrid", "node_balance", "node_link",
                 "node_link_raw"):
        placement, artifact = store.get(name)
        assert placement.P.shape == (2, 4, 4)
        assert (artifact is None) == (PLACEMENT_ARTIFACTS[name] is None)
    rows = res.table_rows()
    assert [r["layer"] for r in rows] == [0, 1] and len(rows[0]["node_link"]) == 3


def test_interrupted_run_resumes_and_skips_finished_layers(cfg, trace, tmp_path):
    class Stop(Exception):
        pass

    def interrupt(outcome):
        raise Stop                      # the process dies right after layer 0 was written

    with pytest.raises(Stop):
        run_pipeline(cfg, tmp_path, trace=trace, on_layer=interrupt)
    assert (tmp_path / "layer_000.json").exists() and not (tmp_path / "layer_001.json").exists()
    partial = Placement.load(tmp_path / "placement.npz")
    assert partial.meta["layers_missing"] == [1]
    stamp = os.stat(tmp_path / "layer_000.npz").st_mtime_ns
    seen = []
    res = run_pipeline(cfg, tmp_path, trace=trace, resume=True, on_layer=seen.append)
    assert res.skipped == [0] and res.computed == [1] and [o.layer for o in seen] == [1]
    assert os.stat(tmp_path / "layer_000.npz").st_mtime_ns == stamp
    assert Placement.load(tmp_path / "placement.npz").meta["layers_missing"] == []
    again = run_pipeline(cfg, tmp_path, trace=trace, resume=True)
    assert again.computed == [] and again.skipped == [0, 1]


def test_resume_refuses_a_changed_configuration(cfg, trace, tmp_path, make_trace):
    run_pipeline(cfg, tmp_path, trace=trace, layers="0")
    changed = dataclasses.replace(cfg, bo_calls=7)
    with pytest.raises(ConfigError, match="another configuration.*bo_calls"):
        run_pipeline(changed, tmp_path, trace=trace, resume=True)
    other = make_trace(2, 4, 2, 300, seed=2)
    with pytest.raises(ConfigError, match="trace_id"):
        run_pipeline(cfg, tmp_path, trace=other, resume=True)
    # without --resume the other configuration's run is refused too (never overwritten) ...
    with pytest.raises(ConfigError, match="another configuration.*--force"):
        run_pipeline(changed, tmp_path, trace=trace, layers="1")
    assert (tmp_path / "layer_000.json").exists()
    # ... and --force moves it aside instead of deleting it
    res = run_pipeline(changed, tmp_path, trace=trace, layers="1", force=True)
    assert res.computed == [1] and not (tmp_path / "layer_000.json").exists()
    (kept,) = tmp_path.glob("superseded-*")
    assert (kept / "layer_000.json").exists() and (kept / "run.json").exists()


def test_same_seed_same_placement(cfg, trace, tmp_path):
    a = run_pipeline(cfg, tmp_path / "a", trace=trace).placement
    b = run_pipeline(cfg, tmp_path / "b", trace=trace, layers="1").placement
    b = run_pipeline(cfg, tmp_path / "b", trace=trace, layers="0", resume=True).placement
    assert np.array_equal(a.P, b.P) and np.array_equal(a.pi, b.pi)
    c = run_pipeline(dataclasses.replace(cfg, seed=6), tmp_path / "c",
                     trace=trace).placement
    assert not (np.array_equal(a.pi, c.pi) and np.array_equal(a.P, c.P))


def test_ray_backend_needs_ray(cfg, trace, tmp_path):
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(DependencyNotInstalled, match="ray"):
            run_pipeline(cfg, tmp_path, trace=trace, backend="ray", workers=2)
    else:
        pytest.skip("ray is installed")


@pytest.mark.slow
def test_two_workers_match_one(cfg, trace, tmp_path):
    a = run_pipeline(cfg, tmp_path / "a", trace=trace, workers=1).placement
    b = run_pipeline(cfg, tmp_path / "b", trace=trace, workers=2).placement
    assert np.array_equal(a.P, b.P) and np.array_equal(a.pi, b.pi)




def test_paper_profiles_keep_the_tp_guard(nb_model, trace, tmp_path):
    """paper*: Node+Link stays the paper's pipeline (TP guard), no sampled-step scoring."""
    from baselines.pipeline_config import PlaceConfig

    paper = PlaceConfig.create(model=nb_model, mesh=(2, 2), setting="1/1", trace="given",
                               conventions="paper", lb_method="local", bo_calls=6,
                               time_limit_s=10, seed=5)
    assert paper.guard == "best"
    res = run_pipeline(paper, tmp_path, trace=trace, layers="0")
    rec = res.layers[0].record
    assert rec["guard"]["kind"] == "tp" and "method_costs_us" not in rec
    assert rec["latency_us"]["node_link"]["total_us"] <= rec["latency_us"]["tp"]["total_us"] + 1e-9
