"""Tests of traces.synthetic, the synthetic generator (traces.md §7): determinism, shapes, scores,
predictions, statistics, the skew knob, and the calibrated parameters (§7.4)."""

from __future__ import annotations

import numpy as np
import pytest

import traces
from traces import RoutingTrace
from traces.synthetic import GENERATOR_PARAMS, model_params

SMALL = {
    "mixtral-8x7b": (32, 8, 2),
    "deepseek-v2-lite": (26, 64, 6),
    "qwen2-57b-a14b": (28, 64, 8),
    "qwen3.5-35b-a3b": (40, 256, 8),
}


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a[..., :, None] == b[..., None, :]).sum(axis=(-1, -2)) / a.shape[-1]


@pytest.mark.parametrize("model_key", sorted(SMALL))
def test_shapes_distinct_ids_and_meta(model_key: str) -> None:
    num_layers, num_experts, top_k = SMALL[model_key]
    trace = traces.generate(model_key, n_requests=3, n_tokens=90, seed=5)
    assert trace.topk_ids.shape == (num_layers, 90, top_k)
    assert trace.cand_ids is not None and trace.cand_ids.shape == (num_layers, 90, 2 * top_k)
    assert trace.num_experts == num_experts
    trace.validate()  # ids in range, distinct, cand head = top-k
    assert trace.meta["ids_rank_ordered"] is True
    assert trace.meta["generator"]["seed"] == 5
    assert trace.meta["generator"]["params_sha256"] == model_params(model_key)["sha256"]
    assert trace.keep.all() and (trace.phase == 1).all()
    assert len(traces.requests(trace)) == 3
    offset = 1 if model_key == "deepseek-v2-lite" else 0
    assert trace.meta["moe_layer_keys"][0] == str(offset)


def test_same_seed_same_arrays() -> None:
    a = traces.generate("deepseek-v2-lite", n_requests=4, seed=11, predictor="noisy_oracle")
    b = traces.generate("deepseek-v2-lite", n_requests=4, seed=11, predictor="noisy_oracle")
    c = traces.generate("deepseek-v2-lite", n_requests=4, seed=12)
    for name, array in a.array_items():
        np.testing.assert_array_equal(getattr(b, name), array, err_msg=name)
    assert a.trace_id == b.trace_id != c.trace_id
    m1 = traces.generate("mixtral-8x7b", n_tokens=500, seed=2)
    m2 = traces.generate("mixtral-8x7b", n_tokens=500, seed=2)
    assert m1.trace_id == m2.trace_id and m1.num_tokens == 500


def test_request_length_options() -> None:
    lengths = [5, 7, 11]
    trace = traces.generate("qwen2-57b-a14b", request_lengths=lengths, with_scores=False)
    assert np.bincount(trace.req_id).tolist() == lengths and trace.cand_ids is None
    trace = traces.generate("deepseek-v2-lite", n_requests=4, n_tokens=401, with_scores=False)
    assert trace.num_tokens == 401 and len(np.unique(trace.req_id)) == 4
    with pytest.raises(ValueError, match="J="):
        traces.generate("mixtral-8x7b", n_tokens=10, J=7)


def test_unknown_model_key_suggests() -> None:
    with pytest.raises(ValueError, match="did you mean 'deepseek-v2-lite'"):
        traces.generate("deepseek-v2lite")
    with pytest.raises(traces.UnknownNameError):
        traces.generate("mixtral")


