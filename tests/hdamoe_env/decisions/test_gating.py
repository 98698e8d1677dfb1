"""Hardware-aware gating (paper-model.md §11): pinned values, invariants, brute-force agreement."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.decisions.gating import (COMP_PENALTIES, default_coefficients, gating_diagnostics,
                                         hardware_aware_gating, penalties)
from hdamoe_env.sim.placement import expert_parallel
from tests.hdamoe_env.decisions import gating_reference  # the pure-Python oracle

# §14.8 item 5
P5 = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.0, 1.0]])
S5 = np.array([[0.40, 0.25, 0.22, 0.13]])


def test_check_value_14_8_item5_penalties():
    dT, disp = penalties(P5, [2, 0, 1, 0], w_flops=1e-6, compute_flops=1.0)
    np.testing.assert_allclose(dT, [1e-6, 0.5e-6, 0, 0], atol=1e-18)
    np.testing.assert_array_equal(disp, [1, 2, 1, 1])
    a = S5[0] + (-1e5) * dT + (-0.04) * disp
    np.testing.assert_allclose(a, [0.26, 0.12, 0.18, 0.09], atol=1e-12)


def test_check_value_14_8_item5_selection():
    res = hardware_aware_gating(S5, 2, P5, 1e-6, 1.0, -1e5, -0.04, initial_counts=[2, 0, 1, 0])
    assert set(res.sets[0].tolist()) == {0, 2}
    assert res.sets[0].tolist() == [0, 2]                 # ordered by adjusted score
    np.testing.assert_allclose(res.weights[0], [0.40, 0.22])   # original probabilities
    assert res.changed_fraction == 1.0 and res.top1_retention == 1.0
    np.testing.assert_allclose(res.replaced_per_rank, [0.0, 1.0])
    assert res.score_mass_kept == pytest.approx(0.62 / 0.65)


def _scores(rng, B=32, E=16, conc=0.3):
    return rng.dirichlet(np.full(E, conc), size=B)


def test_zero_coefficients_change_nothing(rng):
    P = expert_parallel(1, 16, 4, rng).P[0]
    s = _scores(rng)
    res = hardware_aware_gating(s, 4, P, 1e7, 1e12, 0.0, 0.0)
    top = np.argsort(-s, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(res.sets, top)
    np.testing.assert_array_equal(res.orig_sets, top)
    assert res.changed_fraction == 0 and res.top1_retention == 1 and res.score_mass_kept == 1
    ids = np.argsort(-s, axis=1)[:, :8]
    cand = hardware_aware_gating((ids[:, ::-1], np.take_along_axis(s, ids, 1)[:, ::-1]), 4, P,
                                 1e7, 1e12, 0.0, 0.0)
    np.testing.assert_array_equal(cand.sets, top)         # positions never trusted (§11.5)


def test_protect_top_never_drops_top1(rng):
    P = expert_parallel(1, 16, 4, rng).P[0]
    s = _scores(rng, B=64)
    free = hardware_aware_gating(s, 4, P, 1e7, 1e12, -1e6, -0.5)
    assert free.top1_retention < 1.0                       # strong penalties do replace top-1
    res = hardware_aware_gating(s, 4, P, 1e7, 1e12, -1e6, -0.5, protect_top=1)
    assert res.top1_retention == 1.0
    assert (res.sets == res.orig_sets[:, :1]).any(axis=1).all()
    assert res.replaced_per_rank[0] == 0.0


def test_sequential_greedy_balances_a_hot_expert():
    E, D = 4, 4
    P = np.eye(E, D)
    s = np.tile([0.5, 0.2, 0.15, 0.15], (8, 1))          # every row prefers expert 0
    res = hardware_aware_gating(s, 1, P, 1.0, 1.0, -0.5, 0.0)
    counts = np.bincount(res.sets.ravel(), minlength=E)
    assert res.sets[0, 0] == 0              # empty chip: every expert raises the peak equally
    assert res.sets[1, 0] == 1              # expert 0's node is now the bottleneck
    np.testing.assert_array_equal(counts, [2, 2, 2, 2])
    ungated = hardware_aware_gating(s, 1, P, 1.0, 1.0, 0.0, 0.0)
    assert (ungated.sets == 0).all()


def _brute_force(scores, k, P, w, C, rc, rm, comp="marginal_max", protect=0, future=False,
                 n0=None):
    """Reference greedy: every expert, every row, numpy penalties, no pruning."""
    B, E = scores.shape
    n = np.zeros(E) if n0 is None else np.array(n0, dtype=float)
    order = np.argsort(-scores, axis=1, kind="stable")
    if future:
        np.add.at(n, order[:, :k].ravel(), 1)
    out = []
    for t in range(B):
        if future:
            n[order[t, :k]] -= 1
        dT, disp = penalties(P, n, w, C, comp_penalty=comp)
        cand = order[t]
        a = scores[t, cand] + rc * dT[cand] + rm * disp[cand]
        a[:protect] = np.inf
        pick = cand[np.argsort(-a, kind="stable")[:k]]
        out.append(pick)
        n[pick] += 1
    return np.array(out)


@pytest.mark.parametrize("comp", COMP_PENALTIES)
@pytest.mark.parametrize("protect,future", [(0, False), (1, False), (0, True)])
def test_pruned_greedy_matches_brute_force(rng, comp, protect, future):
    E, D, k = 16, 4, 3
    P = expert_parallel(1, E, D, rng).P[0]
    P[0] = 0.25                                            # one TP-split expert
    P[1] = [0.5, 0.5, 0, 0]
    s = _scores(rng, B=40, E=E)
    w, C = 2e6, 1e12
    rc, rm = -2e4, -0.01
    n0 = rng.integers(0, 3, E)
    res = hardware_aware_gating(s, k, P, w, C, rc, rm, comp_penalty=comp, protect_top=protect,
                                include_future=future, initial_counts=None if future else n0)
    ref = _brute_force(s, k, P, w, C, rc, rm, comp, protect, future, None if future else n0)
    np.testing.assert_array_equal(res.sets, ref)


def test_new_nodes_matches_sequential_reference(rng):
    E, D, k = 12, 4, 3
    P = expert_parallel(1, E, D, rng).P[0]
    P[2] = [0.5, 0.5, 0, 0]
    s = _scores(rng, B=20, E=E)
    w, C, rc, rm = 2e6, 1e12, -2e4, -0.05
    res = hardware_aware_gating(s, k, P, w, C, rc, rm, comm_penalty="new_nodes")
    n = np.zeros(E)
    holders = P > 0
    for t in range(s.shape[0]):
        dT, _ = penalties(P, n, w, C)
        order = np.argsort(-s[t], kind="stable")
        base = s[t, order] + rc * dT[order]
        covered = np.zeros(D, dtype=bool)
        picks = []
        for _ in range(k):
            new = (holders[order] & ~covered).sum(axis=1)
            a = np.where(np.isin(np.arange(E), picks), -np.inf, base + rm * new)
            j = int(np.argmax(a))
            picks.append(j)
            covered |= holders[order[j]]
        chosen = order[picks]
        assert res.sets[t].tolist() == chosen.tolist()
        n[chosen] += 1


def test_candidate_window_equals_candidate_form(rng):
    E, D, k, J = 16, 4, 3, 2
    P = expert_parallel(1, E, D, rng).P[0]
    s = _scores(rng, B=24, E=E)
    full = hardware_aware_gating(s, k, P, 2e6, 1e12, -3e4, -0.02, candidate_window=J)
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k + J]
    cand = hardware_aware_gating((ids, np.take_along_axis(s, ids, 1)), k, P, 2e6, 1e12, -3e4,
                                 -0.02)
    np.testing.assert_array_equal(full.sets, cand.sets)
    # only original ranks < k + J can enter
    assert np.isin(full.sets, ids).all()


def test_weights_follow_the_model_rule(rng):
    P = expert_parallel(1, 16, 4, rng).P[0]
    s = _scores(rng)
    raw = hardware_aware_gating(s, 4, P, 2e6, 1e12, -3e4, -0.02)
    np.testing.assert_allclose(raw.weights, np.take_along_axis(s, raw.sets, 1))
    norm = hardware_aware_gating(s, 4, P, 2e6, 1e12, -3e4, -0.02, renormalize=True)
    np.testing.assert_allclose(norm.weights.sum(axis=1), 1.0)
    np.testing.assert_array_equal(norm.sets, raw.sets)


def test_diagnostics():
    uniform = np.full((3, 8), 1 / 8)
    ent, margin = gating_diagnostics(uniform, 2)
    assert ent == pytest.approx(1.0) and margin == pytest.approx(0.0)
    peaked = np.array([[0.7, 0.1, 0.1, 0.1]])
    ent, margin = gating_diagnostics(peaked, 1)
    assert 0 < ent < 1 and margin == pytest.approx(0.6)
    res = hardware_aware_gating(peaked, 1, np.eye(4), 1.0, 1.0, 0.0, 0.0)
    assert res.top_margin == pytest.approx(0.6) and res.entropy == pytest.approx(ent)


def test_errors():
    with pytest.raises(ConfigError, match="computation penalty"):
        hardware_aware_gating(S5, 2, P5, 1.0, 1.0, -1.0, 0.0, comp_penalty="nope")
    with pytest.raises(ConfigError, match="protect_top"):
        hardware_aware_gating(S5, 2, P5, 1.0, 1.0, -1.0, 0.0, protect_top=3)
    with pytest.raises(ConfigError, match="shape"):
        hardware_aware_gating(S5[:, :3], 2, P5, 1.0, 1.0, -1.0, 0.0)
    with pytest.raises(ConfigError, match="finite"):
        hardware_aware_gating(np.array([[np.nan, 0.2, 0.3, 0.5]]), 2, P5, 1.0, 1.0, 0.0, 0.0)


def test_default_coefficients():
    (rc, rm), src = default_coefficients("deepseek-v2-lite", "5/50", expert_matrices=3)
    assert (rc, rm) == (-1.5e4, -0.015) and src == "deepseek-v2-lite"
    assert default_coefficients("deepseek-v2-lite", "10/25")[0] == (-4.5e4, -0.02)
    (rc, rm), src = default_coefficients("qwen3.5-35b-a3b", "5/50")
    assert (rc, rm) == (-1.3e5, -0.001) and "unknown" in src
    assert default_coefficients("mixtral-8x7b", "2.5/75")[0] == (-1.16e6, -0.03)


def test_decision_time_deepseek_batch():
    """B = 128, E = 64, k = 6 (target <= 1 ms on an idle core; loose bound for shared CI)."""
    rng = np.random.default_rng(0)
    P = expert_parallel(1, 64, 32, rng).P[0]
    s = rng.dirichlet(np.full(64, 0.3), size=128)
    args = (s, 6, P, 6 * 2048 * 1408, 5e12, -1.5e4, -0.015)
    hardware_aware_gating(*args)
    t0 = time.process_time()
    for _ in range(5):
        hardware_aware_gating(*args)
    assert (time.process_time() - t0) / 5 < 0.02


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
