"""Tests of traces.errors as the trace readers raise them: malformed reference JSON (layer keys,
ids, layer counts), out-of-range scores and unreadable files are typed errors; saved traces get
the usual permissions."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import make_trace, write_json
from traces.errors import HdMoeError, TraceFormatError, UnknownNameError


def test_one_base_class():
    import hdamoe_env.config.errors as core

    assert core.HdMoeError is HdMoeError
    assert issubclass(TraceFormatError, HdMoeError) and issubclass(UnknownNameError, HdMoeError)
    assert issubclass(TraceFormatError, ValueError)         # existing except clauses still work


@pytest.mark.parametrize("key", ["\u0661", "\u00b2", "\uff11", " 1", "+1"])
def test_non_ascii_layer_keys_are_refused(tmp_path, key):
    """A non-ASCII digit such as '١' (Arabic-Indic one) passes str.isdigit() but is no layer key."""
    path = write_json(tmp_path, "t.json", {"0": [[0, 1]], key: [[1, 2]]})
    with pytest.raises(TraceFormatError, match="decimal layer key"):
        traces.read_reference_json(path, E=4, k=2)


def test_json_true_is_not_an_expert_id(tmp_path):
    """A JSON `true` is refused, not read as expert 1."""
    path = write_json(tmp_path, "t.json", {"0": [[0, 1], [True, 2]], "1": [[0, 1], [2, 3]]})
    with pytest.raises(TraceFormatError, match="row 1: id True is not an integer"):
        traces.read_reference_json(path, E=4, k=2)


@pytest.mark.parametrize("layers", [4, 33])
def test_layer_count_must_match_the_model(tmp_path, layers):
    """`convert --model mixtral-8x7b` refuses a 4- or 33-layer file instead of writing it."""
    doc = {str(i): [[0, 1], [2, 3]] for i in range(layers)}
    path = write_json(tmp_path, "t.json", doc)
    with pytest.raises(TraceFormatError, match=f"has {layers} MoE layers.*model has 32"):
        traces.read_reference_json(path, model_key="mixtral-8x7b", num_layers=32)
    from hdamoe_env.app.cli import main

    assert main(["traces", "convert", str(path), "--model", "mixtral-8x7b", "--out",
                 str(tmp_path / "o.npz")]) == 2
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("bad", [-0.5, 1e30])
def test_softmax_scores_outside_0_1_are_refused(tmp_path, bad):
    """Negative or 1e30 scores in a 'softmax_all' trace are refused at load (they would drive
    gating)."""
    ids = np.array([[[0, 1], [2, 3]]], dtype=np.int16)
    cand = np.array([[[0, 1, 2], [2, 3, 0]]], dtype=np.int16)
    scores = np.array([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]], dtype=np.float32)
    scores[0, 1, 2] = bad
    trace = make_trace(ids, E=4, cand_ids=cand, cand_scores=scores,
                       meta={"E": 4, "score_kind": "softmax_all"})
    path = tmp_path / "t.hdtrace.npz"
    traces.save(trace, path)
    with pytest.raises(TraceFormatError, match="outside \\[0, 1\\]"):
        traces.load(path)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04junk", b"\x93NUMPY garbage"])
def test_unreadable_npz_is_typed(tmp_path, content):
    path = tmp_path / "t.npz"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match="t.npz"):
        traces.load(path)


def test_saved_trace_follows_the_umask(tmp_path):
    ids = np.array([[[0, 1], [2, 3]]], dtype=np.int16)
    old = os.umask(0o027)
    try:
        path = traces.save(make_trace(ids, E=4), tmp_path / "t.hdtrace.npz")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_save_into_a_missing_directory_is_typed(tmp_path):
    ids = np.array([[[0, 1], [2, 3]]], dtype=np.int16)
    with pytest.raises(TraceFormatError, match="does not exist"):
        traces.save(make_trace(ids, E=4), tmp_path / "nodir" / "t.npz")
    with pytest.raises(TraceFormatError, match="is a directory"):
        traces.save(make_trace(ids, E=4), tmp_path)
