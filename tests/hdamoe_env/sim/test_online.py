"""Layers under online decisions (hdamoe_env.sim.online): the gating's view of the tile model."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import get_model, hardware_from_setting
from hdamoe_env.decisions import gating
from hdamoe_env.sim.online import gating_tile_cost
from hdamoe_env.sim.placement import Placement, expert_parallel, tensor_parallel
from hdamoe_env.sim.simulator import MoESimulator


def _deepseek_case(profile: str):
    model = get_model("deepseek-v2-lite")
    hw = hardware_from_setting("5/50", (4, 8))
    conv = get_profile(profile)
    E, D = model.num_experts, hw.num_nodes
    tp = tensor_parallel(1, E, D).P
    ep = expert_parallel(1, E, D, np.random.default_rng(3)).P
    P = np.where(np.arange(E)[None, :, None] % 2 == 0, tp, ep)   # TP and EP experts mixed
    placement = Placement(P, np.tile(np.arange(D), (1, 1)), "mixed")
    return model, hw, conv, placement


@pytest.mark.parametrize("profile", ["faithful", "faithful+weight_streaming=false"])
def test_gating_tile_cost_is_what_the_evaluator_charges(profile):
    """TileCost.node_cost of a step's counts == the evaluator's max(compute_c, stream_c) per
    node (its node_compute_s / node_stream_s) and t_comp; the marginal_max penalty of an expert
    is the growth of that maximum when one token of it is added."""
    model, hw, conv, placement = _deepseek_case(profile)
    sim = MoESimulator(model, hw, "mesh", conv)
    tile = gating_tile_cost(placement.P[0], model, hw, conv)
    assert tile is not None and tile.tile_tokens == conv.tile_tokens
    rng = np.random.default_rng(0)
    B, k = 16, model.top_k
    sets = np.stack([rng.choice(model.num_experts, k, replace=False) for _ in range(B)])
    res = sim.layer_sampled(placement, 0, sets, rng=np.random.default_rng(1))
    counts = np.bincount(sets.ravel(), minlength=model.num_experts)
    charged = np.maximum(res.node_compute_s, res.node_stream_s)
    np.testing.assert_allclose(tile.node_cost(counts), charged, rtol=1e-12)
    assert tile.node_cost(counts).max() == pytest.approx(res.t_comp_s, rel=1e-12)
    dT, _ = gating.penalties(placement.P[0], counts, 1.0, 1.0, tile_cost=tile)
    for i in range(model.num_experts):               # marginal_max: growth of the max charge
        extra = counts.copy()
        extra[i] += 1
        assert dT[i] == tile.node_cost(extra).max() - tile.node_cost(counts).max()
    assert dT.min() >= 0 and dT.max() > 0


def test_gating_tile_cost_is_none_for_the_paper_profiles():
    model, hw, _, placement = _deepseek_case("faithful")
    for name in ("paper", "paper-hd"):
        assert gating_tile_cost(placement.P[0], model, hw, get_profile(name)) is None


@pytest.mark.parametrize("profile", ["faithful", "paper"])
def test_decision_evaluator_gates_with_the_profiles_cost(profile):
    """The env's gating uses the tile cost under ``faithful`` and the fluid one under ``paper``
    (bit-exact to the call without a tile cost)."""
    model, hw, conv, placement = _deepseek_case(profile)
    sim = MoESimulator(model, hw, "mesh", conv)
    B, J = 32, 4
    dec = sim.decision_evaluator(placement, B, freqs=np.full((1, model.num_experts), 0.1),
                                 max_broadcast=0, gating_coefficients=(-4.5e4, -0.015),
                                 gating_options={"diagnostics": False})
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(model.num_experts, 0.3), size=B)
    ids = np.argsort(-probs, axis=1)[:, :model.top_k + J].astype(np.int64)
    cands = (ids, np.take_along_axis(probs, ids, axis=1))
    got = dec.gate(0, cands, 1.0)
    w, C = dec.w_flops, dec.compute_flops
    fluid = gating.hardware_aware_gating(cands, model.top_k, placement.P[0], w, C, -4.5e4,
                                         -0.015, diagnostics=False)
    tile = gating_tile_cost(placement.P[0], model, hw, conv)
    tiled = gating.hardware_aware_gating(cands, model.top_k, placement.P[0], w, C, -4.5e4,
                                         -0.015, diagnostics=False, tile_cost=tile)
    want = tiled if profile == "faithful" else fluid
    np.testing.assert_array_equal(got.sets, want.sets)
    np.testing.assert_array_equal(got.weights, want.weights)
