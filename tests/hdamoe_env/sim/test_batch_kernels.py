"""Tests of hdamoe_env.sim.batch_kernels: the per-decode-step counts and V_c peaks (§5.2, §5.5)."""

from __future__ import annotations

import numpy as np

from hdamoe_env.sim.batch_kernels import holder_csr, step_tables


def test_step_tables_equal_bincount_and_max_touch():
    rng = np.random.default_rng(0)
    n, L, B, k, E, D = 3, 4, 16, 4, 12, 6
    support = rng.random((L, E, D)) < 0.3
    support[:, :, 0] |= ~support.any(axis=2)                        # every expert held somewhere
    sets = np.stack([[np.stack([rng.choice(E, k, replace=False) for _ in range(B)])
                      for _ in range(L)] for _ in range(n)]).astype(np.int64)
    counts, peak = step_tables(sets, *holder_csr(support), E, D)
    for j in range(n):
        for layer in range(L):
            np.testing.assert_array_equal(counts[j, layer],
                                          np.bincount(sets[j, layer].ravel(), minlength=E))
            touch = support[layer][sets[j, layer]].any(axis=1).sum(axis=0).max()
            assert peak[j, layer] == touch


def test_form_steps_equals_gather_tables_and_predict_per_copy():
    """One ``form_steps`` call for every copy = per copy: ``routing[:, rows]``, ``step_tables``
    and ``StepPredictor.predict`` on the copy's own generator (same stream position after), the
    pathological-popularity fallback included (copy 1 routes only to the popular experts)."""
    from hdamoe_env.decisions import prediction_kernels
    from hdamoe_env.decisions.prediction import StepPredictor
    from hdamoe_env.sim.batch_kernels import form_steps

    rng = np.random.default_rng(2)
    L, T, B, k, E, D, n = 3, 50, 8, 6, 16, 4, 3
    routing = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(T)])
                        for _ in range(L)]).astype(np.int16)
    routing[:, :B] = np.arange(k)                  # rows 0..B-1: the popular experts only
    freqs = np.full((L, E), 1e-9)
    freqs[:, :k] = 1.0
    support = rng.random((L, E, D)) < 0.4
    support[:, :, 0] |= ~support.any(axis=2)
    h_ptr, h_node = holder_csr(support)
    pred = StepPredictor("noisy_oracle", freqs, k, B, np.full(L, 0.5))
    rows = np.stack([rng.choice(np.arange(B, T), B, replace=False), np.arange(B),
                     rng.choice(np.arange(B, T), B, replace=False)]).astype(np.int64)
    idx = np.array([2, 0, 3])
    N = 4
    out = [np.zeros((N, L, B, k), dtype=np.int64), np.zeros((N, L, E)), np.zeros((N, L)),
           np.zeros((N, L, B, k), dtype=np.int64), np.zeros((N, L, E))]
    gens = [np.random.default_rng(40 + j) for j in range(n)]
    states = np.array([prediction_kernels.generator_state(g) for g in gens], dtype=np.uint64)
    routing_t = np.ascontiguousarray(routing.transpose(1, 0, 2))
    start, fallbacks = 0, 0
    while start < n:
        stop, count, prow, pcol = form_steps(routing_t, rows, idx, states, start, pred.row_acc,
                                             pred.layer_rows, pred.sampler.prob, pred.alias64,
                                             E, 3, h_ptr, h_node, D, True, *out)
        if stop < n:
            fallbacks += 1
            i = int(idx[stop])
            pred.fallback(out[0][i], gens[stop], count, prow, pcol, out[3][i], out[4][i])
        start = stop + 1
    assert fallbacks >= 1
    for j in range(n):
        i = int(idx[j])
        sets = routing[:, rows[j]].astype(np.int64)
        np.testing.assert_array_equal(out[0][i], sets)
        counts, peak = step_tables(sets[None], h_ptr, h_node, E, D)
        np.testing.assert_array_equal(out[1][i], counts[0])
        np.testing.assert_array_equal(out[2][i], peak[0])
        ref = np.random.default_rng(40 + j)
        want = pred.predict(sets, rows[j], ref)
        np.testing.assert_array_equal(out[3][i], want.sets)
        np.testing.assert_array_equal(out[4][i], want.counts)
        assert gens[j].random() == ref.random()
    assert not out[0][1].any()                       # row 1 untouched
