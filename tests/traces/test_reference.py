"""The authors' traces in ../shared/reference-traces (skipped when absent).

Pins paper-model.md §14.9 (Mixtral reasoning f and group counts), the request structure of
traces.md §3.2 and the extract shapes of §3.3. The files are read in place, never copied.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import traces

REASONING = "mixtral/experts_reasoning_mixtral.json"
DEEPSEEK = "ds/hd_gating/experts_reasoning_hd_sim_4_4.original_selected_experts.json"
QWEN2 = "qwen/hd_gating/experts_reasoning_hd_sim_4_4.original_selected_experts.layers0-1.json"


@pytest.fixture(scope="module")
def reasoning(request: pytest.FixtureRequest) -> traces.RoutingTrace:
    directory: Path = request.getfixturevalue("reference_dir")
    return traces.read_reference_json(directory / REASONING)


def test_reasoning_shape_and_frequencies(reasoning: traces.RoutingTrace) -> None:
    """paper-model.md §14.9: all 8,386 rows, layer key "0"."""
    assert reasoning.topk_ids.shape == (32, 8386, 2)
    assert reasoning.num_experts == 8 and reasoning.meta["moe_layer_keys"][0] == "0"
    np.testing.assert_allclose(
        reasoning.layer_frequencies(0),
        [0.2617, 0.2346, 0.2201, 0.2832, 0.2564, 0.2817, 0.1984, 0.2639],
        atol=5e-5,
    )
    assert reasoning.layer_frequencies(0).sum() == pytest.approx(2.0)


def test_reasoning_groups(reasoning: traces.RoutingTrace) -> None:
    """paper-model.md §14.9: 28 distinct sorted groups in layers 0–29, 26 in layers 30 and 31."""
    counts = [len(reasoning.groups(layer)[0]) for layer in range(32)]
    assert counts == [28] * 30 + [26, 26]


def test_reasoning_segments(reasoning: traces.RoutingTrace) -> None:
    """traces.md §3.2 table, reasoning row."""
    segments = reasoning.meta["segments"]
    assert segments["lengths"] == [1000, 1142, 870, 1041, 652, 724, 590, 998, 634, 735]
    assert segments["prefix"] == 532
    assert segments["replay"] == [1000, 870, 652, 590, 634]  # whole turn 1 replayed
    assert reasoning.view("content").size == 1980
    assert reasoning.view("unique").size == 2512
    assert reasoning.meta["category"] == "reasoning"
    assert reasoning.meta["source"]["license"] == "MIT"
    assert reasoning.meta["source"]["notice"] is None or "MIT" in reasoning.meta["source"]["notice"]
    assert len(traces.requests(reasoning)) == 5


def test_reasoning_stats_match_traces_md(reasoning: traces.RoutingTrace) -> None:
    """traces.md §4.2, reasoning row (content view, means over 32 layers)."""
    stats = traces.trace_stats(reasoning, floors=False, n_batches=100)
    assert stats["top10_share"] == pytest.approx(0.162, abs=0.002)
    assert stats["max_over_mean"] == pytest.approx(1.29, abs=0.01)
    assert stats["max_over_mean_worst"] == pytest.approx(1.67, abs=0.01)
    assert stats["gini"] == pytest.approx(0.103, abs=0.002)
    assert stats["top3_pair_mass"] == pytest.approx(0.282, abs=0.002)
    assert stats["pair_tv_vs_null"] == pytest.approx(0.262, abs=0.003)
    assert stats["reuse_lag1"] == pytest.approx(0.354, abs=0.002)
    assert stats["reuse_independent"] == pytest.approx(0.260, abs=0.002)


def test_deepseek_extract(reference_dir: Path) -> None:
    """traces.md §3.3: 26 layers × 128 rows × 6, layer keys "1".."26" (offset 1)."""
    trace = traces.read_reference_json(reference_dir / DEEPSEEK)
    assert trace.topk_ids.shape == (26, 128, 6)
    assert trace.meta["moe_layer_keys"] == [str(key) for key in range(1, 27)]
    assert trace.num_experts == 64 and trace.meta["model"] == "deepseek-v2-lite"
    explicit = traces.read_reference_json(
        reference_dir / DEEPSEEK, model_key="deepseek-v2-lite", layer_key_offset=1
    )
    assert explicit.trace_id == trace.trace_id
    with pytest.raises(traces.TraceFormatError, match="layer keys start at 1"):
        traces.read_reference_json(reference_dir / DEEPSEEK, layer_key_offset=0)


def test_qwen2_extract(reference_dir: Path) -> None:
    """traces.md §3.3 and the §4.5 per-layer numbers of the Qwen2 extract."""
    trace = traces.read_reference_json(reference_dir / QWEN2)
    assert trace.topk_ids.shape == (2, 512, 8) and trace.num_experts == 64
    stats = traces.trace_stats(trace, floors=False, n_batches=50)["per_layer"]
    np.testing.assert_allclose(stats["gini"], [0.443, 0.797], atol=0.001)
    np.testing.assert_allclose(stats["top10_share"], [0.327, 0.653], atol=0.001)
    assert stats["distinct_groups"] == [490, 296]
