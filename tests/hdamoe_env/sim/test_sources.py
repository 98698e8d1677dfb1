"""The one trace loader of the core (hdamoe_env.sim.sources; traces.md §3, §5, §7)."""

from __future__ import annotations

import numpy as np
import pytest

from hdamoe_env.config.errors import ConfigError, TraceFormatError
from hdamoe_env.sim.sources import load_trace
from hdamoe_env.config.specs import get_model
from traces import RoutingTrace, save, synthetic


def test_synthetic_equals_the_generator_and_is_cached():
    model = get_model("mixtral-8x7b")
    got = load_trace("synthetic", model, seed=3, requests=4)
    ref = synthetic.generate("mixtral-8x7b", n_requests=4, seed=3)
    assert got.trace_id == ref.trace_id
    assert load_trace("synthetic", model, seed=3, requests=4) is got
    with_pred = load_trace("synthetic", model, seed=3, requests=4, predictor="noisy_oracle")
    assert with_pred.pred_ids is not None and got.pred_ids is None


def test_synthetic_generic_fallback(tiny_model):
    trace = load_trace("synthetic", tiny_model, seed=0, requests=2, tokens=64)
    L, T, k = trace.topk_ids.shape
    assert (L, trace.num_experts, k) == (2, 4, 2) and T == 64


def test_files_and_passthrough(tmp_path, tiny_model):
    trace = load_trace("synthetic", tiny_model, seed=1, requests=2, tokens=32)
    assert load_trace(trace, tiny_model) is trace
    path = tmp_path / "t.hdtrace.npz"
    save(trace, path)
    back = load_trace(path, tiny_model)
    assert back.trace_id == trace.trace_id
    assert np.array_equal(back.topk_ids, trace.topk_ids)
    with pytest.raises(TraceFormatError, match="missing.npz"):
        load_trace(tmp_path / "missing.npz", tiny_model)
    with pytest.raises(ConfigError, match="RoutingTrace or a path"):
        load_trace(3, tiny_model)  # type: ignore[arg-type]


def test_synthetic_skew_is_part_of_the_cache_key_and_checked(tiny_model):
    model = get_model("deepseek-v2-lite")
    base = load_trace("synthetic", model, seed=2, requests=2, tokens=200)
    sharp = load_trace("synthetic", model, seed=2, requests=2, tokens=200, skew=1.5)
    assert sharp is not base and sharp.trace_id != base.trace_id
    assert load_trace("synthetic", model, seed=2, requests=2, tokens=200, skew=1.0) is base
    ref = synthetic.generate("deepseek-v2-lite", n_requests=2, n_tokens=200, seed=2, skew=1.5)
    assert sharp.trace_id == ref.trace_id and sharp.meta["generator"]["skew"] == 1.5
    generic = load_trace("synthetic", tiny_model, seed=0, requests=2, tokens=64, skew=2.0)
    assert generic.meta["generator"]["skew"] == 2.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="trace_skew"):
            load_trace("synthetic", model, skew=bad)
    with pytest.raises(ConfigError, match="generated with skew 1"):
        load_trace(base, model, skew=1.5)
    assert load_trace(sharp, model, skew=1.5) is sharp      # a loaded trace of that skew


def test_router_scores_are_kept_or_synthesised_and_gathered_per_step():
    from hdamoe_env.sim.sources import step_candidates, with_router_scores

    scored = load_trace("synthetic", get_model("mixtral-8x7b"), seed=1, requests=2)
    assert scored.cand_ids is not None and with_router_scores(scored, 0) is scored
    bare = RoutingTrace(topk_ids=scored.topk_ids, req_id=scored.req_id, pos=scored.pos,
                        phase=scored.phase, keep=scored.keep, meta={"E": scored.num_experts})
    made = with_router_scores(bare, 4)
    assert made.meta["score_kind"] == "synthetic"
    again = with_router_scores(bare, 4)
    np.testing.assert_array_equal(made.cand_scores, again.cand_scores)    # seeded
    rows = np.array([3, 0, 2])
    ids, vals = step_candidates(made, rows)
    assert ids.dtype == np.int64 and vals.dtype == np.float64 and ids.flags.c_contiguous
    np.testing.assert_array_equal(ids, made.cand_ids[:, rows])
    np.testing.assert_array_equal(vals, made.cand_scores[:, rows])
