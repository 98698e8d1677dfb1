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
