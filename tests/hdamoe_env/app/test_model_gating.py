"""Hardware-aware gating of a recorded model (hdamoe_env.app.model_gating): which cost it charges."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.app.model_gating import GatingSetup
from hdamoe_env.decisions import gating
from hdamoe_env.sim.online import gating_tile_cost


@pytest.mark.parametrize("profile", ["paper", "faithful"])
def test_policy_gates_with_the_profiles_node_cost(profile):
    """``paper``: the fluid penalties; ``faithful``: the evaluator's tile-model node cost."""
    setup = GatingSetup.for_model(8, 2, 2, conventions=profile, placement="ep", seed=0)
    rng = np.random.default_rng(0)
    scores = rng.dirichlet(np.full(8, 0.3), size=48)
    orig = np.argsort(-scores, axis=1, kind="stable")[:, :2]
    got = setup.policy(1.0, batch=16)(1, scores, orig)
    P = setup.placement.P[1]
    tile = gating_tile_cost(P, setup.model, setup.hw, setup.conv)
    assert (tile is None) == (profile == "paper")
    r_comp, r_comm = setup.coefficients
    for start in range(0, 48, 16):
        want = gating.hardware_aware_gating(scores[start:start + 16], 2, P, setup.w_flops,
                                            setup.hw.compute_flops, r_comp, r_comm,
                                            renormalize=True, diagnostics=False, tile_cost=tile)
        np.testing.assert_array_equal(got[start:start + 16], want.sets)
