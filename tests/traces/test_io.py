"""Canonical .npz round trip and the reference JSON reader (traces.md §2, §3.2, §5).

Malformed files are generated in tmp_path by the tests themselves; no reference data is copied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import write_json
from traces import RoutingTrace, TraceFormatError


def _rows(rng: np.random.Generator, n: int, E: int = 8, k: int = 2) -> list[list[int]]:
    return [rng.choice(E, size=k, replace=False).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------ .npz


def test_round_trip_preserves_arrays_and_trace_id(tmp_path: Path) -> None:
    trace = traces.generate(
        "deepseek-v2-lite", n_requests=3, n_tokens=200, seed=1, predictor="noisy_oracle"
    )
    path = traces.save(trace, tmp_path / "t.hdtrace.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.hdtrace.npz"]  # no temp left
    loaded = traces.load(path)
    assert loaded.trace_id == trace.trace_id
    for name, array in trace.array_items():
        loaded_array = getattr(loaded, name)
        assert loaded_array.dtype == array.dtype, name
        np.testing.assert_array_equal(loaded_array, array, err_msg=name)
    assert loaded.meta["generator"] == trace.meta["generator"]
    assert loaded.meta["predictor"]["kind"] == "noisy_oracle"


def _rewrite(path: Path, out: Path, **changes: object) -> Path:
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(arrays["meta"].tobytes())
    for key, value in changes.items():
        if key.startswith("meta_"):
            meta[key[5:]] = value
        elif value is None:
            arrays.pop(key)
        else:
            arrays[key] = value  # type: ignore[assignment]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(out, **arrays)
    return out


def test_load_rejects_newer_format_version(tmp_path: Path, tiny_mixtral: RoutingTrace) -> None:
    path = traces.save(tiny_mixtral, tmp_path / "a.npz")
    bad = _rewrite(path, tmp_path / "newer.npz", meta_format_version=2)
    with pytest.raises(TraceFormatError, match=r"newer\.npz: format_version 2 is newer"):
        traces.load(bad)


def test_load_validates_content(tmp_path: Path, tiny_mixtral: RoutingTrace) -> None:
    path = traces.save(tiny_mixtral, tmp_path / "a.npz")
    ids = np.array(tiny_mixtral.topk_ids)
    ids[3, 17] = [5, 9]
    bad = _rewrite(path, tmp_path / "range.npz", topk_ids=ids, meta_trace_id=None)
    with pytest.raises(
        TraceFormatError,
        match=r"range\.npz: array 'topk_ids' layer 3 row 17: ids \[5, 9\] out of "
        r"range; expected ids in \[0, E\) with E=8",
    ):
        traces.load(bad)
    ids = np.array(tiny_mixtral.topk_ids)
    ids[0, 4] = [6, 6]
    bad = _rewrite(
        path,
        tmp_path / "dup.npz",
        topk_ids=ids,
        cand_ids=None,
        cand_scores=None,
        meta_trace_id=None,
        meta_J=None,
    )
    with pytest.raises(
        TraceFormatError,
        match=r"dup\.npz: array 'topk_ids' layer 0 row 4: "
        r"duplicate",
    ):
        traces.load(bad)
    bad = _rewrite(path, tmp_path / "short.npz", keep=np.ones(5, bool))
    with pytest.raises(TraceFormatError, match=r"short\.npz: array 'keep' must have shape"):
        traces.load(bad)
    bad = _rewrite(path, tmp_path / "missing.npz", pos=None)
    with pytest.raises(TraceFormatError, match=r"missing\.npz: required array\(s\) \['pos'\]"):
        traces.load(bad)


def test_load_detects_modified_arrays(tmp_path: Path, tiny_mixtral: RoutingTrace) -> None:
    path = traces.save(tiny_mixtral, tmp_path / "a.npz")
    keep = np.array(tiny_mixtral.keep)
    keep[0] = False
    bad = _rewrite(path, tmp_path / "edited.npz", keep=keep)
    with pytest.raises(TraceFormatError, match="stored trace_id"):
        traces.load(bad)


def test_load_rejects_non_npz(tmp_path: Path) -> None:
    path = tmp_path / "junk.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(TraceFormatError, match=r"junk\.npz: cannot read as \.npz"):
        traces.load(path)


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
