"""Tests of baselines.memory_sweep: the rho_mem sweep writes one placement per memory ratio."""

from __future__ import annotations

import pytest

pytest.importorskip("pulp")

from baselines.memory_sweep import sweep_rho_mem
from baselines.pipeline_config import PlaceConfig
from hdamoe_env.sim.placement import Placement


@pytest.fixture
def cfg(nb_model):
    return PlaceConfig.create(model=nb_model, mesh=(2, 2), setting="1/1", trace="given",
                       lb_method="local", bo_calls=6, time_limit_s=10, seed=5)


@pytest.fixture
def trace(make_trace):
    return make_trace(2, 4, 2, 300, seed=1)


def test_rho_mem_sweep(cfg, trace, tmp_path):
    rows = sweep_rho_mem(cfg, [None, 1.0], tmp_path, layers="0", trace=trace)
    assert [r["rho_mem"] for r in rows] == [None, 1.0]
    for r in rows:
        assert r["dram_max_over_mean"] >= 1.0 and r["tbt_us"] > 0 and r["tbt_tp_us"] > 0
    capped = Placement.load(tmp_path / "rho_1" / "placement_node_balance.npz")
    assert (capped.P[0].sum(axis=0) <= 1.0 + 1e-6).all()
