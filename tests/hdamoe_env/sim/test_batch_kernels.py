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


def _form_case(spread=True):
    """A predictor and three copies, copy 1 routed only to the popular experts (it needs the
    fallback); with ``spread`` copies 0 and 2 routed only to the others (the popular ones
    replace their slots), else to any expert. Returns the routing [L, T, k], rows, predictor,
    the kernel's model arguments and zeroed outputs of 4 rows."""
    from hdamoe_env.decisions.prediction import StepPredictor

    rng = np.random.default_rng(2)
    L, T, B, k, E, D = 3, 50, 8, 6, 16, 4
    low = k if spread else 0
    routing = np.stack([np.stack([low + rng.permutation(E - low)[:k] for _ in range(T)])
                        for _ in range(L)]).astype(np.int16)
    routing[:, :B] = np.arange(k)                  # rows 0..B-1: the popular experts only
    freqs = np.full((L, E), 1e-9)
    freqs[:, :k] = 1.0
    support = rng.random((L, E, D)) < 0.4
    support[:, :, 0] |= ~support.any(axis=2)
    pred = StepPredictor("noisy_oracle", freqs, k, B, np.full(L, 0.5))
    rows = np.stack([rng.choice(np.arange(B, T), B, replace=False), np.arange(B),
                     rng.choice(np.arange(B, T), B, replace=False)]).astype(np.int64)
    model = (pred.row_acc, pred.layer_rows, pred.sampler.prob, pred.alias64, E, 3,
             *holder_csr(support), D, True)
    out = [np.zeros((4, L, B, k), dtype=np.int64), np.zeros((4, L, E)), np.zeros((4, L)),
           np.zeros((4, L, B, k), dtype=np.int64), np.zeros((4, L, E))]
    return routing, rows, pred, model, out


def test_form_steps_par_equals_form_steps_and_flags_the_fallback_copy():
    """``form_steps_par`` writes every unflagged copy's rows and advances its generator as the
    serial ``form_steps``; it flags exactly the copy that needs the fallback."""
    from hdamoe_env.decisions import prediction_kernels
    from hdamoe_env.sim.batch_kernels import form_steps, form_steps_par

    routing, rows, _, model, want = _form_case()
    got = _form_case()[4]
    routing_t = np.ascontiguousarray(routing.transpose(1, 0, 2))
    idx = np.array([2, 0, 3])
    gens = [np.random.default_rng(40 + j) for j in range(3)]
    ref = [np.random.default_rng(40 + j) for j in range(3)]
    addr = [np.array([prediction_kernels.generator_state(g) for g in gs], dtype=np.uint64)
            for gs in (gens, ref)]
    pending = form_steps_par(routing_t, rows, idx, addr[0], *model, *got)
    np.testing.assert_array_equal(pending, [False, True, False])
    for j in (0, 2):                                    # serially, one copy per call
        stop = form_steps(routing_t, rows[j:j + 1], idx[j:j + 1], addr[1][j:j + 1], 0, *model,
                          *want)[0]
        assert stop == 1
        i = int(idx[j])
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a[i], b[i])
        assert gens[j].random() == ref[j].random()
    assert form_steps(routing_t, rows[1:2], idx[1:2], addr[1][1:2], 0, *model, *want)[0] == 0


def test_form_steps_equals_gather_tables_and_predict_per_copy():
    """One ``form_steps`` call for every copy = per copy: ``routing[:, rows]``, ``step_tables``
    and ``StepPredictor.predict`` on the copy's own generator (same stream position after), the
    pathological-popularity fallback included (copy 1 routes only to the popular experts)."""
    from hdamoe_env.decisions import prediction_kernels
    from hdamoe_env.sim.batch_kernels import form_steps

    routing, rows, pred, model, out = _form_case(spread=False)
    h_ptr, h_node, D = model[6], model[7], model[8]
    E, n = pred.num_experts, 3
    idx = np.array([2, 0, 3])
    gens = [np.random.default_rng(40 + j) for j in range(n)]
    states = np.array([prediction_kernels.generator_state(g) for g in gens], dtype=np.uint64)
    routing_t = np.ascontiguousarray(routing.transpose(1, 0, 2))
    start, fallbacks = 0, 0
    while start < n:
        stop, count, prow, pcol = form_steps(routing_t, rows, idx, states, start, *model, *out)
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
