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
