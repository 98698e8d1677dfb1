"""Tests of baselines.node_balance.heuristic (paper-model.md §7.6 item 6): on the tile grid the
heuristic placement is no worse than the snapped re-balancing LP on the same support.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.node_balance import milp as nb
from hdamoe_env.config.profiles import get_profile


# 4 experts, k = 2: all six pairs with distinct frequencies
GROUPS = np.array([[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]])
GFREQ = np.array([0.30, 0.05, 0.20, 0.10, 0.05, 0.30])
FREQS = np.array([GFREQ[(GROUPS == i).any(axis=1)].sum() for i in range(4)])


# ------------------------------------------------------------------------------ tile grid
def _grid_coeffs(nb_model, hw22, tile_cols, gamma=0.04):
    """The tiny model has I = 128: tile_cols = 32 gives U = 4 units per expert (u = 1/4)."""
    conv = get_profile("faithful").derive(tile_cols=tile_cols, weight_streaming=False)
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=gamma, batch=128, bw_end_Bps=1e9)
    return nb.nb_coefficients(FREQS, **kw), kw


def _units(P, U):
    x = np.asarray(P) * U
    return np.abs(x - np.rint(x)).max()


def test_heuristic_polish_is_no_worse_than_the_snapped_lp(nb_model, hw22):
    """§7.6 item 6 on the grid: the re-balancing LP's result, snapped and repaired on the grid
    and re-scored, never beats the heuristic's answer on the same support."""
    from baselines.node_balance.model import grid_feasible

    for tile in (32, 64):                                           # U = 4 and U = 2
        coeffs, _ = _grid_coeffs(nb_model, hw22, tile, gamma=0.01)
        P, info = nb.heuristic_placement(FREQS, GROUPS, GFREQ, coeffs)
        U = coeffs.units
        assert _units(P, U) < 1e-12
        snapped = grid_feasible(nb.rebalance_shares(P > 0, coeffs), coeffs)
        assert _units(snapped, U) < 1e-12
        obj = nb.exact_objective(P, coeffs, GROUPS, GFREQ)["objective_us"]
        assert obj <= nb.exact_objective(snapped, coeffs, GROUPS, GFREQ)["objective_us"] + 1e-9
        assert obj == pytest.approx(info["objective_us"])


# ------------------------------------------------------------------------------ compiled scan
def _reference_move(st):
    """The move the original scan keeps: every candidate scored by ``_State.trial`` in order."""
    from baselines.node_balance import heuristic as h

    u = st.node_time()
    w = st.c.kappa_us * st.mass
    best, best_trial = None, st.current()
    for move in h._candidate_moves(st, u, w):
        res = st.trial(*move)
        if res is not None and h._better(res[0], best_trial):
            best_trial, best = res[0], move
    return best


@pytest.mark.parametrize("tile", [None, 32])
def test_compiled_move_scan_equals_the_trial_by_trial_scan(nb_model, hw22, tile):
    """The compiled scan (and its incrementally refreshed gain/loss tables) picks the same move
    as scoring each candidate with ``_State.trial`` in order, along whole search paths from
    random starts, on and off the tile grid."""
    from baselines.node_balance import heuristic as h
    from baselines.node_balance.model import membership

    rng = np.random.default_rng(7)
    conv = get_profile("faithful").derive(tile_cols=tile or 1, weight_streaming=False)
    kw = dict(model=nb_model, hw=hw22, conv=conv, gamma=0.05, batch=128, bw_end_Bps=1e9)
    coeffs = nb.nb_coefficients(FREQS, **kw)
    member = membership(GROUPS, FREQS.size)
    D = coeffs.num_nodes
    checked = 0
    for _ in range(6):
        if tile is None:
            start = rng.dirichlet(np.full(D, 0.4), size=FREQS.size)
        else:
            U = coeffs.units
            start = np.stack([np.bincount(rng.integers(0, D, U), minlength=D) / U
                              for _ in FREQS])
        st = h._State(start, coeffs, member, GFREQ)
        for _ in range(30):
            ref = _reference_move(st)
            got = h._best_move(st, st.node_time(), st.current())
            assert (got is None) == (ref is None)
            if ref is None:
                break
            assert got[:3] == ref[:3] and got[3] == pytest.approx(ref[3], rel=0, abs=1e-15)
            st.apply(*got)
            checked += 1
            fresh = h._State(st.P, coeffs, member, GFREQ)
            np.testing.assert_array_equal(st.gain, fresh.gain)
            np.testing.assert_array_equal(st.loss, fresh.loss)
    assert checked >= 5