@pytest.mark.parametrize("model_key", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_scores_original_topk_is_topk_ids(model_key: str) -> None:
    """traces.md §7.5: the top-k of the scores is exactly topk_ids, in rank order."""
    trace = traces.generate(model_key, n_requests=3, n_tokens=300, seed=4)
    assert trace.cand_scores is not None and trace.cand_ids is not None
    scores = trace.cand_scores.astype(np.float64)
    assert (np.diff(scores, axis=2) <= 0).all()  # rank order
    assert ((scores > 0) & (scores <= 1)).all()
    assert (scores.sum(axis=2) <= 1 + 1e-5).all()  # softmax over all E
    np.testing.assert_array_equal(trace.cand_ids[:, :, : trace.top_k], trace.topk_ids)
    expected = "synthetic" if model_key == "mixtral-8x7b" else "softmax_all"
    assert trace.meta["score_kind"] == expected


def test_synthesize_scores_for_unscored_traces(tiny_mixtral: RoutingTrace) -> None:
    bare = tiny_mixtral.replace(
        cand_ids=None,
        cand_scores=None,
        meta={**tiny_mixtral.meta, "ids_rank_ordered": None, "J": None},
    )
    scored = traces.synthesize_scores(bare, np.random.default_rng(0), J=3)
    scored.validate()
    assert scored.cand_ids is not None and scored.cand_ids.shape[2] == 5
    assert scored.meta["score_kind"] == "synthetic"
    np.testing.assert_array_equal(
        np.sort(scored.cand_ids[:, :, :2], axis=2), np.sort(bare.topk_ids, axis=2)
    )
    ranked = bare.replace(meta={**bare.meta, "ids_rank_ordered": True})
    scored = traces.synthesize_scores(ranked, np.random.default_rng(0))
    np.testing.assert_array_equal(scored.cand_ids[:, :, :2], bare.topk_ids)  # rank order kept


def test_noisy_oracle_expected_accuracy() -> None:
    """traces.md §7.6: expected |S ∩ Ŝ| / k = acc_l; layer 0 is −1."""
    trace = traces.generate(
        "deepseek-v2-lite", n_requests=4, n_tokens=2000, seed=8, with_scores=False
    )
    rng = np.random.default_rng(1)
    acc = np.linspace(0.3, 0.95, trace.num_layers)
    pred = traces.noisy_oracle_predictions(trace, acc, rng)
    assert (pred[0] == -1).all()
    measured = _overlap(pred[1:], trace.topk_ids[1:]).mean(axis=1)
    np.testing.assert_allclose(measured, acc[1:], atol=0.02)
    with_pred = traces.with_noisy_oracle(trace, None, rng)
    with_pred.validate()
    measured = _overlap(with_pred.pred_ids[1:], trace.topk_ids[1:]).mean(axis=1)
    targets = [0.62, 0.68] + [0.83] * (trace.num_layers - 3)
    np.testing.assert_allclose(measured, targets, atol=0.02)
    assert with_pred.meta["predictor"]["acc"][:3] == [None, 0.62, 0.68]


def test_mixtral_validation_statistics() -> None:
    """traces.md §7.3 validation row (30 empirical request lengths), ±15 % relative."""
    lengths = traces.GENERATOR_PARAMS["mixtral-8x7b"]["request_tokens"]
    trace = traces.generate("mixtral-8x7b", request_lengths=lengths, seed=0, with_scores=False)
    assert trace.num_tokens == 22066
    stats = traces.trace_stats(trace, floors=False, n_batches=100)
    assert stats["gini"] == pytest.approx(0.061, rel=0.15)
    assert stats["max_over_mean"] == pytest.approx(1.171, rel=0.15)
    assert stats["reuse_lag1"] == pytest.approx(0.357, rel=0.15)
    assert stats["tv_random_B64"] == pytest.approx(0.087, rel=0.15)
    assert stats["next_layer_table_acc"] == pytest.approx(0.428, rel=0.15)


# --------------------------------------------------------------------------- skew power τ
# trace ids of generate(model, n_requests=3, n_tokens=240, seed=7, predictor="noisy_oracle")
# computed with the generator before the skew knob existed: τ = 1 must reproduce them bit for bit.
_PINNED_IDS = {
    "deepseek-v2-lite": "1d27bcc9371b0755d2d0eab8dbcbf60181d164091533b76eac82114e39af8768",
    "mixtral-8x7b": "93f64061c174644a625610d8a48d772c8a7ca3a0ba54e114ed610e1cc342f601",
}


@pytest.mark.parametrize("model_key", sorted(_PINNED_IDS))
def test_skew_one_is_bit_identical_to_the_generator_without_the_knob(model_key: str) -> None:
    kwargs = {"n_requests": 3, "n_tokens": 240, "seed": 7, "predictor": "noisy_oracle"}
    default = traces.generate(model_key, **kwargs)
    explicit = traces.generate(model_key, **kwargs, skew=1.0)
    assert default.trace_id == explicit.trace_id == _PINNED_IDS[model_key]
    assert explicit.meta["generator"]["skew"] == 1.0


def _top_share(trace: RoutingTrace) -> float:
    """Busiest expert's share of all activations, mean over layers."""
    shares = []
    for layer in range(trace.num_layers):
        counts = np.bincount(trace.topk_ids[layer].ravel().astype(np.int64),
                             minlength=trace.num_experts)
        shares.append(counts.max() / counts.sum())
    return float(np.mean(shares))


@pytest.mark.parametrize("model_key", ["deepseek-v2-lite", "mixtral-8x7b"])
def test_skew_sharpens_popularity_monotonically(model_key: str) -> None:
    shares = [_top_share(traces.generate(model_key, n_requests=8, n_tokens=2000, seed=1,
                                         with_scores=False, skew=tau))
              for tau in (0.5, 1.0, 2.0)]
    assert shares[0] < shares[1] < shares[2], shares
    # the parameters follow the one definition p ← p^τ (renormalised)
    base, sharp = model_params(model_key), model_params(model_key, skew=2.0)
    if base["kind"] == "expert_mixture":
        np.testing.assert_allclose(sharp["zipf_s"], 2.0 * base["zipf_s"])
    else:
        expected = base["p"] ** 2 / (base["p"] ** 2).sum(axis=1, keepdims=True)
        np.testing.assert_allclose(sharp["p"], expected, rtol=1e-12)
        np.testing.assert_allclose(sharp["theta"].sum(axis=-1), 1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "x"])
