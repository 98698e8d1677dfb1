"""Tests of hdamoe_env.sim.calibrate: the analytic twin's γ (paper-model.md §5.5) — one layer's
fit (``fit_gamma``), the paper fit over several batches (``fit_gammas``) and the per-layer γ on
a run's own placement (``twin_gammas``)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import hardware_from_setting
from hdamoe_env.sim import calibrate
from hdamoe_env.sim.calibrate import fit_gamma, fit_gammas
from hdamoe_env.sim.placement import expert_parallel, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.sim.sources import load_trace
from traces import synthetic


@pytest.fixture(scope="module")
def ds_trace():
    return synthetic.generate("deepseek-v2-lite", n_requests=12, seed=3)


def test_twin_gammas_fit_once_and_equal_fit_gammas(tiny_model, tiny_hw):
    sim = MoESimulator(tiny_model, tiny_hw)
    trace = load_trace("synthetic", tiny_model, seed=0, requests=2, tokens=64)
    routing = trace.topk_ids
    ep = expert_parallel(2, 4, 4, np.random.default_rng(0))
    got = calibrate.twin_gammas(sim, ep, trace, routing, "content", 8, 5)
    rows = trace.view("content")
    want = calibrate.fit_gammas(sim, ep, [routing[layer, rows].astype(np.int64)
                                          for layer in range(2)], 8, 5)
    np.testing.assert_array_equal(got, [f.gamma for f in want])
    assert calibrate.twin_gammas(sim, ep, trace, routing, "content", 8, 5) is got   # cached
    other = calibrate.twin_gammas(sim, ep, trace, routing, "content", 8, 6)        # new seed
    assert other is not got
    tp = calibrate.twin_gammas(sim, tensor_parallel(2, 4, 4), trace, routing, "content", 8, 5)
    np.testing.assert_array_equal(tp, [0.0, 0.0])                                  # no fit


def test_analytic_twin_and_gamma(ds_trace):  # §5.5
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"))
    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    rows = ds_trace.topk_ids[0][ds_trace.view("content")]
    fit = fit_gamma(sim, ep, 0, rows, 128, np.random.default_rng(1))
    assert fit.method == "origin" and fit.x_s.size == 64
    assert 0 < fit.gamma < 5 and fit.correlation > 0.5
    again = fit_gamma(sim, ep, 0, rows, 128, np.random.default_rng(1))
    assert again.gamma == fit.gamma
    sets = ds_trace.topk_ids[0][:128]
    rng = np.random.default_rng(2)
    des = sim.layer_sampled(ep, 0, sets, rng=rng)
    twin = sim.layer_sampled(ep, 0, sets, rng=rng, fidelity="analytic", gamma=fit.gamma)
    assert twin.mode == "analytic" and twin.t_comm_moe_s > 0
    assert abs(twin.t_comm_moe_s - des.t_comm_moe_s) / des.t_comm_moe_s < 0.5
    with pytest.raises(ConfigError, match="needs gamma"):
        sim.layer_sampled(ep, 0, sets, rng=rng, fidelity="analytic")


def test_paper_gamma_fit_uses_ols_and_paper_batches(ds_trace):
    sim = MoESimulator("deepseek-v2-lite", hardware_from_setting("5/50"), "mesh",
                       get_profile("paper", gamma_paper_batches=(256, 320, 16)))
    ep = expert_parallel(26, 64, 32, np.random.default_rng(0))
    rows = [ds_trace.topk_ids[layer][ds_trace.view("content")] for layer in range(2)]
    fits = fit_gammas(sim, ep, rows, 128, seed=0)
    assert [f.method for f in fits] == ["ols", "ols"] and fits[0].x_s.size == 4
