"""Tests of baselines.node_balance.milp (paper-model.md §7): the MILP against brute force, caps,
warm starts, the MILP objective under group compression, solvers, the heuristic mode, outputs on
the tile grid."""

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


def brute_force(coeffs: nb.NodeBalanceCoefficients) -> float:
    """Exact optimum by enumerating every support Z (rows non-empty) of a 4×4 problem.

    For a fixed support the optimal shares minimise the max node load; by the max-flow/min-cut
    (Hall) argument that minimum is max over node subsets S of (Σ f_i over experts whose support
    lies in S) / |S|. Communication (Eq. 2) depends only on the support. Valid without weight
    streaming and with non-binding caps (checked by the caller).
    """
    E, D = 4, 4
    rows = [np.array(bits, bool) for bits in itertools.product([0, 1], repeat=D) if any(bits)]
    Z = np.array([np.stack(c) for c in itertools.product(rows, repeat=E)])   # [N, E, D]
    subsets = [np.array(bits, bool) for bits in itertools.product([0, 1], repeat=D) if any(bits)]
    best_load = np.zeros(Z.shape[0])
    for S in subsets:
        inside = ~(Z & ~S).any(axis=2)                                        # [N, E]
        best_load = np.maximum(best_load, inside @ coeffs.freqs / S.sum())
    member = np.zeros((len(GROUPS), E))
    for g, row in enumerate(GROUPS):
        member[g, row] = 1
    touch = np.einsum("ge,ned->ngd", member, Z) > 0
    mass = np.einsum("g,ngd->nd", GFREQ, touch).max(axis=1)
    obj = coeffs.alpha_us * best_load + coeffs.comm_factor * coeffs.kappa_us * mass
    return float(obj.min())


@pytest.mark.parametrize("profile", ["paper", "faithful"])
def test_milp_optimum_equals_brute_force(nb_model, hw22, profile):
    """§7.3: the MILP (with constraint (6) in the profile's form) reaches the exact optimum."""
    conv = get_profile(profile)
    if conv.weight_streaming:
        conv = conv.derive(weight_streaming=False)     # brute force covers Eq. 1 without (9b)
    gamma = 0.02 if profile == "paper" else 0.04
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=gamma, batch=128, bw_end_Bps=1e9)
    coeffs = nb.nb_coefficients(FREQS, **kw)
    assert coeffs.load_cap > FREQS.sum()              # cap (11) not binding here
    expected = brute_force(coeffs)
    res = nb.node_balance(FREQS, GROUPS, GFREQ, **kw, mode="milp", mip_gap=1e-9,
                          time_limit_s=30, warm_start="none")
    assert res.record["solver"]["sol_status"] == 1
    assert res.record["path"] == "milp-optimal"
    assert res.record["objective_us"] == pytest.approx(expected, rel=1e-6)
    # the optimum is non-trivial: better than TP and than whole-expert EP
    tp = nb.exact_objective(nb.tp_start(4, 4), coeffs, GROUPS, GFREQ)["objective_us"]
    assert expected < tp - 1e-6
    # the heuristic is feasible and no better than the optimum
    P_h, _ = nb.heuristic_placement(FREQS, GROUPS, GFREQ, coeffs)
    assert nb.exact_objective(P_h, coeffs, GROUPS, GFREQ)["objective_us"] >= expected - 1e-9


@pytest.mark.parametrize("mode", ["milp", "heuristic"])
def test_rho_mem_respected(nb_model, hw22, mode):
    """§7.3 (10): Σ_i P_ic ≤ ρ_mem·E/D on every node."""
    conv = get_profile("paper")                     # small γ: compute balance dominates
    res = nb.node_balance(FREQS, GROUPS, GFREQ, model=nb_model, hw=hw22, conv=conv, gamma=0.001,
                          batch=128, bw_end_Bps=1e9, rho_mem=1.0, mode=mode, time_limit_s=20)
    P = res.P_layer
    assert np.allclose(P.sum(axis=1), 1)
    assert (P.sum(axis=0) <= 1.0 + 1e-6).all()
    free = nb.node_balance(FREQS, GROUPS, GFREQ, model=nb_model, hw=hw22, conv=conv, gamma=0.001,
                           batch=128, bw_end_Bps=1e9, mode=mode, time_limit_s=20)
    assert free.P_layer.sum(axis=0).max() > 1.0 + 1e-6      # the cap changed the answer


