"""The compiled row loop of hardware-aware gating (hdamoe_env.decisions.gating_kernels) against the
pure-Python oracle ``gating_reference.greedy_reference``: the same sets, weights and positions on
random problems, the prefix fallback, the candidate sort and the one-call fused path.
"""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from tests.hdamoe_env.decisions import gating_reference  # the pure-Python oracle


# ------------------------------------------------------------------ compiled kernel vs oracle
def _random_case(rng: np.random.Generator):
    """A random gating problem: placement, scores (full rows or candidates) and options."""
    from hdamoe_env.decisions import gating

    E = int(rng.choice([4, 8, 16, 64]))
    D = int(rng.choice([2, 4, 8]))
    k = int(rng.integers(1, min(6, E) + 1))
    B = int(rng.integers(1, 48))
    P = np.zeros((E, D))
    for i in range(E):                                  # random holders and shares
        hold = rng.choice(D, size=int(rng.integers(1, D + 1)), replace=False)
        share = rng.dirichlet(np.ones(hold.size))
        P[i, hold] = share
    if rng.random() < 0.3:
        P[rng.integers(E)] = 1.0 / D                      # a TP-split expert
    if rng.random() < 0.5:
        scores = rng.dirichlet(np.full(E, 0.3), size=B)
    else:
        scores = np.round(rng.random((B, E)), 1)          # many exact ties
    if rng.random() < 0.3:                              # candidate form (ids, scores)
        width = int(rng.integers(k, E + 1))
        ids = np.stack([rng.permutation(E)[:width] for _ in range(B)])
        scores = (ids, np.take_along_axis(scores, ids, axis=1))
    sign = -1.0 if rng.random() < 0.8 else 1.0          # positive coefficients: no pruning
    opts = dict(
        comp_penalty=str(rng.choice(gating.COMP_PENALTIES)),
        comm_penalty=str(rng.choice(gating.COMM_PENALTIES)),
        protect_top=int(rng.integers(0, k + 1)) if rng.random() < 0.3 else 0,
        candidate_window=int(rng.integers(0, 6)) if rng.random() < 0.3 else None,
        include_future=bool(rng.random() < 0.3),
    )
    n0 = rng.integers(0, 4, E) if rng.random() < 0.3 and not opts["include_future"] else None
    rc = sign * float(10 ** rng.uniform(2, 6))
    rm = -float(10 ** rng.uniform(-4, -0.5)) if rng.random() < 0.9 else 0.0
    return scores, k, P, rc, rm, opts, n0


def test_compiled_greedy_equals_python_oracle_on_random_cases():
    from hdamoe_env.decisions import gating

    rng = np.random.default_rng(2024)
    for case in range(400):
        scores, k, P, rc, rm, opts, n0 = _random_case(rng)
        cands = gating._candidates(scores, k, P.shape[0], opts["candidate_window"])
        args = (cands, k, P, 2e6, 1e12, rc, rm, opts["comp_penalty"], opts["comm_penalty"],
                opts["protect_top"], opts["include_future"], n0)
        fast = gating._greedy(*args)
        ref = gating_reference.greedy_reference(*args)
        for got, want, what in zip(fast, ref, ("sets", "weights", "positions"), strict=True):
            assert got.dtype == want.dtype, (case, what)
            np.testing.assert_array_equal(got, want, err_msg=f"case {case}: {what} {opts}")


def _random_tile_cost(rng: np.random.Generator, P: np.ndarray):
    """Random tile-model tables on P's support: rows, GEMM overhead, streaming, token tile."""
    from hdamoe_env.decisions import gating

    # seconds per padded row on a coarse grid (many exact ties between nodes) or continuous
    if rng.random() < 0.5:
        row_s = np.ceil(P * 4) * 1e-7
    else:
        row_s = np.where(P > 0, rng.uniform(0.2, 2.0, P.shape) * 1e-7, 0.0)
    stream = (np.where(P > 0, P * float(rng.choice([1e-7, 5e-6, 3e-5])), 0.0)
              if rng.random() < 0.7 else np.zeros_like(P))
    gemm_s = float(rng.choice([0.0, 1e-7, 3e-7]))
    return gating.TileCost(row_s, gemm_s, stream, int(rng.choice([1, 2, 4, 8])))


def test_compiled_tiled_greedy_equals_python_oracle_on_random_cases():
    """The tile-aware penalties (every computation and communication penalty, include_future,
    integer initial counts, protect_top, windows): kernel == oracle bit for bit."""
    from hdamoe_env.decisions import gating

    rng = np.random.default_rng(2025)
    changed = 0
    for case in range(300):
        scores, k, P, rc, rm, opts, n0 = _random_case(rng)
        tile = _random_tile_cost(rng, P)
        cands = gating._candidates(scores, k, P.shape[0], opts["candidate_window"])
        args = (cands, k, P, 2e6, 1e12, rc, rm, opts["comp_penalty"], opts["comm_penalty"],
                opts["protect_top"], opts["include_future"], n0, tile)
        fast = gating._greedy(*args)
        ref = gating_reference.greedy_reference(*args)
        for got, want, what in zip(fast, ref, ("sets", "weights", "positions"), strict=True):
            assert got.dtype == want.dtype, (case, what)
            np.testing.assert_array_equal(got, want, err_msg=f"case {case}: {what} {opts}")
        fluid = gating._greedy(*args[:-1])
        changed += not np.array_equal(fluid[0], fast[0])
    assert changed >= 30                     # the tile model changes the decisions often


