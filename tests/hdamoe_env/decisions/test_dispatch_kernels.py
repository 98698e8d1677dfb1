"""The compiled replica dispatch (``hdamoe_env.decisions.dispatch_kernels``) against the Python
loop it replaces (``dispatch._assign_python``): equal results, bit for bit, for every rule the
kernel runs, on random layers with whole and sharded primary groups and replicas."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.decisions import dispatch


def _random_layer(rng: np.random.Generator, E: int, D: int, B: int, k: int):
    P = np.zeros((E, D))
    for e in range(E):
        holders = rng.choice(D, size=int(rng.integers(1, min(D, 3) + 1)), replace=False)
        P[e, holders] = rng.dirichlet(np.ones(holders.size))
    reps = rng.random((E, D)) < 0.15
    sets = np.stack([rng.choice(E, size=k, replace=False) for _ in range(B)]).astype(np.int64)
    frac = rng.random((E, 1 + D))
    frac[rng.random(E) < 0.3] = np.nan          # those experts follow least_loaded
    frac[rng.random(E) < 0.1] = 0.0             # all zero: even split
    return sets, P, reps, frac


@pytest.mark.parametrize("rule", ["least_loaded", "round_robin", "shares"])
def test_kernel_equals_the_python_loop(rule):
    rng = np.random.default_rng(11)
    for trial in range(40):
        E, D, k = int(rng.integers(3, 12)), int(rng.integers(2, 9)), 2
        sets, P, reps, frac = _random_layer(rng, E, D, int(rng.integers(1, 40)), k)
        held = P.sum(axis=1) > 0
        rep_experts = np.flatnonzero(reps.any(axis=1) & held)
        if not rep_experts.size:
            continue
        P_layer = P.copy()
        P_layer[rep_experts] = 0.0
        base = rng.random(D) * 3.0
        w = float(rng.random() + 0.5)
        plans = dispatch._copy_plans(sets, reps, rep_experts, rule,
                                     frac if rule == "shares" else None)
        ref = dispatch._assign_python(sets, P, reps, rep_experts, base, w, plans, P_layer, None)
        got = dispatch._assign_compiled(sets, P, reps, rep_experts, base, w, plans)
        for a, b in zip(ref[:5], got[:5], strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
        assert (ref[5] is None) == (got[5] is None)
        if ref[5] is not None:
            np.testing.assert_array_equal(ref[5], got[5])


def test_least_loaded_ties_go_to_the_lower_copy():
    """Equal peaks everywhere: the primary copy (index 0) is kept, as in the Python loop."""
    sets = np.array([[0, 1]] * 3, dtype=np.int64)
    P = np.array([[1.0, 0.0], [0.0, 1.0]])
    reps = np.array([[False, True], [False, False]])
    res = dispatch.dispatch_replicas(sets, P, reps, 1.0)
    # expert 1 (3 tokens on node 1) loads node 1 with 3; expert 0: node 0 (0) vs node 1 (3)
    assert res.copies[:, 0].tolist() == [0, 0, 0]
    res = dispatch.dispatch_replicas(sets, P, reps, 1.0, initial_flops=[3.0, 0.0])
    # now node 0 starts at 3 and node 1 at 3: ties -> copy 0, then node 0 is busier
    assert res.copies[:, 0].tolist() == [0, 1, 0]


@pytest.mark.parametrize("rule", ["least_loaded", "first", "home"])
def test_broadcast_kernel_equals_the_python_loop(rule):
    """``dispatch_broadcast``'s compiled loop (``broadcast_kernel``) against the Python loop
    (``dispatch._broadcast_python``): the same nodes, work and replica tokens, bit for bit,
    fluid and tile-aware, both bookkeepings, with tokens all of whose experts are broadcast."""
    from hdamoe_env.decisions.dispatch_kernels import broadcast_kernel

    rng = np.random.default_rng(5)
    placed = 0
    for trial in range(60):
        E, D, k = int(rng.integers(3, 12)), int(rng.integers(2, 9)), 2
        B = int(rng.integers(4, 40))
        sets, P, _, _ = _random_layer(rng, E, D, B, k)
        m = int(rng.integers(1, min(E, 4) + 1))
        bc = [int(e) for e in rng.choice(E, m, replace=False)]
        if trial % 3 == 0:                              # a token with only broadcast experts
            if m >= 2:
                sets[0] = bc[:2]
        is_bc = np.zeros(E, dtype=bool)
        is_bc[bc] = True
        orphans = is_bc[sets].all(axis=1)
        holders = dispatch._holder_lists(P)
        tiled = trial % 2 == 1
        base = (rng.integers(0, 3, D) * 1e-7).tolist()         # ties: first candidate wins
        delta = (rng.choice([0.0, 2e-7, 5e-8], B + 1)).tolist() if tiled else None
        ref = bool(trial % 4 < 2)
        w = float(rng.choice([1e6, 3.5e6]))
        outs = []
        for loop in ("python", "kernel"):
            nodes = np.full((B, k), -1, dtype=np.int64)
            computes = np.zeros((m, D), dtype=bool)
            tokens = np.zeros((m, D))
            if loop == "python":
                work = dispatch._broadcast_python(sets, bc, holders, base, w, rule, tiled,
                                                  delta, ref, orphans, nodes, computes, tokens)
            else:
                work = dispatch._dispatch_loop(sets, bc, P, holders, base, w, rule, tiled,
                                               delta, ref, orphans, nodes, computes, tokens)
            outs.append((nodes, work, computes, tokens))
        for a, b in zip(*outs, strict=True):
            np.testing.assert_array_equal(a, b)
        placed += int((outs[1][0] >= 0).sum())
    assert placed > 200
    assert callable(broadcast_kernel)
