"""Tests of baselines.memory_sweep: the rho_mem sweep writes one placement per memory ratio."""

from __future__ import annotations

import pytest

pytest.importorskip("pulp")

from baselines.memory_sweep import sweep_rho_mem
from hdamoe_env.sim.placement import Placement


def test_rho_mem_sweep(cfg, trace, tmp_path):
    rows = sweep_rho_mem(cfg, [None, 1.0], tmp_path, layers="0", trace=trace)
    assert [r["rho_mem"] for r in rows] == [None, 1.0]
    for r in rows:
        assert r["dram_max_over_mean"] >= 1.0 and r["tbt_us"] > 0 and r["tbt_tp_us"] > 0
    capped = Placement.load(tmp_path / "rho_1" / "placement_node_balance.npz")
    assert (capped.P[0].sum(axis=0) <= 1.0 + 1e-6).all()