def test_skew_must_be_finite_and_positive(bad: object) -> None:
    with pytest.raises(ValueError, match="skew must be a finite number > 0"):
        traces.generate("deepseek-v2-lite", n_requests=1, n_tokens=10, skew=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- calibrated parameters
# The generator reads the calibrated DeepSeek-V2-Lite values of generator-params.json
# (traces.md §7.4, benchmarks/calibrate_generator.py), and its 128-row request-start statistics
# reproduce the ``calibration.achieved`` record written by the calibration script — on a
# different sample seed, computed per request with ``traces.trace_stats`` (an independent path
# from the script's vectorised grid statistics). A drifting generator, a changed statistic or
# stale parameters fail here; re-run ``benchmarks/calibrate_generator.py --write`` after
# intended changes.
MODEL = "deepseek-v2-lite"
STATS = ("gini", "top10_share", "pair_tv_vs_null", "reuse_lag1")
REQUESTS = 8  # 128-row request starts averaged (the calibration used 32 on another seed)
SEED = 77  # not the calibration's grid (1000, 1001) or evaluation (2000) seeds
# Relative tolerance per statistic. The recorded between-sample spread (achieved_sd_per_sample)
# gives a standard error of the 8-request mean below 1.5 % for all four statistics, so 5 % is
# > 3 standard errors (seeds 1–12 stay within 2 %), while the provisional values miss by 40–62 %.
REL_TOL = 0.05


def _request_start_stats(params: dict | None = None) -> dict[str, float]:
    """Mean over REQUESTS synthetic requests of the per-request (128-row) statistics."""
    calibration = GENERATOR_PARAMS[MODEL]["calibration"]
    rows = calibration["rows"]
    trace = traces.generate(
        MODEL, request_lengths=[rows] * REQUESTS, seed=SEED, with_scores=False, params=params
    )
    per_request = []
    for request in traces.requests(trace):
        part = traces.RoutingTrace(
            topk_ids=trace.topk_ids[:, request],
            req_id=np.zeros(rows, np.int32),
            pos=np.arange(rows, dtype=np.int32),
            phase=np.ones(rows, np.uint8),
            keep=np.ones(rows, bool),
            meta={"E": trace.num_experts},
        )
        stats = traces.trace_stats(part, floors=False, n_batches=1)
        per_request.append([stats[name] for name in STATS])
    return dict(zip(STATS, np.mean(per_request, axis=0), strict=True))


def _misses(measured: dict[str, float], achieved: dict[str, float]) -> dict[str, float]:
    """Relative deviations beyond REL_TOL."""
    deviation = {name: measured[name] / achieved[name] - 1.0 for name in STATS}
    return {name: round(value, 4) for name, value in deviation.items() if abs(value) > REL_TOL}


def _provisional_zipf(entry: dict) -> np.ndarray:
    """Per-layer provisional Zipf exponents (a list, or Qwen2's measured layers + default)."""
    if "zipf_s" in entry["provisional"]:
        return np.asarray(entry["provisional"]["zipf_s"], dtype=np.float64)
    out = np.full(entry["L"], float(entry["zipf_s_default_other_layers"]))
    for layer, value in entry["zipf_s_measured"].items():
        out[int(layer)] = float(value)
    return out


CALIBRATED = [
    key
    for key, entry in GENERATOR_PARAMS.items()
    if isinstance(entry, dict) and "calibration" in entry
]


@pytest.mark.parametrize("model_key", CALIBRATED)
def test_generator_reads_calibrated_values(model_key: str) -> None:
    """The top-level JSON values (what the generator uses) are the calibrated ones."""
    entry = GENERATOR_PARAMS[model_key]
    assert entry["status"].startswith("calibrated by benchmarks/calibrate_generator.py")
    chosen = entry["calibration"]["chosen"]
    provisional = entry["provisional"]
    spec = model_params(model_key)
    assert spec["C"] == chosen["clusters"]
    assert spec["kappa_cluster"] == chosen["kappa_cluster"]
    assert spec["rho"] == chosen["rho"]
    np.testing.assert_allclose(
        spec["zipf_s"], _provisional_zipf(entry) * chosen["zipf_scale"], atol=1e-4
    )
    np.testing.assert_allclose(
        spec["gamma"], np.asarray(provisional["gamma"]) * chosen["gamma_scale"], atol=1e-4
    )
    assert set(entry["calibration"]["statistics"]) >= set(STATS)


def test_deepseek_is_calibrated() -> None:
    assert MODEL in CALIBRATED and "provisional" in GENERATOR_PARAMS[MODEL]


def test_request_start_statistics_match_calibration() -> None:
    """128-row statistics of a fresh seed lie within REL_TOL of calibration.achieved."""
    achieved = GENERATOR_PARAMS[MODEL]["calibration"]["achieved"]
    measured = _request_start_stats()
    assert not _misses(measured, achieved), (
        f"relative deviation from calibration.achieved beyond {REL_TOL:.0%}: "
        f"{_misses(measured, achieved)} (measured {measured}, achieved "
        f"{ {name: achieved[name] for name in STATS} })"
    )


def test_tolerance_rejects_provisional_values() -> None:
    """The check above can fail: the provisional parameters are far outside REL_TOL."""
    entry = GENERATOR_PARAMS[MODEL]
    provisional = {key: value for key, value in entry["provisional"].items() if key != "status"}
    measured = _request_start_stats(provisional)
    misses = _misses(measured, entry["calibration"]["achieved"])
    assert {"gini", "top10_share", "pair_tv_vs_null", "reuse_lag1"} <= set(misses)
    # and they reproduce the provisional row of the calibration record
    before = entry["calibration"]["provisional_achieved"]
    for name in STATS:
        assert measured[name] == pytest.approx(before[name], rel=REL_TOL)
