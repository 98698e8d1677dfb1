"""Tests of traces.io: the canonical .npz round trip and what ``load`` refuses (traces.md §2, §5).

Malformed files are generated in tmp_path by the tests themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import traces
from traces import RoutingTrace, TraceFormatError


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




# ------------------------------------------------------------------ input files (size, type, depth)
def test_input_files_must_be_regular_and_small(tmp_path, monkeypatch):
    import os

    from traces.errors import InputFileError
    from traces.io import check_input_file, read_input_bytes

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="FIFO"):
        read_input_bytes(fifo, "--trace")                  # returns at once, never blocks
    with pytest.raises(InputFileError, match="device"):
        check_input_file("/dev/zero", "--trace")
    with pytest.raises(InputFileError, match="directory"):
        check_input_file(tmp_path)
    with pytest.raises(InputFileError, match="does not exist"):
        check_input_file(tmp_path / "nothing.json")
    small = tmp_path / "small.json"
    small.write_text("[1, 2, 3]")
    assert read_input_bytes(small) == b"[1, 2, 3]"
    monkeypatch.setenv("HDAMOE_MAX_INPUT_BYTES", "4")
    with pytest.raises(InputFileError, match="HDAMOE_MAX_INPUT_BYTES"):
        read_input_bytes(small)
    with pytest.raises(InputFileError, match="cap"):
        traces.read_reference_json(small, E=8, k=2)


def test_json_depth_is_bounded_without_recursion(tmp_path):
    from traces.errors import InputFileError
    from traces.io import MAX_JSON_DEPTH, json_depth, loads_json

    assert json_depth(b'[[1, 2], {"a": [3]}]') == 3
    assert json_depth(b'["[[[[[[", "]]]"]') <= 7
    assert json_depth("[" * 70 + '"]]]]"' + "]" * 70) == 70      # strings skipped exactly
    assert loads_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InputFileError, match="100000 levels"):
        traces.read_reference_json(deep, E=8, k=2)
