"""The analytic twin's γ per layer on a run's own placement (``calibrate.twin_gammas``, §5.5)."""

from __future__ import annotations

import numpy as np

from hdamoe_env.sim import calibrate
from hdamoe_env.sim.placement import expert_parallel, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.sim.sources import load_trace


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
