"""Next-layer prediction (paper-model.md §10.2, traces.md §7.6;
``hdamoe_env.decisions.prediction``): the noisy oracle, the alias sampler, the step predictors."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.decisions.prediction import AliasSampler, noisy_oracle_sets


# ------------------------------------------------------------------------------ §10.2 prediction
def test_noisy_oracle_semantics():
    rng = np.random.default_rng(1)
    E, B, k = 16, 256, 4
    p = np.arange(1, E + 1, dtype=float) ** -1.0
    actual = np.stack([rng.choice(E, k, replace=False, p=p / p.sum()) for _ in range(B)])
    sampler = AliasSampler(p)
    overlaps = []
    for _ in range(20):
        pred = noisy_oracle_sets(actual, 0.7, sampler, rng)
        assert all(len(set(r)) == k for r in pred.tolist())
        kept = (pred[:, :, None] == actual[:, None, :]).any(axis=2)
        same_slot = pred == actual
        assert (kept == same_slot).all()               # replacements never come from the set
        overlaps.append(kept.mean())
    assert np.mean(overlaps) == pytest.approx(0.7, abs=0.015)
    np.testing.assert_array_equal(noisy_oracle_sets(actual, 1.0, sampler, rng), actual)


def test_noisy_oracle_per_layer_rows():
    rng = np.random.default_rng(2)
    E, B, k = 8, 200, 2
    shares = np.array([np.r_[np.ones(4), np.full(4, 1e-12)], np.r_[np.full(4, 1e-12), np.ones(4)]])
    actual = np.tile([[0, 1]], (2 * B, 1))
    actual[B:] = [4, 5]
    layers = np.repeat([0, 1], B)
    pred = noisy_oracle_sets(actual, 0.0, AliasSampler(shares), rng, layer_of_row=layers)
    assert np.isin(pred[:B], [2, 3]).all()             # layer 0 draws ∝ its own popularity
    assert np.isin(pred[B:], [6, 7]).all()


def test_alias_sampler_distribution():
    p = np.array([0.5, 0.25, 0.125, 0.125, 0.0])
    draws = AliasSampler(p).sample(np.zeros(100_000, dtype=np.int64), 1,
                                   np.random.default_rng(0)).ravel()
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, p, atol=0.005)


# ------------------------------------------------------------------------------ the step predictors
def test_step_predictor_oracle_frequency_and_noisy_oracle():
    from hdamoe_env.config.errors import ConfigError
    from hdamoe_env.decisions.prediction import PREDICTORS, StepPredictor

    rng = np.random.default_rng(7)
    L, B, k, E = 3, 8, 2, 6
    freqs = rng.dirichlet(np.ones(E), size=L) * k
    sets = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(B)]) for _ in range(L)])
    acc = np.array([np.nan, 0.5, 0.8])
    oracle = StepPredictor("oracle", freqs, k, B, acc).predict(sets, np.arange(B), rng)
    assert (oracle.sets[0] == -1).all() and (oracle.sets[1:] == sets[1:]).all()
    np.testing.assert_array_equal(oracle.counts[0], 0.0)
    for layer in (1, 2):
        np.testing.assert_array_equal(oracle.counts[layer],
                                      np.bincount(sets[layer].ravel(), minlength=E))
    freq = StepPredictor("frequency", freqs, k, B, acc).predict(sets, np.arange(B), rng)
    assert freq.sets is None
    np.testing.assert_array_equal(freq.counts[1:], freqs[1:] * B)
    np.testing.assert_array_equal(freq.counts[0], 0.0)
    # the noisy oracle is one noisy_oracle_sets call over layers 1..L-1 on the caller's rng
    noisy = StepPredictor("noisy_oracle", freqs, k, B, acc)
    got = noisy.predict(sets, np.arange(B), np.random.default_rng(3))
    want = noisy_oracle_sets(sets[1:].reshape(-1, k), np.repeat(acc[1:], B),
                             AliasSampler(np.maximum(freqs / k, 1e-12)), np.random.default_rng(3),
                             layer_of_row=np.repeat(np.arange(1, L), B))
    np.testing.assert_array_equal(got.sets[1:].reshape(-1, k), want)
    assert set(PREDICTORS) == {"noisy_oracle", "oracle", "trace", "frequency"}
    with pytest.raises(ConfigError, match="pred_ids"):
        StepPredictor("trace", freqs, k, B, acc)
    with pytest.raises(ConfigError, match="predictor"):
        StepPredictor("psychic", freqs, k, B, acc)
    recorded = np.full((L, 20, k), 1)
    trace = StepPredictor("trace", freqs, k, B, acc, recorded=recorded).predict(
        sets, np.arange(B), rng)
    assert (trace.sets[0] == -1).all() and (trace.sets[1:] == 1).all()


@pytest.mark.parametrize("num_experts", [16, 64, 80])   # compiled path (<= 64) and numpy path
@pytest.mark.parametrize("acc", [0.0, 0.6, 1.0])
def test_noisy_oracle_sets_many_equals_one_call_per_problem(num_experts, acc):
    """The batched noisy oracle draws the same numbers and predicts the same sets (vector env)."""
    from hdamoe_env.decisions.prediction import noisy_oracle_sets_many

    rng = np.random.default_rng(5)
    num_layers, rows, k, n = 3, 40, 6, 5
    freqs = rng.random((num_layers, num_experts)) ** 3 + 1e-3          # skewed popularity
    sampler = AliasSampler(freqs)
    actual = np.stack([np.stack([rng.choice(num_experts, k, replace=False) for _ in range(rows)])
                       for _ in range(n)]).astype(np.int64)
    layer_of_row = np.repeat(np.arange(num_layers), -(-rows // num_layers))[:rows]
    accs = np.full(rows, acc)
    rngs = [np.random.default_rng(100 + j) for j in range(n)]
    many = noisy_oracle_sets_many(actual, accs, sampler, rngs, layer_of_row=layer_of_row)
    for j in range(n):
        ref_rng = np.random.default_rng(100 + j)
        one = noisy_oracle_sets(actual[j], accs, sampler, ref_rng, layer_of_row=layer_of_row)
        np.testing.assert_array_equal(many[j], one)
        assert rngs[j].random() == ref_rng.random()         # the same draws were consumed


@pytest.mark.parametrize("case", ["skewed", "pathological"])
@pytest.mark.parametrize("bit_generator", ["pcg64", "philox"])
def test_predict_into_equals_predict(case, bit_generator):
    """The compiled per-step predictor (the vector env's) predicts the same sets and counts as
    ``predict`` and leaves the generator at the same stream position: PCG64 through the compiled
    kernel (``generator_state``), another bit generator through the numpy path; "pathological"
    popularity (only the actual experts are popular) exercises the uniform fallback."""
    from hdamoe_env.decisions import prediction_kernels
    from hdamoe_env.decisions.prediction import StepPredictor

    rng = np.random.default_rng(11)
    L, B, k, E = 4, 16, 6, 16 if case == "pathological" else 64
    sets = np.stack([np.stack([np.sort(rng.permutation(E)[:k]) for _ in range(B)])
                     for _ in range(L)]).astype(np.int64)
    if case == "pathological":
        sets[:] = np.arange(k)                      # every token routes to experts 0..5
        freqs = np.zeros((L, E))
        freqs[:, :k] = 1.0                          # and only they are popular
    else:
        freqs = rng.random((L, E)) ** 3 + 1e-3
    pred = StepPredictor("noisy_oracle", freqs, k, B, np.full(L, 0.6))
    assert pred.compiled_one

    def make(seed: int) -> np.random.Generator:
        if bit_generator == "pcg64":
            return np.random.default_rng(seed)
        return np.random.Generator(np.random.Philox(seed))

    for seed in range(3):
        a, b = make(seed), make(seed)
        assert (prediction_kernels.generator_state(a) is None) == (bit_generator != "pcg64")
        want = pred.predict(sets, np.arange(B), a)
        got_sets = np.zeros((L, B, k), dtype=np.int64)
        got_counts = np.full((L, E), 7.0)
        pred.predict_into(sets, b, got_sets, got_counts)
        np.testing.assert_array_equal(got_sets, want.sets)
        np.testing.assert_array_equal(got_counts, want.counts)
        assert a.random() == b.random()
        if case == "pathological":
            assert (got_sets[1:] >= k).any()        # the fallback drew the unpopular experts
