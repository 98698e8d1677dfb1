"""Compute-balanced hybrid TP-EP baseline (paper-model.md §9.3)."""

from __future__ import annotations

import numpy as np
import pytest

from baselines import static
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.config.specs import HardwareSpec


def _rectangles(mesh, R):
    regions = static.region_map(mesh, R).reshape(mesh)
    shapes = set()
    for r in range(R):
        rows, cols = np.nonzero(regions == r)
        h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert h * w == rows.size, "region is not a full rectangle"
        shapes.add((int(h), int(w)))
    return regions, shapes


@pytest.mark.parametrize(("mesh", "R", "shape"), [((4, 8), 8, (2, 2)), ((4, 8), 2, (4, 4)),
                                                   ((4, 4), 8, (2, 1)), ((8, 8), 8, (4, 2))])
def test_region_rectangles(mesh, R, shape):
    regions, shapes = _rectangles(mesh, R)
    assert shapes == {shape}
    # row-major numbering of the regions: region ids increase along rows, then columns
    firsts = [int(np.flatnonzero(regions.reshape(-1) == r)[0]) for r in range(R)]
    assert firsts == sorted(firsts)
    assert regions[0, 0] == 0 and regions[-1, -1] == R - 1


def test_region_numbering_4x8():
    regions = static.region_map((4, 8), 8).reshape(4, 8)
    assert regions[:2, :2].tolist() == [[0, 0], [0, 0]]
    assert regions[0, 2] == 1 and regions[2, 0] == 4 and regions[3, 7] == 7
    assert static.region_map((4, 8), 2).reshape(4, 8)[:, 4:].min() == 1
    with pytest.raises(ConfigError):
        static.region_map((3, 8), 8)
    with pytest.raises(ConfigError):
        static.region_split(3)


def test_balance_milp_not_worse_than_lpt():
    pytest.importorskip("pulp")
    rng = np.random.default_rng(0)
    f = rng.dirichlet(np.ones(64) * 0.5) * 6
    assign, rec = static.balance_regions(f, 8, time_limit_s=10)
    loads = np.bincount(assign, weights=f, minlength=8)
    lpt = np.bincount(static.lpt_regions(f, 8), weights=f, minlength=8)
    assert loads.max() <= lpt.max() + 1e-12
    assert rec["max_load"] == pytest.approx(loads.max())
    assert loads.max() >= rec["lower_bound"] - 1e-12
    assign2, rec2 = static.balance_regions(f, 8, method="lpt")
    assert rec2["method"] == "lpt"


def test_hybrid_layer_shares():
    f = np.array([0.5, 0.4, 0.3, 0.3, 0.2, 0.1, 0.1, 0.1]) * 2
    hyb = static.hybrid_layer(f, (4, 8), 2, method="lpt")
    P = hyb.P_layer
    assert P.shape == (8, 32) and np.allclose(P.sum(axis=1), 1)
    for i in range(8):
        clusters = np.flatnonzero(P[i] > 0)
        assert clusters.size == 16 and np.allclose(P[i, clusters], 1 / 16)
        assert (hyb.region_of_cluster[clusters] == hyb.region_of_expert[i]).all()
    assert np.array_equal(hyb.pi_layer, np.arange(32))
    placement = static.hybrid_placement([f, f], (4, 8), 2, method="lpt")
    assert placement.P.shape == (2, 8, 32) and placement.method == "hybrid"


@pytest.mark.parametrize("profile", ["faithful", "paper"])
def test_evaluate_hybrid(nb_model, profile):
    hw = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)
    sim = MoESimulator(nb_model, hw, "mesh", profile)
    f = np.array([0.55, 0.45, 0.45, 0.55])
    groups = np.array([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
    gf = np.array([0.30, 0.05, 0.20, 0.10, 0.05, 0.30])
    hyb = static.hybrid_layer(f, (2, 2), 2, method="lpt")
    out = static.evaluate_hybrid(sim, hyb, 0, f, groups, gf, 128, rng=np.random.default_rng(0))
    assert out["eval"] == ("des" if profile == "faithful" else "ref")
    assert out["total_us"] == pytest.approx(out["compute_us"] + out["comm_us"])
    assert out["comm_us"] > 0
    if profile == "paper":
        assert out["comm_us"] == pytest.approx(out["rep_des_us"] + out["analytic_us"])
        slip = sim.conv.derive(hybrid_ref_slip=True)
        sim2 = MoESimulator(nb_model, hw, "mesh", slip)
        with pytest.raises(ConfigError, match="slip"):
            static.evaluate_hybrid(sim2, hyb, 0, f, groups, gf, 128, rng=np.random.default_rng(0))
        s2 = static.evaluate_hybrid(sim2, hyb, 0, f, groups, gf, 128,
                                    rng=np.random.default_rng(0),
                                    slip_support=np.eye(4, dtype=bool))
        assert s2["slip"] is True


def test_hybrid_layer_on_the_tile_grid():
    """DeepSeek's U = 22 units over a region of n = 4 nodes: 22 = 4·5 + 2, so every expert holds
    5, 5, 6, 6 units. Mesh 2×4, R = 2 (two 2×2 regions); LPT puts experts 0 (f = 0.6) and 1
    (0.4) in one region, 2 and 3 (0.5 each) in the other. The hotter expert takes its two extra
    units on the region's first two nodes (ties → lower cluster); the next expert's extras go
    to the two less loaded nodes, so each node ends with 11 units of the pair."""
    f = np.array([0.6, 0.4, 0.5, 0.5])
    hyb = static.hybrid_layer(f, (2, 4), 2, method="lpt", unit=1 / 22)
    units = np.rint(hyb.P_layer * 22)
    assert np.abs(hyb.P_layer * 22 - units).max() < 1e-12
    assert (units.sum(axis=1) == 22).all()
    for a, b in ((0, 1), (2, 3)):
        region = np.flatnonzero(units[a] > 0)
        assert region.size == 4 and np.array_equal(np.flatnonzero(units[b] > 0), region)
        assert units[a, region].tolist() == [6, 6, 5, 5]
        assert units[b, region].tolist() == [5, 5, 6, 6]
        assert (units[a, region] + units[b, region] == 11).all()
    # a divisible grid (U = 8 over 4 nodes) keeps the exact 1/4 parts; unit None is unchanged
    exact = static.hybrid_layer(f, (2, 4), 2, method="lpt")
    assert np.array_equal(static.hybrid_layer(f, (2, 4), 2, method="lpt", unit=1 / 8).P_layer,
                          exact.P_layer)
    assert set(np.unique(exact.P_layer)) == {0.0, 0.25}
