"""RoutingTrace data model: dtypes, views, frequencies, groups, trace id (traces.md §5, §3.2)."""

from __future__ import annotations

import numpy as np
import pytest

import traces
from tests.traces.trace_helpers import make_trace
from traces import RoutingTrace, TraceFormatError


def _ids() -> np.ndarray:
    # L = 2, T = 4, k = 2, E = 4
    return np.array([[[0, 1], [1, 0], [2, 3], [0, 2]], [[3, 2], [1, 2], [0, 1], [3, 0]]])


def test_dtypes_and_dimensions() -> None:
    trace = make_trace(_ids(), E=4, req_lengths=[2, 2])
    assert trace.topk_ids.dtype == np.int16 and trace.req_id.dtype == np.int32
    assert trace.pos.dtype == np.int32 and trace.phase.dtype == np.uint8
    assert trace.keep.dtype == np.bool_
    assert (trace.num_layers, trace.num_tokens, trace.top_k, trace.num_experts) == (2, 4, 2, 4)
    assert trace.meta["L"] == 2 and trace.meta["k"] == 2 and trace.meta["J"] == 0
    assert not trace.topk_ids.flags.writeable
    trace.validate()


def test_layer_frequencies_and_groups() -> None:
    trace = make_trace(_ids(), E=4)
    freq = trace.layer_frequencies(0)
    np.testing.assert_allclose(freq, [0.75, 0.5, 0.5, 0.25])
    assert freq.sum() == pytest.approx(2.0)  # Σ f_i = k (paper-model.md §1)
    sets, f_g = trace.groups(0)
    np.testing.assert_array_equal(sets, [[0, 1], [0, 2], [2, 3]])  # sorted, lexicographic
    np.testing.assert_allclose(f_g, [0.5, 0.25, 0.25])
    sets, f_g = trace.groups(1, rows=np.array([0, 3]))
    np.testing.assert_array_equal(sets, [[0, 3], [2, 3]])
    np.testing.assert_allclose(
        trace.layer_frequencies(1, rows=np.array([0, 3])), [0.5, 0, 0.5, 1.0]
    )


def test_views() -> None:
    keep = np.array([False, True, True, True])
    unique = np.array([True, True, True, True])
    trace = make_trace(_ids(), E=4, keep=keep, unique=unique)
    np.testing.assert_array_equal(trace.view("raw"), [0, 1, 2, 3])
    np.testing.assert_array_equal(trace.view("content"), [1, 2, 3])
    np.testing.assert_array_equal(trace.view("unique"), [0, 1, 2, 3])
    with pytest.raises(traces.UnknownNameError, match="did you mean 'content'"):
        trace.view("contnet")


def test_trace_id_depends_on_routing_not_meta() -> None:
    a = make_trace(_ids(), E=4)
    b = make_trace(_ids(), E=4, meta={"E": 4, "category": "x"})
    changed = _ids().copy()
    changed[1, 3] = [3, 1]
    c = make_trace(changed, E=4)
    assert a.trace_id == b.trace_id
    assert a.trace_id != c.trace_id
    assert len(a.trace_id) == 64


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [
        (np.array([[[0, 4]]]), "layer 0 row 0: ids [0, 4] out of range"),
        (np.array([[[0, 1]], [[2, 2]]]), "layer 1 row 0: duplicate expert ids [2, 2]"),
    ],
)
def test_validate_names_layer_and_row(ids: np.ndarray, fragment: str) -> None:
    trace = make_trace(ids, E=4)
    with pytest.raises(TraceFormatError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        trace.validate("some.npz")


def test_request_runs_must_be_contiguous() -> None:
    trace = RoutingTrace(
        topk_ids=_ids(),
        req_id=[0, 1, 0, 2],
        pos=[0, 0, 0, 0],
        phase=np.ones(4, np.uint8),
        keep=np.ones(4, bool),
        meta={"E": 4},
    )
    with pytest.raises(TraceFormatError, match="'req_id' row 2: request 0 starts a second run"):
        trace.validate("f.npz")
    trace = RoutingTrace(
        topk_ids=_ids(),
        req_id=[0, 0, 0, 1],
        pos=[0, 1, 3, 0],
        phase=np.ones(4, np.uint8),
        keep=np.ones(4, bool),
        meta={"E": 4},
    )
    with pytest.raises(TraceFormatError, match="'pos' row 2"):
        trace.validate("f.npz")


def test_structural_errors() -> None:
    with pytest.raises(TraceFormatError, match=r"meta\['E'\]"):
        RoutingTrace(
            topk_ids=_ids(),
            req_id=np.zeros(4),
            pos=np.arange(4),
            phase=np.ones(4, np.uint8),
            keep=np.ones(4, bool),
            meta={},
        )
    with pytest.raises(TraceFormatError, match="'keep' must have shape"):
        make_trace(_ids(), E=4, keep=np.ones(3, bool))
    with pytest.raises(TraceFormatError, match="'cand_ids' and 'cand_scores'"):
        make_trace(_ids(), E=4, cand_ids=np.zeros((2, 4, 3), int))


def test_candidates_must_start_with_topk(tiny_trace: RoutingTrace) -> None:
    tiny_trace.validate()
    cand = np.array(tiny_trace.cand_ids)
    cand[2, 5, [0, 6]] = cand[2, 5, [6, 0]]  # a non-top-k id moved forward
    broken = tiny_trace.replace(cand_ids=cand)
    with pytest.raises(TraceFormatError, match="'cand_ids' layer 2 row 5"):
        broken.validate()


def test_concatenate_renumbers_requests(tiny_trace: RoutingTrace) -> None:
    both = traces.concatenate([tiny_trace, tiny_trace])
    both.validate()
    assert both.num_tokens == 2 * tiny_trace.num_tokens
    assert len(traces.requests(both)) == 2 * len(traces.requests(tiny_trace))
    assert both.cand_ids is not None and both.pred_ids is None