def test_compiled_greedy_exercises_the_prefix_fallback():
    """Rows whose scan runs off the sorted prefix take the whole row (``full_row``)."""
    from hdamoe_env.decisions import gating

    E, D, k = 64, 8, 2
    P = np.zeros((E, D))
    P[np.arange(E), np.arange(E) % D] = 1.0
    s = np.full((4, E), 0.01)
    s[:, :10] = np.linspace(0.2, 0.1, 10)                # 10 strong experts, all on few nodes
    cands = gating._candidates(s, k, E, None)
    assert cands.ids.shape[1] < cands.width              # a prefix, not the whole row
    n0 = np.zeros(E)
    n0[20] = 100.0                                       # node 4 busy; positive r_comp favours it
    args = (cands, k, P, 1.0, 1.0, 5.0, 0.0, "host_finish", "dispersion", 0, False, n0)
    fast, ref = gating._greedy(*args), gating_reference.greedy_reference(*args)
    for got, want in zip(fast, ref, strict=True):
        np.testing.assert_array_equal(got, want)
    assert fast[2].max() >= cands.ids.shape[1]          # a position beyond the prefix was chosen


@pytest.mark.parametrize("E,k,width", [(16, 4, 12), (64, 16, 64), (8, 2, 8)])
def test_compiled_candidate_sort_equals_numpy_stable_sort(E, k, width):
    from hdamoe_env.decisions import gating

    rng = np.random.default_rng(E + k)
    vals = np.round(rng.random((50, width)), 1)          # many exact ties, some -0.0 / 0.0
    vals[0, :3] = [0.0, -0.0, 0.0]
    ids = np.stack([rng.permutation(E)[:width] for _ in range(50)])
    order = np.argsort(-vals, axis=1, kind="stable")
    for scores, want_ids in (((ids, vals), np.take_along_axis(ids, order, axis=1)),
                             (vals, order) if width == E else ((ids, vals), None)):
        if want_ids is None:
            continue
        c = gating._candidates(scores, k, E, None)
        assert c.ids.shape[1] == width                  # no prefix: the compiled sort
        np.testing.assert_array_equal(c.ids, want_ids)
        np.testing.assert_array_equal(c.vals, np.take_along_axis(vals, order, axis=1))


def test_fused_path_equals_general_path_field_by_field(monkeypatch):
    """The env's one-call path (``_fused_gating``) returns exactly the general path's result."""
    from hdamoe_env.decisions import gating

    rng = np.random.default_rng(77)
    used = 0
    for case in range(300):
        E = int(rng.choice([8, 16, 64]))
        D = int(rng.choice([2, 4, 8]))
        k = int(rng.integers(1, 7))
        width = int(rng.integers(k, min(E, 4 * k + 4) + 1))
        B = int(rng.integers(1, 64))
        P = np.zeros((E, D))
        for i in range(E):
            hold = rng.choice(D, size=int(rng.integers(1, D + 1)), replace=False)
            P[i, hold] = rng.dirichlet(np.ones(hold.size))
        ids = np.stack([rng.permutation(E)[:width] for _ in range(B)]).astype(np.int64)
        vals = np.round(rng.random((B, width)), int(rng.integers(1, 4)))
        kw = dict(comp_penalty=str(rng.choice(gating.COMP_PENALTIES)),
                  comm_penalty=str(rng.choice(gating.COMM_PENALTIES)),
                  protect_top=int(rng.integers(0, k + 1)) if rng.random() < 0.3 else 0,
                  renormalize=bool(rng.random() < 0.5), diagnostics=False)
        rc = -float(10 ** rng.uniform(3, 7)) * (1 if rng.random() < 0.9 else -1)
        rm = -float(10 ** rng.uniform(-4, -0.5))
        args = ((ids, vals), k, P, 2e6, 1e12, rc, rm)
        fast = gating.hardware_aware_gating(*args, **kw)
        assert gating._fused_gating(*args[:1], k, P, 2e6, 1e12, rc, rm, kw["comp_penalty"],
                                    kw["comm_penalty"], kw["protect_top"], None, False, None,
                                    False, kw["renormalize"]) is not None
        used += 1
        with monkeypatch.context() as m:           # the general path: no one-call fast path
            m.setattr(gating, "_fused_gating", lambda *a, **k: None)
            slow = gating.hardware_aware_gating(*args, **kw)
        for field in ("sets", "weights", "orig_sets", "replaced_per_rank"):
            np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field),
                                          err_msg=f"case {case} {field}")
        for field in ("changed_fraction", "changed_choices", "top1_retention",
                      "score_mass_kept"):
            assert getattr(fast, field) == getattr(slow, field), (case, field)
    assert used == 300


