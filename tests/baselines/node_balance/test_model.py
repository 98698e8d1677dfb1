"""Tests of baselines.node_balance.model (paper-model.md §7): the Node-Balance coefficients and
their share unit, group compression (§7.6 item 2), the repair and wrap starts on the tile grid.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.node_balance import milp as nb
from hdamoe_env.config.errors import ConfigError, InfeasibleError
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.config.specs import HardwareSpec


# 4 experts, k = 2: all six pairs with distinct frequencies
GROUPS = np.array([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
GFREQ = np.array([0.30, 0.05, 0.20, 0.10, 0.05, 0.30])
FREQS = np.array([GFREQ[(GROUPS == i).any(axis=1)].sum() for i in range(4)])


def test_group_compression_keeps_mass():
    """§7.6 item 2: smallest most-frequent set covering the mass; residual φ_i; renormalise."""
    rng = np.random.default_rng(0)
    groups = np.array(list(itertools.combinations(range(8), 2)))
    freqs = rng.dirichlet(np.ones(len(groups)))
    comp = nb.compress_groups(groups, freqs, 8, mass=0.9, max_groups=400, mode="residual",
                              compress_above=0)
    order = np.sort(freqs)[::-1]
    n = int(np.searchsorted(np.cumsum(order), 0.9) + 1)
    assert comp.groups.shape[0] == n
    assert comp.kept_mass >= 0.9
    # φ_i counts every dropped group once per member expert
    assert comp.phi.sum() == pytest.approx(2 * (1 - comp.kept_mass))
    capped = nb.compress_groups(groups, freqs, 8, max_groups=5, compress_above=0)
    assert capped.groups.shape[0] == 5
    ren = nb.compress_groups(groups, freqs, 8, mode="renormalise", compress_above=0)
    assert ren.freqs.sum() == pytest.approx(1.0) and not ren.phi.any()
    small = nb.compress_groups(groups, freqs, 8)           # 28 groups: kept exactly
    assert small.mode == "none" and small.groups.shape[0] == 28
    with pytest.raises(ConfigError, match="truncation"):
        nb.compress_groups(groups, freqs, 8, mode="truncate")


# ------------------------------------------------------------------------------ tile grid
def _grid_coeffs(nb_model, hw22, tile_cols, gamma=0.04):
    """The tiny model has I = 128: tile_cols = 32 gives U = 4 units per expert (u = 1/4)."""
    conv = get_profile("faithful").derive(tile_cols=tile_cols, weight_streaming=False)
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=gamma, batch=128, bw_end_Bps=1e9)
    return nb.nb_coefficients(FREQS, **kw), kw


def _units(P, U):
    x = np.asarray(P) * U
    return np.abs(x - np.rint(x)).max()


def test_coefficients_carry_the_share_unit(nb_model, hw22):
    coeffs, _ = _grid_coeffs(nb_model, hw22, 32)
    assert coeffs.unit == 0.25 and coeffs.units == 4
    assert coeffs.to_dict()["share_unit"] == 0.25
    assert _grid_coeffs(nb_model, hw22, 1)[0].unit is None          # tile_cols = 1: continuous


def test_repair_and_wrap_starts_are_on_the_grid(nb_model):
    """f = (0.55, 0.45, 0.45, 0.55), EP = identity. With C = 10 TFLOPS the cap (11) is 0.5390625:
    nodes 0 and 3 are over by 0.0109; one unit of U = 8 (0.55/8 = 0.069 of load) fixes each and
    fits on a 0.45 node (0.519 ≤ 0.539), so the repair moves exactly one unit off each. With
    C = 1 TFLOPS the cap is 0.50390625: one unit of U = 4 (0.1375) fits nowhere, only swaps
    help (two units of a 0.55 and two of a 0.45 expert per node: load 0.5); the greedy repair
    and the snapped LP miss them, the integer repair finds them. Caps no on-grid point meets
    raise an error that says to use a finer tile."""
    import dataclasses

    from baselines.node_balance.model import membership, wrap_start

    f = np.array([0.55, 0.45, 0.45, 0.55])
    hw = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1000.0)
    # the cap values below are worked out with the fp16 1-D ring of R_cc, no α, no hop latency
    base = get_profile("faithful", b_psum=2, msg_alpha_s=0.0, hop_latency_s=0.0)
    conv4 = base.derive(tile_cols=32)
    coeffs4 = nb.nb_coefficients(f, model=nb_model, hw=hw, conv=conv4, gamma=0.02,
                                 batch=128, bw_end_Bps=1e12)
    assert coeffs4.load_cap == pytest.approx(0.50390625)
    swapped = nb.repair_placement(np.eye(4), coeffs4)
    assert _units(swapped, 4) < 1e-12 and (f @ swapped <= coeffs4.load_cap + 1e-9).all()
    assert np.allclose(swapped.sum(axis=1), 1.0)
    hw = HardwareSpec(mesh_shape=(2, 2), compute_tflops=10.0, link_bw_gbps=1000.0)
    conv = base.derive(tile_cols=16)
    coeffs = nb.nb_coefficients(f, model=nb_model, hw=hw, conv=conv, gamma=0.02, batch=128,
                                bw_end_Bps=1e12)
    assert coeffs.load_cap == pytest.approx(0.5390625) and coeffs.units == 8
    fixed = nb.repair_placement(np.eye(4), coeffs)
    assert _units(fixed, 8) < 1e-12 and (f @ fixed <= coeffs.load_cap + 1e-9).all()
    assert np.array_equal(fixed.sum(axis=1), np.ones(4))
    assert np.rint(fixed[0, 0] * 8) == 7 and np.rint(fixed[3, 3] * 8) == 7   # one unit moved
    # memory caps a continuous repair meets (Σ = 4.04 experts) but the grid does not:
    # ⌊8·cap⌋ = 8, 8, 8, 5 units < 32
    tight = dataclasses.replace(coeffs, mem_cap=np.array([1.1, 1.1, 1.1, 0.74]))
    with pytest.raises(InfeasibleError, match=r"tile grid \(unit 1/8\).*finer tile"):
        nb.repair_placement(np.eye(4), tight)
    wrap = wrap_start(coeffs, membership(GROUPS, 4), GFREQ)
    assert _units(wrap, 8) < 1e-12


def test_tp_ratio_cap_from_the_evaluators_collective(nb_model):
    """R_cc = t_comp_TP / t_TP with t_TP the collective the simulator charges (given)."""
    from hdamoe_env.config.profiles import get_profile
    from hdamoe_env.config.specs import HardwareSpec
    from hdamoe_env.cost import perf

    hw = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1.0)
    conv = get_profile("faithful")
    f = np.full(4, 0.5)
    kw = dict(model=nb_model, hw=hw, conv=conv, gamma=0.02, batch=128, bw_end_Bps=1e9)
    ring = nb.nb_coefficients(f, **kw)
    t_comp = float(perf.tp_expert_compute_time(nb_model, hw, conv, 128, num_nodes=4))
    fast = nb.nb_coefficients(f, **kw, tp_comm_s=t_comp)            # R_cc = 1
    assert fast.load_cap == pytest.approx(nb_model.top_k / 4 * 2.0)
    assert ring.load_cap == pytest.approx(perf.tp_ratio_cap(nb_model, hw, conv, 4, 128, 1e9))
    with pytest.raises(ConfigError, match="tp_comm_s"):
        nb.nb_coefficients(f, **kw, tp_comm_s=0.0)
