"""Tests of traces.reference: the reference JSON reader (traces.md §3.2, §5).

On files generated in tmp_path: error messages, explicit k and layer-key offset, the gating-
simulation and prediction wrappers, segment detection, conversion to .npz. On the authors' traces
in ../shared/reference-traces (skipped when absent): paper-model.md §14.9 (Mixtral reasoning f and
group counts), the request structure of traces.md §3.2 and the extract shapes of §3.3; those files
are read in place, never copied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import write_json
from traces import TraceFormatError

# ----------------------------------------------------- the authors' traces, read in place
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


def _rows(rng: np.random.Generator, n: int, E: int = 8, k: int = 2) -> list[list[int]]:
    return [rng.choice(E, size=k, replace=False).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------ JSON errors


@pytest.mark.parametrize(
    ("name", "document", "pattern"),
    [
        ("experts_math_mixtral.json", None, r"invalid JSON at line 1 column \d+"),
        (
            "wrongk.json",
            {"0": [[0, 1], [2, 3, 4], [1, 2]], "1": [[0, 1], [1, 2], [2, 3]]},
            r"layer key '0' row 1: 3 ids \[2, 3, 4\]; expected k=2",
        ),
        (
            "range.json",
            {"0": [[0, 1], [2, 3]], "1": [[0, 1], [2, 9]]},
            r"layer key '1' row 1: ids \[2, 9\] out of range; expected ids in \[0, 8\)",
        ),
        (
            "dup.json",
            {"0": [[0, 1], [2, 3], [4, 4]], "1": [[0, 1], [2, 3], [4, 5]]},
            r"layer key '0' row 2: duplicate expert ids \[4, 4\]",
        ),
        (
            "ragged.json",
            {"0": [[0, 1], [2, 3], [4, 5]], "1": [[0, 1], [2, 3]]},
            r"layer key '1' has 2 rows but layer key '0' has 3.*row index missing or extra: 2",
        ),
        (
            "gap.json",
            {"0": [[0, 1]], "1": [[0, 1]], "3": [[0, 1]]},
            r"layer keys are not contiguous: key '2' is missing",
        ),
        ("key.json", {"0": [[0, 1]], "x": [[0, 1]]}, r"key 'x' is not a decimal layer key"),
        ("float.json", {"0": [[0, 1.5]]}, r"layer key '0' row 0: id 1.5 is not an integer"),
    ],
)
def test_reference_json_errors(tmp_path: Path, name: str, document: object, pattern: str) -> None:
    path = tmp_path / name
    if document is None:
        path.write_text('{"0": [[1, 2], [3, 4]], "1": [[1, 2], [3')  # truncated file
    else:
        path.write_text(json.dumps(document))
    with pytest.raises(TraceFormatError) as info:
        traces.read_reference_json(path, E=8)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert re.search(pattern, message), message


def test_reference_json_explicit_k_and_offset(tmp_path: Path) -> None:
    path = write_json(tmp_path, "x.json", {"1": [[0, 1]], "2": [[0, 1]]})
    with pytest.raises(TraceFormatError, match=r"row 0: 2 ids \[0, 1\]; expected k=3"):
        traces.read_reference_json(path, k=3, E=8)
    with pytest.raises(TraceFormatError, match="layer keys start at 1 but layer_key_offset=0"):
        traces.read_reference_json(path, layer_key_offset=0, E=8)
    trace = traces.read_reference_json(path)
    assert trace.meta["moe_layer_keys"] == ["1", "2"] and trace.num_experts == 2


def test_unknown_model_key_suggests(tmp_path: Path) -> None:
    path = write_json(tmp_path, "x.json", {"0": [[0, 1]]})
    with pytest.raises(traces.UnknownNameError, match="did you mean 'mixtral-8x7b'"):
        traces.read_reference_json(path, model_key="mixtral-8x7")


# ------------------------------------------------------------------------------ wrappers


def test_gating_simulation_wrapper(tmp_path: Path, rng: np.random.Generator) -> None:
    original = {str(key): _rows(rng, 12, E=16, k=4) for key in (1, 2, 3)}
    selected = {str(key): _rows(rng, 12, E=16, k=4) for key in (1, 2, 3)}
    path = write_json(
        tmp_path,
        "experts_reasoning_hd_sim_2_5_75_0.json",
        {
            "original_selected_experts": original,
            "selected_experts": selected,
            "simulation_meta": {"top_k": 4},
        },
    )
    trace = traces.read_reference_json(path, E=16)
    np.testing.assert_array_equal(trace.topk_ids[2], selected["3"])
    assert trace.orig_topk_ids is not None
    np.testing.assert_array_equal(trace.orig_topk_ids[0], original["1"])
    assert trace.meta["source"]["json_kind"] == "gating_simulation"
    assert trace.meta["category"] == "reasoning"
    assert trace.meta["moe_layer_keys"] == ["1", "2", "3"]
    only_original = write_json(tmp_path, "orig.json", {"original_selected_experts": original})
    trace = traces.read_reference_json(only_original, E=16)
    np.testing.assert_array_equal(trace.topk_ids[1], original["2"])
    assert trace.orig_topk_ids is None and trace.phase.tolist() == [2] * 12


def test_prediction_wrapper(tmp_path: Path, rng: np.random.Generator) -> None:
    selected = {str(key): _rows(rng, 10, E=64, k=6) for key in range(1, 5)}
    predicted = {str(key): _rows(rng, 10, E=64, k=6) for key in range(2, 5)}
    path = write_json(
        tmp_path,
        "experts_coding_ds_pre.json",
        {"selected_experts": selected, "predict_experts": predicted},
    )
    trace = traces.read_reference_json(path, model_key="deepseek-v2-lite")
    assert trace.pred_ids is not None and (trace.pred_ids[0] == -1).all()
    np.testing.assert_array_equal(trace.pred_ids[3], predicted["4"])
    assert trace.meta["predictor"]["kind"] == "gate_next_layer"


# ------------------------------------------------------------------------------ segments


def _conversation_file(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    """Two questions × two turns with a shared prefix, one replay diverging early."""
    rng = np.random.default_rng(5)
    all_sets = [[a, b] for a in range(8) for b in range(a + 1, 8)]

    def rows(n: int) -> list[list[int]]:
        return [list(all_sets[i]) for i in rng.integers(len(all_sets), size=n)]

    prefix = rows(20)
    answer = [rows(15), rows(12)]
    answer[0][0], answer[1][0] = [0, 1], [6, 7]  # force the prefix to end after 20 rows
    layer0: list[list[int]] = []
    turn1 = [prefix + answer[0], prefix + answer[1]]
    extra = [rows(10), rows(8)]
    turn2 = [turn1[0] + extra[0], list(turn1[1]) + extra[1]]
    turn2[1][25] = [2, 5] if turn2[1][25] != [2, 5] else [3, 5]  # replay of q1 diverges at 25
    for q in range(2):
        layer0 += turn1[q] + turn2[q]
    layer1 = rows(len(layer0))
    path = write_json(tmp_path, "experts_writing_mixtral.json", {"0": layer0, "1": layer1})
    expected = {
        "starts": [0, 35, 80, 112],
        "lengths": [35, 45, 32, 40],
        "prefix": 20,
        "replay": [35, 25],
    }
    return path, expected


def test_segment_detection(tmp_path: Path) -> None:
    path, expected = _conversation_file(tmp_path)
    trace = traces.read_reference_json(path)
    segments = trace.meta["segments"]
    for key, value in expected.items():
        assert segments[key] == value, key
    assert trace.req_id.tolist() == [0] * 35 + [1] * 45 + [2] * 32 + [3] * 40
    assert trace.conv_id.tolist() == [0] * 80 + [1] * 72
    assert trace.turn.tolist() == [0] * 35 + [1] * 45 + [0] * 32 + [1] * 40
    assert trace.pos[35] == 0 and trace.pos[79] == 44
    # content = turn-1 rows after the prefix + turn-2 rows after the replay
    assert int(trace.keep.sum()) == (35 - 20) + (45 - 35) + (32 - 20) + (40 - 25)
    assert int(trace.unique.sum()) == int(trace.keep.sum()) + 20
    assert trace.keep[20] and not trace.keep[19] and trace.unique[0]
    assert not trace.keep[35 + 34] and trace.keep[35 + 35]
    assert trace.meta["category"] == "writing" and trace.meta["model"] == "mixtral-8x7b"
    assert trace.meta["source"]["license"] == "MIT"
    assert trace.meta["ids_rank_ordered"] is None
    single = traces.read_reference_json(path, segment_detection=False)
    assert single.keep.all() and (single.req_id == 0).all()


def test_convert_reference(tmp_path: Path) -> None:
    path, _ = _conversation_file(tmp_path)
    out = tmp_path / "out" / "w.hdtrace.npz"
    out.parent.mkdir()
    trace = traces.convert_reference(path, out)
    loaded = traces.load(out)
    assert loaded.trace_id == trace.trace_id
    assert loaded.meta["source"]["sha256"] == trace.meta["source"]["sha256"]
    np.testing.assert_array_equal(loaded.unique, trace.unique)