def test_fused_tiled_path_equals_general_path(monkeypatch):
    """With a ``TileCost`` the one-call path returns exactly the general path's result."""
    from hdamoe_env.decisions import gating

    rng = np.random.default_rng(78)
    for case in range(150):
        E = int(rng.choice([8, 16, 64]))
        D = int(rng.choice([2, 4, 8]))
        k = int(rng.integers(1, 7))
        width = int(rng.integers(k, min(E, 4 * k + 4) + 1))
        B = int(rng.integers(1, 64))
        P = np.zeros((E, D))
        for i in range(E):
            hold = rng.choice(D, size=int(rng.integers(1, D + 1)), replace=False)
            P[i, hold] = rng.dirichlet(np.ones(hold.size))
        tile = _random_tile_cost(rng, P)
        ids = np.stack([rng.permutation(E)[:width] for _ in range(B)]).astype(np.int64)
        vals = np.round(rng.random((B, width)), int(rng.integers(1, 4)))
        kw = dict(comp_penalty=str(rng.choice(gating.COMP_PENALTIES)),
                  comm_penalty=str(rng.choice(gating.COMM_PENALTIES)),
                  protect_top=int(rng.integers(0, k + 1)) if rng.random() < 0.3 else 0,
                  diagnostics=False, tile_cost=tile)
        rc = -float(10 ** rng.uniform(3, 7))
        rm = -float(10 ** rng.uniform(-4, -0.5))
        args = ((ids, vals), k, P, 2e6, 1e12, rc, rm)
        assert gating._fused_gating(*args, kw["comp_penalty"], kw["comm_penalty"],
                                    kw["protect_top"], None, False, None, False, False,
                                    tile) is not None
        fast = gating.hardware_aware_gating(*args, **kw)
        with monkeypatch.context() as m:
            m.setattr(gating, "_fused_gating", lambda *a, **k: None)
            slow = gating.hardware_aware_gating(*args, **kw)
        for field in ("sets", "weights", "orig_sets", "replaced_per_rank"):
            np.testing.assert_array_equal(getattr(fast, field), getattr(slow, field),
                                          err_msg=f"case {case} {field}")


def test_incremental_tile_costs_equal_the_tile_cost_formula():
    """``add_expert``/``remove_expert`` (the kernels' running costs, token by token) equal
    ``TileCost.node_cost`` of the counts up to rounding, and ``tile_step`` charges a whole tile
    exactly when a token opens one."""
    from hdamoe_env.decisions import gating, gating_kernels

    assert [gating_kernels.tile_step(n, 1.0, 0.5, 4) for n in range(6)] == \
        [4.5, 0.0, 0.0, 0.0, 4.0, 0.0]
    rng = np.random.default_rng(5)
    for _ in range(40):
        E, D = int(rng.integers(2, 12)), int(rng.integers(1, 6))
        P = np.zeros((E, D))
        for i in range(E):
            hold = rng.choice(D, size=int(rng.integers(1, D + 1)), replace=False)
            P[i, hold] = rng.dirichlet(np.ones(hold.size))
        tile = _random_tile_cost(rng, P)
        _, h_ptr, h_node, h_wc, _, _ = gating._prepared_arrays(P, 1.0)
        h_row, h_stream = gating._prepared_tiles(P, tile)
        counts = np.zeros(E, dtype=np.int64)
        tiles = (counts, np.zeros(D), np.zeros(D), h_row, h_stream, float(tile.gemm_s),
                 int(tile.tile_tokens), True)
        loads = np.zeros(D)
        peak = 0.0
        for i in rng.integers(0, E, 60):
            peak = gating_kernels.add_expert(int(i), loads, peak, h_ptr, h_node, h_wc, tiles)
        want = tile.node_cost(counts)
        np.testing.assert_allclose(loads, want, rtol=1e-12, atol=1e-18)
        assert peak == loads.max()
        for i in np.flatnonzero(counts)[:3]:
            gating_kernels.remove_expert(int(i), loads, h_ptr, h_node, h_wc, tiles)
        np.testing.assert_allclose(loads, tile.node_cost(counts), rtol=1e-9, atol=1e-15)


def test_fused_path_rejects_invalid_input_like_the_general_path():
    from hdamoe_env.decisions import gating

    P = np.eye(4)
    ids = np.array([[0, 5]], dtype=np.int64)
    with pytest.raises(ConfigError, match="candidate ids must lie"):
        gating.hardware_aware_gating((ids, np.array([[0.5, 0.4]])), 1, P, 1.0, 1.0, -1.0, -0.1,
                                     diagnostics=False)
    with pytest.raises(ConfigError, match="finite"):
        gating.hardware_aware_gating((np.array([[0, 1]], dtype=np.int64),
                                      np.array([[np.nan, 0.4]])), 1, P, 1.0, 1.0, -1.0, -0.1,
                                     diagnostics=False)
