"""Statistics of traces.md §4.1: building blocks, the null model and the table printer."""

from __future__ import annotations

import math

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import make_trace
from traces import stats


def test_gini_top_share_zipf() -> None:
    assert stats.gini(np.ones(8)) == 0.0
    assert stats.gini(np.array([0, 0, 0, 1.0])) == pytest.approx(0.75)
    assert stats.top_share(np.full(64, 1 / 64)) == pytest.approx(7 / 64)  # ⌈0.1·64⌉ = 7
    shares = np.arange(1, 65, dtype=float) ** -0.8
    assert stats.zipf_slope(shares / shares.sum()) == pytest.approx(0.8)


@pytest.mark.parametrize(("E", "k"), [(8, 2), (16, 4), (64, 6)])
def test_null_model_matches_marginals(E: int, k: int) -> None:
    rng = np.random.default_rng(E)
    weights = rng.dirichlet(np.full(E, 3.0))
    freq = np.minimum(weights * k, 0.9)
    freq *= k / freq.sum()
    pairs = stats.null_pair_probabilities(freq, k)
    assert pairs.sum() == pytest.approx(1.0)
    upper_i, upper_j = np.triu_indices(E, 1)
    joint = np.zeros((E, E))
    joint[upper_i, upper_j] = pairs * math.comb(k, 2)
    joint += joint.T
    # Σ_j P(i, j ∈ S) = (k − 1) f_i for any distribution over k-subsets with marginals f
    np.testing.assert_allclose(joint.sum(axis=1), (k - 1) * freq, rtol=1e-6, atol=1e-9)


def test_null_model_uniform_and_exact_k2() -> None:
    pairs = stats.null_pair_probabilities(np.full(8, 0.25), 2)
    np.testing.assert_allclose(pairs, np.full(28, 1 / 28))
    # k = 2: P({i, j}) ∝ λ_i λ_j, so a product-form set distribution is reproduced exactly.
    lam = np.array([1.0, 2.0, 3.0, 4.0])
    upper_i, upper_j = np.triu_indices(4, 1)
    target = lam[upper_i] * lam[upper_j]
    target /= target.sum()
    freq = np.zeros(4)
    np.add.at(freq, upper_i, target)
    np.add.at(freq, upper_j, target)
    np.testing.assert_allclose(stats.null_pair_probabilities(freq, 2), target, atol=1e-9)


def test_trace_stats_on_constructed_trace() -> None:
    # Two layers; layer 1 copies layer 0, every row of a request is the same set.
    sets = np.array([[0, 1]] * 10 + [[2, 3]] * 10)
    trace = make_trace(np.stack([sets, sets]), E=4, req_lengths=[10, 10])
    result = traces.trace_stats(trace, B=5, n_batches=20)
    assert result["rows"] == 20 and result["distinct_groups"] == 2
    assert result["reuse_lag1"] == pytest.approx(1.0)
    assert result["reuse_independent"] == pytest.approx(0.5)
    assert result["next_layer_table_acc"] == pytest.approx(1.0)
    assert result["tv_contiguous_B5"] == pytest.approx(0.5)  # a window is one set
    assert result["max_over_mean_contiguous_B5"] == pytest.approx(2.0)
    assert result["top3_set_mass"] == pytest.approx(1.0)
    assert result["set_entropy"] == pytest.approx(1.0)
    assert result["gini"] == pytest.approx(0.0)
    assert len(result["per_layer"]["gini"]) == 2


def test_trace_stats_synthetic_and_floors(tiny_trace: traces.RoutingTrace) -> None:
    result = traces.trace_stats(tiny_trace, B=16, n_batches=50)
    for name in (
        "gini",
        "top10_share",
        "pair_tv_vs_null",
        "reuse_lag1",
        "tv_random_B16",
        "next_layer_table_acc_cv",
        "gini_floor",
        "pair_tv_floor",
    ):
        assert np.isfinite(result[name]), name
    assert result["gini"] > result["gini_floor"]
    assert result["top10_share"] > result["top10_share_floor"] > 7 / 64 - 0.01
    again = traces.trace_stats(tiny_trace, B=16, n_batches=50)
    assert again["tv_contiguous_B16"] == result["tv_contiguous_B16"]  # seeded


def test_stats_table(tiny_trace: traces.RoutingTrace) -> None:
    a = traces.trace_stats(tiny_trace, B=16, n_batches=20, floors=False)
    head, rows = traces.stats_table({"first": a, "second": {"gini": 0.5, "rows": 3}})
    assert head == ["statistic", "first", "second"]
    by = {row[0]: row[1:] for row in rows}
    assert by["gini"] == [f"{a['gini']:.4f}", "0.5000"]
    assert by["zipf_s"][1] == "–"
    assert "per_layer" not in by
