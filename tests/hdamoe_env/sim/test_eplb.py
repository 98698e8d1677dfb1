"""EPLB's per-layer core (hdamoe_env.sim.eplb), shared by baselines.eplb and the drift env."""

import numpy as np
import pytest

import baselines.eplb as offline
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.env import drift
from hdamoe_env.sim.eplb import balanced_packing, eplb_layer, replicate


def _restated_layer(f, D, S):
    """The drift env's former one-layer restatement of EPLB (the results must not change)."""
    E = f.size
    counts = np.ones(E, dtype=np.int64)
    for _ in range(min(D * S, E * D) - E):
        per_copy = np.where(counts < D, f / counts, -np.inf)
        counts[int(np.argmax(per_copy))] += 1
    items = np.repeat(np.arange(E), counts)
    w = (f / counts)[items]
    holds = np.zeros((E, D), dtype=bool)
    load = np.zeros(D)
    used = np.zeros(D, dtype=np.int64)
    for it in np.lexsort((items, -w)):
        i = int(items[it])
        ok = (used < S) & ~holds[i]
        if not ok.any():
            counts[i] -= 1
            continue
        d = int(np.argmin(np.where(ok, load, np.inf)))
        holds[i, d] = True
        load[d] += w[it]
        used[d] += 1
    return counts, holds


def test_one_implementation_everywhere():
    assert drift.eplb_layer is eplb_layer
    assert offline.replicate is replicate
    assert offline.balanced_packing is balanced_packing


@pytest.mark.parametrize("E,D", [(64, 32), (8, 32), (16, 4), (5, 3), (160, 32)])
def test_eplb_layer_is_unchanged_and_matches_the_offline_global_policy(E, D):
    rng = np.random.default_rng(E * 100 + D)
    need = -(-E // D)
    for S in range(need, need + 3):
        for t in range(12):
            f = (rng.dirichlet(np.full(E, 0.3)) if t % 3 == 0 else
                 rng.integers(0, 4, E).astype(float) if t % 3 == 1 else rng.gamma(1.0, size=E))
            counts, holds = eplb_layer(f, D, S)
            c0, h0 = _restated_layer(f, D, S)
            np.testing.assert_array_equal(counts, c0)
            np.testing.assert_array_equal(holds, h0)
            ref = offline.eplb(f, D, S)
            np.testing.assert_array_equal(ref.counts[0], counts)
            np.testing.assert_array_equal(ref.holds[0], holds)


def test_eplb_layer_rejects_too_few_slots_and_bad_loads():
    with pytest.raises(ConfigError):
        eplb_layer(np.ones(16), 2, 4)
    with pytest.raises(ConfigError):
        eplb_layer(np.array([1.0, -1.0]), 2, 1)