def test_infeasible_caps_raise_clear_errors(nb_model, hw22):
    conv = get_profile("paper")
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=0.02, batch=128, bw_end_Bps=1e9)
    with pytest.raises(InfeasibleError, match=r"rho_mem=0.5 .* E=4"):
        nb.node_balance(FREQS, GROUPS, GFREQ, **kw, rho_mem=0.5)
    w_e = nb_model.hidden_size * nb_model.expert_intermediate * conv.b_w * conv.expert_matrices
    with pytest.raises(InfeasibleError, match="GiB"):
        nb.node_balance(FREQS, GROUPS, GFREQ, **kw, node_dram_bytes=0.5 * w_e)
    with pytest.raises(ConfigError, match="mode"):
        nb.node_balance(FREQS, GROUPS, GFREQ, **kw, mode="exact")


def test_absolute_dram_cap_respected(nb_model, hw22):
    conv = get_profile("paper")
    w_e = nb_model.hidden_size * nb_model.expert_intermediate * conv.b_w * conv.expert_matrices
    res = nb.node_balance(FREQS, GROUPS, GFREQ, model=nb_model, hw=hw22, conv=conv, gamma=0.02,
                          batch=128, bw_end_Bps=1e9, node_dram_bytes=1.0 * w_e, mode="heuristic")
    assert (res.P_layer.sum(axis=0) * w_e <= 1.0 * w_e * (1 + 1e-6)).all()
    assert res.record["coefficients"]["mem_cap_source"] == "node_dram_bytes"


def test_warm_starts_are_feasible(nb_model):
    """§7.6 item 1: TP is feasible; an EP start violating the TP-ratio cap is repaired."""
    hw = HardwareSpec(mesh_shape=(2, 2), compute_tflops=1.0, link_bw_gbps=1000.0)
    conv = get_profile("paper")
    f = np.array([0.8, 0.6, 0.4, 0.2])
    coeffs = nb.nb_coefficients(f, model=nb_model, hw=hw, conv=conv, gamma=0.5, batch=128,
                                bw_end_Bps=1e12, rho_mem=1.0)
    assert coeffs.load_cap < f.max()                  # whole-expert EP violates (11)
    tp = nb.tp_start(4, 4)
    assert nb.is_feasible(tp, coeffs)
    ep = np.eye(4)
    assert not nb.is_feasible(ep, coeffs)
    repaired = nb.repair_placement(ep, coeffs)
    assert nb.is_feasible(repaired, coeffs)
    assert np.allclose(repaired.sum(axis=1), 1)
    res = nb.node_balance(f, GROUPS, GFREQ, model=nb_model, hw=hw, conv=conv, gamma=0.5,
                          batch=128, bw_end_Bps=1e12, rho_mem=1.0, ep_start=ep, time_limit_s=20)
    assert nb.is_feasible(res.P_layer, coeffs)
    assert res.record["warm_start"]["source"] in ("tp", "ep-repaired", "heuristic")


def test_residual_compression_upper_bounds_touch_mass(nb_model, hw22):
    """The residual φ_i·Z_ic term never under-estimates the dropped groups' touch mass."""
    rng = np.random.default_rng(1)
    groups = np.array(list(itertools.combinations(range(4), 2)))
    freqs = rng.dirichlet(np.ones(6))
    comp = nb.compress_groups(groups, freqs, 4, mass=0.5, compress_above=0)
    coeffs = nb.nb_coefficients(FREQS, model=nb_model, hw=hw22, conv=get_profile("paper"),
                                gamma=0.02, batch=128, bw_end_Bps=1e9)
    for _ in range(20):
        P = rng.dirichlet(np.ones(4) * 0.3, size=4)
        P[P < 0.05] = 0
        P /= P.sum(axis=1, keepdims=True)
        _, _, comm_milp = nb._milp_objective(P, coeffs, comp)
        exact = nb.exact_objective(P, coeffs, groups, freqs)["t_comm_us"]
        assert comm_milp >= exact - 1e-9


