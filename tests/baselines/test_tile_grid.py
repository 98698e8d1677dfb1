"""Shard granularity on the tile grid: Node Balance (MILP, heuristic) and the hybrid on
DeepSeek-V2-Lite.

Synthetic trace, 4×8 mesh, 5 TFLOPS / 50 GB/s, B = 128, ``faithful`` (tile_cols = 64, so
u = 64/1408 = 1/22): no output share may be off the grid (uniform TP rows are the documented
exception of ``hdamoe_env.sim.placement.check_tile_grid``). One layer runs by default; the
26-layer version is marked ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.node_balance.model import nb_coefficients, repair_placement
from baselines.node_balance.milp import node_balance
from baselines.pipeline import _tasks
from baselines.pipeline_config import PlaceConfig, load_trace
from baselines.pipeline_layer import layer_simulator
from baselines.static import hybrid_layer
from hdamoe_env.sim.placement import Placement, check_tile_grid, off_grid, share_unit

GAMMA = 1.0   # a representative γ: communication and compute both matter in the objective


@pytest.fixture(scope="module")
def deepseek():
    cfg = PlaceConfig.create(model="deepseek")
    sim = layer_simulator(cfg)
    trace = load_trace(cfg)
    return cfg, sim, trace


def _check_layers(deepseek, layers, milp_time_s):
    cfg, sim, trace = deepseek
    model, hw, conv = sim.model, sim.hw, sim.conv
    unit = share_unit(model, conv)
    assert unit == 1 / 22
    kw = dict(model=model, hw=hw, conv=conv, gamma=GAMMA, batch=128,
              bw_end_Bps=sim.topology.bw_end_Bps)
    out = {"heuristic": [], "milp": [], "hybrid": []}
    for task in _tasks(cfg, trace, layers, "test"):
        args = (task.freqs, task.groups, task.group_freqs)
        heur = node_balance(*args, **kw, mode="heuristic", seed=task.layer, ep_start=task.ep_P)
        milp = node_balance(*args, **kw, mode="milp", time_limit_s=milp_time_s,
                            seed=task.layer, ep_start=task.ep_P)
        hyb = hybrid_layer(task.freqs, hw.mesh_shape, model.hybrid_regions, method="lpt",
                           unit=unit)
        for name, P in (("heuristic", heur.P_layer), ("milp", milp.P_layer),
                        ("hybrid", hyb.P_layer)):
            assert not off_grid(P, unit).any(), (name, task.layer)
            assert np.abs(P.sum(axis=1) - 1).max() < 1e-12
            out[name].append(P)
        assert milp.record["objective_us"] <= heur.record["objective_us"] + 1e-9
        # the hybrid's rows are DeepSeek's 5, 5, 6, 6 units over a region of 4 nodes
        units = np.sort(np.rint(hyb.P_layer * 22), axis=1)[:, -4:]
        assert (units == [5, 5, 6, 6]).all()
    L = model.num_moe_layers
    for name, Ps in out.items():
        P = np.full((L, model.num_experts, hw.num_nodes), 1 / hw.num_nodes)  # TP: the exception
        P[list(layers)] = np.stack(Ps)
        check_tile_grid(Placement(P=P, pi=np.tile(np.arange(hw.num_nodes), (L, 1))), model, conv)
    return out


def test_deepseek_one_layer_on_the_grid(deepseek):
    out = _check_layers(deepseek, [1], milp_time_s=3.0)
    # the node-balanced layers really are sharded (otherwise the grid test would be vacuous)
    assert any(((P > 0) & (P < 1)).any() for P in out["heuristic"])


@pytest.mark.slow
def test_deepseek_all_26_layers_on_the_grid(deepseek):
    _check_layers(deepseek, list(range(26)), milp_time_s=10.0)


def test_ep_start_is_repaired_on_the_grid_when_memory_is_exactly_full(deepseek):
    """ρ_mem = 1 (the last point of ``hdamoe sweep-mem``): 64 experts on 32 nodes, every node
    exactly full (2 experts = 44 units). EP is on the grid (whole experts) but over the load cap
    (11) on some nodes; the greedy repair has no free headroom and snapping the LP point overfills
    a node, so layer 2 (and most others) used to log "EP start cannot be repaired on the tile
    grid 1/22: TP used". The integer repair swaps units between nodes instead."""
    cfg, sim, trace = deepseek
    model, hw, conv = sim.model, sim.hw, sim.conv
    task = _tasks(cfg, trace, [2], "test")[0]
    coeffs = nb_coefficients(task.freqs, model=model, hw=hw, conv=conv, gamma=GAMMA, batch=128,
                             bw_end_Bps=sim.topology.bw_end_Bps, rho_mem=1.0)
    assert coeffs.units == 22 and np.allclose(coeffs.mem_cap, 2.0)
    assert (task.freqs @ task.ep_P > coeffs.load_cap).any()        # EP itself is over the cap
    fixed = repair_placement(task.ep_P, coeffs)
    assert not off_grid(fixed, 1 / 22).any()
    assert (task.freqs @ fixed <= coeffs.load_cap + 1e-9).all()
    assert (fixed.sum(axis=0) <= 2.0 + 1e-9).all() and np.allclose(fixed.sum(axis=1), 1.0)