def test_solver_factory():
    slv, name = nb.make_solver(None, 10, 0.05, 1)
    assert name in nb.SOLVERS
    slv, name = nb.make_solver("cbc", 10, 0.05, 1)
    assert name == "cbc"
    with pytest.raises(ConfigError, match="unknown MILP solver"):
        nb.make_solver("gurobi", 10, 0.05, 1)
    with pytest.raises(ConfigError, match="time_limit_s"):
        nb.make_solver(None, 0, 0.05, 1)


def test_cbc_path_records_status(nb_model, hw22):
    res = nb.node_balance(FREQS, GROUPS, GFREQ, model=nb_model, hw=hw22,
                          conv=get_profile("paper"), gamma=0.02, batch=128, bw_end_Bps=1e9,
                          solver="cbc", time_limit_s=20)
    rec = res.record["solver"]
    assert rec["solver"] == "cbc" and rec["sol_status"] in (1, 2)
    assert "CBC" in rec["solver_version"]
    assert res.record["path"] in ("milp-optimal", "milp-feasible", "warm-start")


def test_heuristic_mode_is_deterministic_and_valid(nb_model, hw22):
    kw = dict(model=nb_model, hw=hw22, conv=get_profile("faithful"), gamma=0.5, batch=128,
              bw_end_Bps=1e9, mode="heuristic", seed=3)
    a = nb.node_balance(FREQS, GROUPS, GFREQ, **kw)
    b = nb.node_balance(FREQS, GROUPS, GFREQ, **kw)
    assert np.array_equal(a.P_layer, b.P_layer)
    assert a.record["path"] in ("heuristic", "tp", "ep-repaired")
    assert np.allclose(a.P_layer.sum(axis=1), 1) and (a.P_layer >= 0).all()
    assert a.record["objective_us"] <= a.record["candidates"]["tp"] + 1e-9


# ------------------------------------------------------------------------------ tile grid
def _grid_coeffs(nb_model, hw22, tile_cols, gamma=0.04):
    """The tiny model has I = 128: tile_cols = 32 gives U = 4 units per expert (u = 1/4)."""
    conv = get_profile("faithful").derive(tile_cols=tile_cols, weight_streaming=False)
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=gamma, batch=128, bw_end_Bps=1e9)
    return nb.nb_coefficients(FREQS, **kw), kw


def _units(P, U):
    x = np.asarray(P) * U
    return np.abs(x - np.rint(x)).max()


@pytest.mark.parametrize("mode", ["heuristic", "milp"])
def test_outputs_are_on_the_grid_and_no_better_than_continuous(nb_model, hw22, mode):
    """U = 4: every share is 0, 1/4, 1/2, 3/4 or 1; the grid optimum cannot beat the continuous
    optimum (the grid is a subset), and the MILP on the grid is at least as good as the
    heuristic on the grid."""
    coeffs, kw = _grid_coeffs(nb_model, hw22, 32)
    grid = nb.node_balance(FREQS, GROUPS, GFREQ, **kw, mode=mode, mip_gap=1e-9, time_limit_s=30)
    assert _units(grid.P_layer, 4) < 1e-12
    _, kw1 = _grid_coeffs(nb_model, hw22, 1)
    cont = nb.node_balance(FREQS, GROUPS, GFREQ, **kw1, mode="milp", mip_gap=1e-9,
                           time_limit_s=30)
    assert grid.record["objective_us"] >= cont.record["objective_us"] - 1e-9
    if mode == "milp":
        assert grid.record["path"] in ("milp-optimal", "warm-start")
        heur = nb.node_balance(FREQS, GROUPS, GFREQ, **kw, mode="heuristic")
        assert grid.record["objective_us"] <= heur.record["objective_us"] + 1e-9


